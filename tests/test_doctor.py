from __future__ import annotations

import json
import os
from dataclasses import asdict

import pytest
import torch

from lightning_speedkit import doctor
from lightning_speedkit.hardware import CpuInfo, GpuInfo

CPU_2_CORES_AVX512_BF16 = CpuInfo(2, 2, "AMD EPYC", ("avx2", "avx512f", "avx512_bf16"), "AVX512")
CPU_2_CORES_AVX2 = CpuInfo(2, 2, "Intel Core", ("avx2",), "AVX2")
CPU_AMX = CpuInfo(112, 112, "Xeon 8480+", ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16"), "AVX512")
CPU_32_CORES = CpuInfo(32, 32, "EPYC", ("avx2",), "AVX2")
H100 = GpuInfo(0, "NVIDIA H100", (9, 0), 80 * 2**30)
T4 = GpuInfo(0, "Tesla T4", (7, 5), 16 * 2**30)
P100 = GpuInfo(0, "Tesla P100", (6, 0), 16 * 2**30)
A100S = [GpuInfo(i, "NVIDIA A100", (8, 0), 40 * 2**30) for i in range(4)]


@pytest.mark.parametrize(
    ("cpu", "gpus", "precision", "strategy", "num_workers"),
    [
        (CPU_2_CORES_AVX512_BF16, [], "32-true", "auto", 0),
        (CPU_2_CORES_AVX2, [], "32-true", "auto", 0),
        (CPU_AMX, [], "32-true", "auto", 28),
        (CPU_32_CORES, [H100], "16-mixed", "auto", 8),
        (CPU_2_CORES_AVX2, [H100], "16-mixed", "auto", 1),
        (CPU_32_CORES, [T4], "16-mixed", "auto", 8),
        (CPU_32_CORES, A100S, "16-mixed", "ddp", 7),
        (CPU_32_CORES, [P100], "32-true", "auto", 8),
        (CPU_32_CORES, [H100, GpuInfo(1, "Tesla P100", (6, 0), 2**34)], "32-true", "ddp", 8),
    ],
)
def test_recommend_values(cpu: CpuInfo, gpus: list[GpuInfo], precision: str, strategy: str, num_workers: int) -> None:
    """`recommend` picks precision, strategy and num_workers from the CPU and GPUs, each with a one-line reason."""
    result = doctor.recommend(cpu, gpus)
    assert {key: choice["value"] for key, choice in result.items()} == {
        "precision": precision,
        "strategy": strategy,
        "num_workers": num_workers,
    }
    for choice in result.values():
        assert choice["reason"]
        assert "\n" not in choice["reason"]


@pytest.mark.parametrize(
    ("cpu", "gpus", "key", "fragments", "absent"),
    [
        (CPU_2_CORES_AVX2, [], "precision", ["no bf16 instructions", "'16-mixed'", "10x", "warning"], ["avx512_bf16"]),
        (CPU_2_CORES_AVX512_BF16, [], "precision", ["avx512_bf16", "PrecisionTuner", "precision.json"], ["silently"]),
        (CPU_AMX, [], "precision", ["avx512_bf16 and amx_bf16", "times 'bf16-mixed'"], []),
        (CPU_32_CORES, [H100], "precision", ["'bf16-mixed' is also available"], []),
        (CPU_32_CORES, [T4], "precision", ["'bf16-mixed' is not", "Tesla T4, 7.5"], []),
        (CPU_32_CORES, [P100], "precision", ["no tensor cores", "Tesla P100, 6.0"], []),
        (CPU_32_CORES, A100S, "strategy", ["devices=4"], []),
        (CPU_32_CORES, [H100], "strategy", ["single device"], []),
        (CPU_2_CORES_AVX2, [], "strategy", ["single process"], []),
        (CPU_2_CORES_AVX2, [], "num_workers", ["compete with the model for the same cores", "DataLoaderTuner"], []),
    ],
)
def test_recommend_reasons(
    cpu: CpuInfo, gpus: list[GpuInfo], key: str, fragments: list[str], absent: list[str]
) -> None:
    """Each reason names the fact that decided it (bf16 instructions and the measurement, devices, cores)."""
    reason = doctor.recommend(cpu, gpus)[key]["reason"]
    for fragment in fragments:
        assert fragment in reason
    for fragment in absent:
        assert fragment not in reason


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
    assert sorted(report) == ["cpu", "gpus", "nvml", "recommendation", "versions"]
    assert set(report["recommendation"]) == {"precision", "strategy", "num_workers"}


def test_main_text_report(capsys: pytest.CaptureFixture[str]) -> None:
    """`main()` prints a readable report with versions, CPU facts and the recommended settings, and returns 0."""
    assert doctor.main() == 0
    out = capsys.readouterr().out
    for fragment in ("recommended", "precision", "num_workers", "torch", "lightning", "bf16 flags", "nvml"):
        assert fragment in out


def test_format_text_lists_each_gpu() -> None:
    """`format_text` shows each GPU's index, name, compute capability, memory and bf16/tensor-core support."""
    report = doctor.collect()
    report["gpus"] = [asdict(GpuInfo(1, "NVIDIA H100", (9, 0), 80 * 2**30))]
    text = doctor.format_text(report)
    assert "cuda:1" in text
    assert "NVIDIA H100, compute 9.0, 80.0 GiB, bf16 yes, tensor cores yes" in text
