"""Parts 1, 2, 4 and 5 of the GPU check: precision, the monitor's NVML readings, INT8 export and compile.

1. precision: the same model trained for the same steps in each precision (and ``16-mixed`` with `ChannelsLast`),
   and `PrecisionTuner` choosing by timing, on resident batches (`_gpu_resident`).
2. monitor: `UtilizationMonitor` with NVML readings on the naive pipeline, then on the cache with `DataLoaderTuner`.
4. int8: part 1's ``16-mixed`` model exported with `export_int8` (ONNX Runtime on the CPU).
5. compile: ``16-mixed`` eager, then compiled by `Compile`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import torch
from _gpu_device import device_trainer, nvml_record, open_quiet_sampler
from _gpu_record import MIN_PART_S, RunRecord, error_line, recorded_row, release
from _gpu_resident import accuracy, full_batches, on_device, resident_fit
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import Logger
from typing_extensions import override

from lightning_speedkit.channels_last import ChannelsLast
from lightning_speedkit.dataloader import DataLoaderTuner
from lightning_speedkit.demo import DemoClassifier, DemoDataModule
from lightning_speedkit.monitor import UtilizationMonitor, training_peak_flops
from lightning_speedkit.precision import PrecisionTuner
from lightning_speedkit.sampling import DeviceSampler

__all__ = ["Recorder", "compile_part", "int8_part", "monitor_part", "precision_part"]

# ---------------------------------------------------------------------------------------------- part 1: precision


def precision_part(
    entry: dict[str, Any],
    run: RunRecord,
    s: dict[str, Any],
    device: torch.device,
    root: Path,
    data: DemoDataModule,
    keep: dict[str, Any],
) -> None:
    """Part 1: a row per precision, and PrecisionTuner's measured choice, on batches resident on the device."""
    cuda = device.type == "cuda"
    train = full_batches(on_device(data.train_dataloader(), device), s["batch"])
    val = on_device(data.val_dataloader(), device)
    tuned = ["16-mixed", "bf16-mixed"] if cuda else ["32-true", "bf16-mixed"]  # CPU: Lightning runs 16-mixed as bf16
    bf16 = None if cuda and torch.cuda.is_bf16_supported() else "skipped: needs a CUDA GPU with bf16"
    runs: list[tuple[str, str, Callable[[], list[Callback]], str | None]] = [
        ("32-true", "32-true", list, None),
        ("16-mixed", "16-mixed", list, None),
        ("16-mixed+NHWC", "16-mixed", lambda: [ChannelsLast(measure=False)], None),
        ("bf16-mixed", "bf16-mixed", list, bf16),
        (f"PrecisionTuner({'|'.join(tuned)})", tuned[0], lambda: [PrecisionTuner(candidates=tuned)], None),
    ]
    rows: list[dict[str, Any]] = entry.setdefault("rows", [])
    try:
        for label, precision, callbacks, skip in runs:
            with recorded_row(run, rows, precision=label) as row:
                if skip is not None or run.left() < MIN_PART_S:
                    row["status"] = skip or "skipped: time budget"
                    continue
                extra = callbacks()
                figures, model = resident_fit(
                    s,
                    device,
                    root,
                    data.crop_size,
                    train,
                    precision,
                    extra,
                    unbounded=label.startswith("PrecisionTuner"),
                )
                row.update(figures, val_acc=accuracy(model.to(device), val))
                if label.startswith("PrecisionTuner"):
                    row["decision"] = extra[0].report()  # type: ignore[attr-defined]
                if label == "16-mixed":
                    keep["int8_model"] = model
                model.cpu()
                print(f"  {label}: {row['samples_per_s']:,.0f} samples/s", flush=True)
        base = next((r for r in rows if r["precision"] == "32-true" and "samples_per_s" in r), None)
        for row in rows:
            if base is not None and "samples_per_s" in row:
                row["speedup_vs_fp32"] = row["samples_per_s"] / base["samples_per_s"]
    finally:  # free the resident batches, whoever still holds the lists, before part 2 and part 3's memory cap
        train.clear()
        val.clear()
        release()
        with contextlib.suppress(Exception):
            entry["memory_allocated_after_gib"] = torch.cuda.memory_allocated(device) / 2**30 if cuda else None


# ---------------------------------------------------------------------------------------------- part 2: monitor


class Recorder(Logger):
    """Keeps every logged metric in memory (the monitor's NVML readings arrive through the loggers)."""

    def __init__(self) -> None:
        super().__init__()
        self.metrics: list[dict[str, float]] = []

    @property
    @override
    def name(self) -> str:
        return "recorder"

    @property
    @override
    def version(self) -> int:
        return 0

    @override
    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    @override
    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.metrics.append(dict(metrics))

    def mean(self, key: str) -> float | None:
        values = [m[f"speedkit/monitor/{key}"] for m in self.metrics if f"speedkit/monitor/{key}" in m]
        return sum(values) / len(values) if values else None

    def peak(self, key: str) -> float | None:
        values = [m[f"speedkit/monitor/{key}"] for m in self.metrics if f"speedkit/monitor/{key}" in m]
        return max(values) if values else None


def monitor_part(entry: dict[str, Any], run: RunRecord, s: dict[str, Any], device: torch.device, root: Path) -> None:
    """Part 2: UtilizationMonitor on the naive pipeline, then on the cached one tuned by DataLoaderTuner."""
    cuda = device.type == "cuda"
    runs: list[tuple[str, bool, Callable[[], list[Callback]]]] = [
        ("JPEG decode, 0 workers", False, list),
        ("cached + DataLoaderTuner", True, lambda: [DataLoaderTuner()]),
    ]
    rows: list[dict[str, Any]] = entry.setdefault("rows", [])
    for name, cache, extra in runs:
        with recorded_row(run, rows, run=name) as row:
            L.seed_everything(0, verbose=False)
            data = DemoDataModule(s["num_images"], s["image_size"], batch_size=s["batch"], cache=cache)
            model = DemoClassifier(width=s["width"], crop_size=data.crop_size)
            opened: list[DeviceSampler] = []

            def sampler(dev: torch.device, opened: list[DeviceSampler] = opened) -> DeviceSampler:
                opened.append(open_quiet_sampler(dev))
                return opened[-1]

            monitor = UtilizationMonitor(window=s["window"], sample_interval=0.2, sampler=sampler, summary=False)
            recorder = Recorder()
            trainer = device_trainer(
                device,
                root,
                precision="16-mixed" if cuda else "32-true",
                max_steps=s["monitor_steps"],
                limit_val_batches=0,
                logger=recorder,
                callbacks=[*extra(), monitor],
            )
            trainer.fit(model, datamodule=data)
            report = monitor.report()
            row.update(
                num_workers=(report["loader"] or {}).get("num_workers", data.num_workers),
                diagnosis=report["diagnosis"],
                advice=report["advice"],
                data_wait_fraction=report["total"]["data_wait_fraction"],
                samples_per_s=report["total"]["samples_per_second"],
                gpu_utilization=recorder.mean("gpu_utilization"),
                gpu_memory_used_gb=recorder.peak("gpu_memory_used_gb"),
                gpu_power_w=recorder.mean("gpu_power_w"),
                gpu_temperature_c=recorder.peak("gpu_temperature_c"),
                gpu_sm_clock_mhz=recorder.mean("gpu_sm_clock_mhz"),
                mfu=report["mfu"],
                peak_flops=report["peak_flops"],
                peak_key=training_peak_flops(report["device"], str(trainer.precision), model)[1] if cuda else None,
                sampling_error=report["sampling_error"],
                nvml=nvml_record(opened[0] if opened else None),
            )
            if cuda and row["nvml"].get("sampler") != "NvmlSampler":  # the GPU columns would be empty: say why
                row["status"] = f"failed: NVML unavailable: {row['nvml']['fallback_reason'] or row['nvml']['detail']}"
            model.trainer = None  # type: ignore[assignment]
            print(f"  monitor {name}: {report['diagnosis']}", flush=True)


# ---------------------------------------------------------------------------------------------- parts 4 and 5


def int8_part(entry: dict[str, Any], s: dict[str, Any], data: DemoDataModule, out: Path, keep: dict[str, Any]) -> None:
    """Part 4: the GPU-trained model to a verified INT8 ONNX model (ONNX Runtime on the CPU)."""
    from lightning_speedkit.int8 import export_int8

    model = keep.get("int8_model")
    entry["model"] = "the 16-mixed model of part 1" if model is not None else "untrained: part 1 left no model"
    if model is None:
        model = DemoClassifier(width=s["width"], crop_size=data.crop_size)
    model = model.to("cpu").float()
    data.num_workers, data.pin_memory = 0, False
    report = export_int8(
        model,
        data.train_dataloader(),
        out / "model.onnx",
        calibration_batches=s["calibration"],
        validation_data=data.val_dataloader(),
        latency_batch_size=32,
    )
    entry.update(report=dict(report), nvml=nvml_record())


def compile_part(
    entry: dict[str, Any], run: RunRecord, s: dict[str, Any], device: torch.device, root: Path, data: DemoDataModule
) -> None:
    """Part 5: ``16-mixed`` eager, then compiled by `Compile` (``measure=False``: it compiles, the clock times)."""
    try:
        from lightning_speedkit.compile import Compile
    except Exception as exc:  # still being written, or broken: a skipped row, not a failed check
        entry["status"] = f"skipped: lightning_speedkit.compile unavailable ({error_line(exc)})"
        return
    cuda = device.type == "cuda"
    entry["backend"] = "inductor" if cuda else "aot_eager (CPU rehearsal; inductor on CUDA)"
    train = full_batches(on_device(data.train_dataloader(), device), s["batch"])
    rows: list[dict[str, Any]] = entry.setdefault("rows", [])
    try:
        for label in ("16-mixed", "16-mixed+compile"):
            with recorded_row(run, rows, precision=label) as row:
                lever = (
                    [Compile(measure=False, backend="inductor" if cuda else "aot_eager")] if "compile" in label else []
                )
                figures, _ = resident_fit(s, device, root, data.crop_size, train, "16-mixed", lever)
                row.update(figures, decision=lever[0].report() if lever else None)
        if all("samples_per_s" in row for row in rows):
            entry["speedup"] = rows[1]["samples_per_s"] / rows[0]["samples_per_s"]
    finally:
        train.clear()
        with contextlib.suppress(Exception):
            torch._dynamo.reset()  # the compiled graphs and their caches go with the part
