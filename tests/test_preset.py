"""Tests of ``speedkit.preset`` and ``default_callbacks``."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import load_benchmark
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy

import lightning_speedkit as speedkit
from lightning_speedkit.hardware import CpuInfo, GpuInfo
from lightning_speedkit.loggers import RunSummary, wandb_is_offline
from lightning_speedkit.preset import choose, default_callbacks, preset

CPU2 = CpuInfo(2, 2, "test CPU", ("avx2", "avx512f", "avx512_bf16"), "AVX512")
CPU_AMX = CpuInfo(8, 8, "test CPU", ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16"), "AVX512")
A100 = GpuInfo(0, "NVIDIA A100", (8, 0), 40 * 2**30)
P100 = GpuInfo(0, "Tesla P100", (6, 0), 16 * 2**30)


@pytest.mark.parametrize(
    ("cpu", "gpus", "devices", "expected"),
    [
        (CPU2, [], "auto", ("cpu", 1, "32-true", "auto")),
        (CPU2, [], 2, ("cpu", 2, "32-true", "ddp")),
        (CPU_AMX, [], 1, ("cpu", 1, "32-true", "auto")),
        (CPU2, [A100], "auto", ("gpu", 1, "16-mixed", "auto")),
        (CPU2, [A100] * 4, 4, ("gpu", 4, "16-mixed", "ddp")),
        (CPU2, [P100], 1, ("gpu", 1, "32-true", "auto")),
    ],
)
def test_choices_follow_the_hardware(
    cpu: CpuInfo, gpus: list[GpuInfo], devices: int | str, expected: tuple[Any, ...]
) -> None:
    """Accelerator, devices, precision and strategy come from the hardware, each with a reason."""
    chosen = choose(cpu, gpus, devices=devices)
    assert (chosen["accelerator"], chosen["devices"], chosen["precision"], chosen["strategy"]) == expected
    assert all(chosen["reasons"][key] for key in ("accelerator", "devices", "precision", "strategy"))


def test_cpu_precision_is_a_starting_point_that_is_measured() -> None:
    """precision="auto" starts from fp32 on a CPU with bf16 instructions and asks PrecisionTuner to measure bf16."""
    chosen = choose(CPU2, [])
    assert chosen["tune_precision"] is True
    assert "PrecisionTuner times 'bf16-mixed'" in chosen["reasons"]["precision"]
    assert choose(CPU2, [], precision="bf16-mixed")["tune_precision"] is False


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"devices": 3}, r"`devices`=3 asks for more than this machine has: 2"),
        ({"devices": 0}, "`devices`"),
        ({"devices": "many"}, "`devices`"),
        ({"num_nodes": 0}, "`num_nodes`"),
        ({"precision": "fp8"}, "`precision`"),
    ],
)
def test_bad_choices_are_refused(kwargs: dict[str, Any], match: str) -> None:
    """Too many devices, or a malformed argument, is an error naming the argument."""
    with pytest.raises(ValueError, match=match):
        choose(CPU2, [], **kwargs)


@pytest.mark.parametrize(
    ("gpus", "precision", "asked", "expected"),
    [
        ([], "auto", "auto", True),  # ChannelsLast times both layouts at fit start
        ([A100], "auto", "auto", True),
        ([A100], "32-true", "auto", True),  # fp32 on a GPU: measured too, not assumed either way
        ([], "auto", False, False),
        ([A100], "32-true", True, True),
    ],
)
def test_channels_last_is_chosen_by_device_and_precision(
    gpus: list[GpuInfo], precision: str, asked: bool | str, expected: bool
) -> None:
    """``channels_last="auto"`` adds the measuring ChannelsLast on every device; an explicit value wins."""
    choices = choose(CPU2, gpus, precision=precision, channels_last=asked)
    assert choices["channels_last"] is expected
    assert choices["reasons"]["channels_last"]


def test_more_gpus_than_exist_is_an_error() -> None:
    """Asking for 4 GPUs on a 1-GPU machine names what exists."""
    with pytest.raises(ValueError, match="1 GPU"):
        choose(CPU2, [A100], devices=4)


def test_default_callbacks_order_and_optional_parts(tmp_path: Path) -> None:
    """Ours come in acting order; the batch-size finder, pruning and export only when asked for."""
    everything = {
        "batch_size": "auto",
        "prune": 0.5,
        "export": tmp_path,
        "precision": True,
        "lr_finder": True,
        "compile": True,
    }
    names = [type(c).__name__ for c in default_callbacks(**everything)]
    assert names == [
        "ChannelsLast",
        "PrecisionTuner",
        "DataLoaderTuner",
        "BatchSizeFinder",
        "LRFinder",
        "Compile",
        "WarmupScheduler",
        "TrainingGuard",
        "UtilizationMonitor",
        "StructuredPruning",
        "Int8Export",
    ]
    off = {"warmup": False, "monitor": False, "tune_data": False, "channels_last": False, "guard": False}
    assert [type(c).__name__ for c in default_callbacks(**off)] == []


def test_user_callback_replaces_ours_of_the_same_type() -> None:
    """A user's WarmupScheduler takes our slot: exactly one, and it is theirs; other user callbacks follow ours."""
    mine = speedkit.WarmupScheduler(warmup=3)
    other = RunSummary()
    chosen = default_callbacks(callbacks=[other, mine])
    assert [c for c in chosen if isinstance(c, speedkit.WarmupScheduler)] == [mine]
    assert chosen[-1] is other


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"prune": 2.0}, "`prune`"), ({"batch_size": 64}, "`batch_size`"), ({"export": 3}, "`export`")],
)
def test_default_callbacks_refuse_bad_input(kwargs: dict[str, Any], match: str) -> None:
    """Malformed optional parts are refused with the argument's name."""
    with pytest.raises(ValueError, match=match):
        default_callbacks(**kwargs)


def test_preset_on_this_cpu(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """On this CPU-only machine: one process, fp32, our callbacks, and a printed summary on ``trainer.speedkit``."""
    trainer = preset(logger="csv", default_root_dir=tmp_path, max_epochs=1)
    assert isinstance(trainer.strategy, SingleDeviceStrategy)
    assert trainer.precision == "32-true"
    assert trainer.speedkit["precision"] == "32-true"
    assert isinstance(trainer.logger, CSVLogger)
    names = [type(c).__name__ for c in trainer.callbacks]
    expected = {"DataLoaderTuner", "ChannelsLast", "PrecisionTuner", "WarmupScheduler", "UtilizationMonitor"}
    assert expected | {"RunSummary"} <= set(names)
    assert "precision" in trainer.speedkit.summary()
    assert "channels_last" in trainer.speedkit.summary()


def test_preset_two_cpu_devices_gives_ddp(tmp_path: Path) -> None:
    """``devices=2`` on CPU builds a gloo DDP strategy over two processes."""
    trainer = preset(devices=2, logger=False, default_root_dir=tmp_path, verbose=False)
    assert isinstance(trainer.strategy, DDPStrategy)
    assert trainer.strategy._process_group_backend == "gloo"
    assert trainer.num_devices == 2
    assert trainer.speedkit["strategy"] == "ddp"


def test_preset_refuses_more_devices_than_cores(tmp_path: Path) -> None:
    """More CPU processes than cores is a clear error before any Trainer is built."""
    with pytest.raises(ValueError, match="`devices`"):
        preset(devices=64, logger=False, default_root_dir=tmp_path)


def test_wandb_is_offline_without_a_key() -> None:
    """Without ``WANDB_API_KEY`` (or with ``WANDB_MODE=offline``) W&B runs offline."""
    assert wandb_is_offline({})
    assert wandb_is_offline({"WANDB_MODE": "offline", "WANDB_API_KEY": "x"})
    assert not wandb_is_offline({"WANDB_API_KEY": "x"})


_OFFLINE_RUN = """
import sys
sys.path.insert(0, {tests!r})
from conftest import TinyClassifier
from lightning_speedkit import preset
trainer = preset(default_root_dir={root!r}, max_epochs=1, log_every_n_steps=1, enable_progress_bar=False)
assert type(trainer.logger).__name__ == "WandbLogger", trainer.logger
trainer.fit(TinyClassifier())
"""


@pytest.mark.slow
def test_wandb_offline_run_receives_speedkit_keys(tmp_path: Path) -> None:
    """An offline W&B run (no API key) gets the ``speedkit/*`` metrics, and the summary JSON is written."""
    # A fresh process: wandb keeps its mode per process, and other tests run it disabled.
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(WANDB_MODE="offline", WANDB_SILENT="true")
    code = _OFFLINE_RUN.format(tests=str(Path(__file__).parent), root=str(tmp_path))
    subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, check=True, timeout=600)
    runs = list(tmp_path.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(runs) == 1
    keys = set(re.findall(rb"speedkit/[a-z_/0-9]+", runs[0].read_bytes()))
    assert {b"speedkit/lr/factor", b"speedkit/monitor/data_wait_fraction", b"speedkit/data/num_workers"} <= keys
    summary = json.loads(next(tmp_path.rglob("speedkit_summary.json")).read_text())
    assert {"UtilizationMonitor", "DataLoaderTuner"} <= set(summary)


def test_lr_auto_adds_the_lr_finder_and_guard_false_removes_the_guard(tmp_path: Path) -> None:
    """``lr="auto"`` adds an LRFinder (the default keeps the user's LR); the guard is on unless ``guard=False``."""
    names = lambda trainer: [type(c).__name__ for c in trainer.callbacks]  # noqa: E731
    default = preset(logger=False, verbose=False, default_root_dir=tmp_path)
    assert "LRFinder" not in names(default)
    assert "TrainingGuard" in names(default)
    tuned = preset(logger=False, verbose=False, default_root_dir=tmp_path, lr="auto", guard={"backoff": 0.25})
    assert "LRFinder" in names(tuned)
    guard = next(c for c in tuned.callbacks if isinstance(c, speedkit.TrainingGuard))
    assert guard.backoff == 0.25
    assert "TrainingGuard" not in names(preset(logger=False, verbose=False, guard=False))


@pytest.mark.parametrize(("kwargs", "match"), [({"lr": 1e-3}, "`lr`"), ({"guard": "yes"}, "`guard`")])
def test_preset_refuses_a_bad_lr_or_guard(kwargs: dict[str, Any], match: str) -> None:
    """``lr`` takes None or 'auto'; ``guard`` takes a bool or a dict: anything else names the argument."""
    with pytest.raises(ValueError, match=match):
        preset(logger=False, verbose=False, **kwargs)


def test_a_short_job_under_preset_skips_every_probe_and_says_why(tmp_path: Path) -> None:
    """88 steps of a small CNN (benchmarks/short_job.py's job): no lever probes, and each report gives the reason."""
    job = load_benchmark("short_job")
    trainer = preset(logger=False, verbose=False, default_root_dir=tmp_path, max_epochs=2, enable_progress_bar=False)
    trainer.fit(job.SmallCNN(), job.SmallData())
    assert trainer.global_step == 88
    reports = {type(c).__name__: c.report() for c in trainer.callbacks if type(c).__name__ in LEVERS}
    assert set(reports) == set(LEVERS)
    for name, report in reports.items():
        assert report["probed"] is False, name
        assert report["reason"].startswith("skipped: the probe"), (name, report["reason"])
    assert trainer.precision == "32-true"
    assert not reports["ChannelsLast"].get("converted")


LEVERS = ("ChannelsLast", "PrecisionTuner", "DataLoaderTuner")


def test_short_job_benchmark_quick_mode(tmp_path: Path) -> None:
    """``benchmarks/short_job.py --quick`` fits the job both ways and records each lever's skip reason."""
    benchmark = load_benchmark("short_job")
    result = benchmark.main(["--quick", "--out", str(tmp_path / "short_job.json")])
    assert json.loads((tmp_path / "short_job.json").read_text()) == result
    assert {row["run"] for row in result["rows"]} == {"plain", "preset"}
    assert all(not lever["probed"] for lever in result["levers"].values())
