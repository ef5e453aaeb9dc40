"""Tests of ``speedkit doctor``: the report, its text and JSON; the recommendation is tested in test_recommend.py."""

from __future__ import annotations

import json
import os
from dataclasses import asdict

import pytest
import torch

from lightning_speedkit import doctor
from lightning_speedkit.hardware import GpuInfo, cpu_info, gpu_infos
from lightning_speedkit.recommend import recommend


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only report")
def test_collect_on_this_cpu_machine() -> None:
    """`collect()` on a CPU-only machine is JSON-serialisable, lists no GPUs, and says why NVML does not answer."""
    report = doctor.collect()
    assert json.loads(json.dumps(report))["cpu"]["flags"] == list(report["cpu"]["flags"])
    assert report["gpus"] == []
    assert report["nvml"]["available"] is False
    assert report["nvml"]["reason"]
    assert report["versions"]["torch"] == torch.__version__
    assert report["versions"]["torch_cuda"] is None
    assert report["cpu"]["logical_cores"] == os.cpu_count()
    assert report["recommendation"]["strategy"]["value"] == "auto"


def test_main_json_prints_valid_json(capsys: pytest.CaptureFixture[str]) -> None:
    """`main(json_output=True)` prints one JSON document holding the whole report and returns 0."""
    assert doctor.main(json_output=True) == 0
    report = json.loads(capsys.readouterr().out)
    assert sorted(report) == ["cpu", "gpus", "nvml", "recommendation", "remembered", "versions"]
    assert set(report["recommendation"]) == {"precision", "strategy", "num_workers"}


def test_main_text_report(capsys: pytest.CaptureFixture[str]) -> None:
    """`main()` prints a readable report with versions, CPU facts and the recommended settings, and returns 0."""
    assert doctor.main() == 0
    out = capsys.readouterr().out
    for fragment in (
        "recommended",
        "precision",
        "num_workers",
        "torch",
        "lightning",
        "ISA flags",
        "forced ISA",
        "nvml",
    ):
        assert fragment in out


def test_format_text_lists_each_gpu() -> None:
    """`format_text` shows each GPU's index, name, compute capability, memory and bf16/tensor-core support."""
    report = doctor.collect()
    report["gpus"] = [asdict(GpuInfo(1, "NVIDIA H100", (9, 0), 80 * 2**30))]
    text = doctor.format_text(report)
    assert "cuda:1" in text
    assert "NVIDIA H100, compute 9.0, 80.0 GiB, bf16 yes, tensor cores yes" in text


def test_recommendation_is_the_machines_rules_for_every_gpu() -> None:
    """Doctor recommends what `lightning_speedkit.recommend.recommend` decides for every GPU torch sees (or one CPU)."""
    assert doctor.collect()["recommendation"] == recommend(cpu_info(), gpu_infos())
