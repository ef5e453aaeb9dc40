"""GPU check: AMP vs fp32, UtilizationMonitor on NVML, BatchSizeFinder against real CUDA OOM, INT8 of a GPU model.

Four parts on one CUDA device, all on the embedded demo workload (DemoClassifier, DemoDataModule), in one run:

1. Precision: the same model (width 64, batch 256, 56x56 crops) trained for the same steps with ``32-true``,
   ``16-mixed``, ``16-mixed`` with `ChannelsLast` (NHWC weights) and ``bf16-mixed`` (where the GPU supports it).
   The training batches are real demo batches kept on the GPU, so the comparison measures compute, not decoding.
   Throughput is timed between two ``torch.cuda.synchronize()`` after warm-up steps; val_acc after training shows
   AMP costs no accuracy.
2. UtilizationMonitor with real NVML readings (utilisation, memory, power, temperature, SM clock): the naive data
   pipeline (a JPEG decoded per sample, ``num_workers=0``), then the decoded-image cache with `DataLoaderTuner`.
3. BatchSizeFinder against real CUDA out-of-memory: the process is capped with
   ``torch.cuda.set_per_process_memory_fraction`` so the limit is reached within seconds; speedkit's finder and
   Lightning's each search, then train and validate at the size found (does it run out of memory?).
4. INT8: the ``16-mixed``-trained model of part 1 exported with `export_int8` (static QDQ, ONNX Runtime on the
   CPU), with size, latency and accuracy of FP32 vs INT8.

    python benchmarks/gpu_check.py            # about 3-5 minutes on one GPU (at most 8)
    python benchmarks/gpu_check.py --quick    # a smaller run

Without a CUDA device it prints ``skipped: no CUDA device``, writes that to the JSON and exits 0.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import BatchSizeFinder as LightningFinder
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import Logger
from torch.utils.data import DataLoader, Dataset
from typing_extensions import override

from lightning_speedkit.batch_size import BatchSizeFinder
from lightning_speedkit.dataloader import DataLoaderTuner
from lightning_speedkit.demo import DemoClassifier, DemoDataModule
from lightning_speedkit.memory_format import ChannelsLast
from lightning_speedkit.monitor import UtilizationMonitor
from lightning_speedkit.oom import is_oom_error, release_memory
from lightning_speedkit.report import write_json_atomic

DEFAULT_OUT = Path(__file__).parent / "results" / "gpu_check.json"
SKIP_LINE = "skipped: no CUDA device"


def settings(quick: bool, cpu: bool = False) -> dict[str, Any]:
    """Sizes of each part; ``cpu`` is a tiny smoke run of the same code (``--allow-cpu``, for development)."""
    if cpu:
        return {"num_images": 200, "image_size": 32, "width": 8, "batch": 16, "warmup": 2, "steps": 6,
                "monitor_steps": 12, "window": 4, "memory_gib": None, "max_val": 64, "calibration": 2}  # fmt: skip
    if quick:
        return {"num_images": 2000, "image_size": 64, "width": 32, "batch": 128, "warmup": 10, "steps": 50,
                "monitor_steps": 30, "window": 10, "memory_gib": 1.0, "max_val": 16384, "calibration": 8}  # fmt: skip
    return {"num_images": 6000, "image_size": 64, "width": 64, "batch": 256, "warmup": 30, "steps": 180,
            "monitor_steps": 60, "window": 10, "memory_gib": 3.0, "max_val": 16384, "calibration": 16}  # fmt: skip


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _trainer(device: torch.device, root: Path, **kwargs: Any) -> L.Trainer:
    defaults: dict[str, Any] = {
        "accelerator": "gpu" if device.type == "cuda" else "cpu",
        "devices": 1,
        "default_root_dir": root,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
    }
    return L.Trainer(**{**defaults, **kwargs})


class _Resident(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """``length`` batches cycling through a list of whole batches that already live on the device."""

    def __init__(self, batches: list[tuple[torch.Tensor, torch.Tensor]], length: int) -> None:
        self.batches, self.length = batches, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.batches[index % len(self.batches)]


class _Clock(Callback):
    """Times the training steps after ``warmup`` between two device synchronisations."""

    def __init__(self, warmup: int, device: torch.device) -> None:
        self.warmup, self.device = warmup, device
        self.start = self.end = 0.0
        self.timed_steps = 0

    @override
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int) -> None:
        if idx == self.warmup:
            _sync(self.device)
            self.start = time.perf_counter()

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        _sync(self.device)
        self.end = time.perf_counter()
        self.timed_steps = trainer.global_step - self.warmup


class _Recorder(Logger):
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
        values = [m[key] for m in self.metrics if key in m]
        return sum(values) / len(values) if values else None

    def peak(self, key: str) -> float | None:
        values = [m[key] for m in self.metrics if key in m]
        return max(values) if values else None


def _accuracy(model: L.LightningModule, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    model.eval()
    correct = total = 0
    with torch.no_grad():
        for x, y in batches:
            correct += int((model(x).argmax(1) == y).sum())
            total += len(y)
    model.train()
    return correct / max(total, 1)


def _on_device(loader: DataLoader[Any], device: torch.device, limit: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    batches = []
    for x, y in loader:
        batches.append((x.to(device), y.to(device)))
        if len(batches) == limit:
            break
    return batches


def precision_part(s: dict[str, Any], device: torch.device, root: Path, data: DemoDataModule) -> dict[str, Any]:
    """Part 1: the same steps in fp32 and AMP on batches resident on the device; returns rows and the models."""
    data.setup("fit")
    train = _on_device(data.train_dataloader(), device, limit=64)
    val = _on_device(data.val_dataloader(), device, limit=64)
    runs = [("32-true", "32-true", False), ("16-mixed", "16-mixed", False), ("16-mixed+NHWC", "16-mixed", True)]
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        runs.append(("bf16-mixed", "bf16-mixed", False))
    rows, models = [], {}
    for label, precision, channels_last in runs:
        L.seed_everything(0, verbose=False)
        model = DemoClassifier(width=s["width"], crop_size=data.crop_size)
        clock = _Clock(s["warmup"], device)
        loader = DataLoader(_Resident(train, s["warmup"] + s["steps"]), batch_size=None)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        callbacks: list[L.Callback] = [ChannelsLast(measure=False), clock] if channels_last else [clock]
        trainer = _trainer(device, root, precision=precision, max_steps=s["warmup"] + s["steps"], callbacks=callbacks)
        trainer.fit(model, train_dataloaders=loader)
        seconds = clock.end - clock.start
        rows.append(
            {
                "precision": label,
                "samples_per_s": clock.timed_steps * s["batch"] / seconds,
                "step_ms": 1000 * seconds / max(clock.timed_steps, 1),
                "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
                "val_acc": _accuracy(model.to(device), val),
            }
        )
        models[label] = model.cpu()  # Lightning's teardown had moved it to the CPU; keep the GPU free
        print(f"  precision {label}: {rows[-1]['samples_per_s']:,.0f} samples/s", flush=True)
    for row in rows:
        row["speedup_vs_fp32"] = row["samples_per_s"] / rows[0]["samples_per_s"]
    return {"rows": rows, "models": models}


def monitor_part(s: dict[str, Any], device: torch.device, root: Path) -> list[dict[str, Any]]:
    """Part 2: UtilizationMonitor on the naive pipeline, then on the cached one tuned by DataLoaderTuner."""
    runs = [("JPEG decode, 0 workers", False, []), ("cached + DataLoaderTuner", True, [DataLoaderTuner()])]
    rows = []
    for name, cache, extra in runs:
        L.seed_everything(0, verbose=False)
        data = DemoDataModule(
            num_images=s["num_images"], image_size=s["image_size"], batch_size=s["batch"], cache=cache
        )
        model = DemoClassifier(width=s["width"], crop_size=data.crop_size)
        monitor = UtilizationMonitor(window=s["window"], sample_interval=0.2, summary=False)
        recorder = _Recorder()
        precision = "16-mixed" if device.type == "cuda" else "32-true"
        trainer = _trainer(
            device, root, precision=precision, max_steps=s["monitor_steps"], limit_val_batches=0, logger=recorder,
            callbacks=[*extra, monitor],
        )  # fmt: skip
        trainer.fit(model, datamodule=data)
        report = monitor.report()
        rows.append(
            {
                "run": name,
                "num_workers": (report["loader"] or {}).get("num_workers", data.num_workers),
                "diagnosis": report["diagnosis"],
                "advice": report["advice"],
                "data_wait_fraction": report["total"]["data_wait_fraction"],
                "samples_per_s": report["total"]["samples_per_second"],
                "gpu_utilization": recorder.mean("speedkit/monitor/gpu_utilization"),
                "gpu_memory_used_gb": recorder.peak("speedkit/monitor/gpu_memory_used_gb"),
                "gpu_power_w": recorder.mean("speedkit/monitor/gpu_power_w"),
                "gpu_temperature_c": recorder.peak("speedkit/monitor/gpu_temperature_c"),
                "gpu_sm_clock_mhz": recorder.mean("speedkit/monitor/gpu_sm_clock_mhz"),
                "sampling_error": report.get("sampling_error"),
            }
        )
        print(f"  monitor {name}: {report['diagnosis']}", flush=True)
    return rows


class _Outcome(Callback):
    """Records the batch size at the first real training step and whether training or validation ran out of memory."""

    def __init__(self) -> None:
        self.batch_size: int | None = None
        self.search_s = 0.0
        self._t0 = 0.0

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._t0 = time.perf_counter()

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.batch_size is None:
            self.search_s = time.perf_counter() - self._t0
            self.batch_size = int(trainer.datamodule.batch_size)  # type: ignore[attr-defined]


def oom_part(s: dict[str, Any], device: torch.device, root: Path) -> dict[str, Any]:
    """Part 3: both finders under a real memory cap, then training and validation at the size each found."""
    cuda = device.type == "cuda"
    total = torch.cuda.get_device_properties(device).total_memory if cuda else 0
    fraction = min(1.0, s["memory_gib"] * 2**30 / total) if cuda else 1.0
    rows = []
    for name in ("speedkit", "lightning"):
        release_memory()
        if cuda:
            torch.cuda.set_per_process_memory_fraction(fraction, device)
            torch.cuda.reset_peak_memory_stats(device)
        L.seed_everything(0, verbose=False)
        data = DemoDataModule(
            num_images=s["num_images"], image_size=s["image_size"], batch_size=32, cache=True,
            num_workers=min(8, os.cpu_count() or 1), pin_memory=cuda,
        )  # fmt: skip
        model = DemoClassifier(width=s["width"], crop_size=data.crop_size)
        finder: Callback
        if name == "speedkit":
            finder = BatchSizeFinder(mode="binsearch", max_val=s["max_val"])
        else:
            finder = LightningFinder(mode="binsearch", max_val=s["max_val"])
        outcome = _Outcome()
        trainer = _trainer(
            device, root, precision="16-mixed" if cuda else "32-true", max_epochs=2, limit_val_batches=3,
            callbacks=[finder, outcome],
        )  # fmt: skip
        after = "trained + validated"  # at the size found, under the same cap
        try:
            trainer.fit(model, datamodule=data)
        except Exception as exc:
            if not is_oom_error(exc) and not is_oom_error(exc.__cause__ or exc):
                raise
            after = f"OOM in {'search' if outcome.batch_size is None else 'training/validation'}"
        rows.append(
            {
                "finder": name,
                "found": outcome.batch_size,
                "search_s": outcome.search_s,
                "after_search": after,
                "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None,
                "trials": len(finder.report().get("trials", [])) if isinstance(finder, BatchSizeFinder) else None,
            }
        )
        print(f"  batch size {name}: {outcome.batch_size} ({after})", flush=True)
        del trainer, model
    release_memory()
    if cuda:
        torch.cuda.set_per_process_memory_fraction(1.0, device)
    return {"limit_gib": s["memory_gib"] if cuda else None, "rows": rows}


def int8_part(s: dict[str, Any], model: DemoClassifier, data: DemoDataModule, out: Path) -> dict[str, Any]:
    """Part 4: the GPU-trained model to a verified INT8 ONNX model (ONNX Runtime on the CPU)."""
    from lightning_speedkit.int8 import export_int8

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
    return dict(report)


def run(quick: bool = False, out: str | Path = DEFAULT_OUT, allow_cpu: bool = False) -> dict[str, Any]:
    """Run the four parts (or skip without CUDA), print the table, write the JSON, return it."""
    cuda = torch.cuda.is_available()
    if not cuda and not allow_cpu:
        result: dict[str, Any] = {"skipped": "no CUDA device", "torch": torch.__version__}
        print(SKIP_LINE)
        write_json_atomic(result, out)
        return result
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    s = settings(quick, cpu=not cuda)
    start = time.perf_counter()
    result = {"quick": quick, "settings": s, "device": _describe(device)}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        data = DemoDataModule(num_images=s["num_images"], image_size=s["image_size"], batch_size=s["batch"], cache=True)
        data.prepare_data()
        part = precision_part(s, device, root / "precision", data)
        result["precision"] = part["rows"]
        result["monitor"] = monitor_part(s, device, root / "monitor")
        result["batch_size"] = oom_part(s, device, root / "oom")
        result["int8"] = int8_part(s, part["models"]["16-mixed"], data, root / "int8")
    result["seconds"] = time.perf_counter() - start
    print(format_table(result))
    write_json_atomic(result, out)
    return result


def _describe(device: torch.device) -> dict[str, Any]:
    info: dict[str, Any] = {"torch": torch.__version__, "lightning": L.__version__, "type": device.type}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(
            name=props.name,
            memory_gib=props.total_memory / 2**30,
            capability=f"{props.major}.{props.minor}",
            cuda=torch.version.cuda,
            cudnn_allow_tf32=torch.backends.cudnn.allow_tf32,
            matmul_allow_tf32=torch.backends.cuda.matmul.allow_tf32,
        )
    return info


def _f(value: Any, spec: str, width: int) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}{spec}}"


def format_table(r: dict[str, Any]) -> str:
    """The four parts as plain-text tables."""
    d, s = r["device"], r["settings"]
    name = f"{d.get('name', 'CPU')} ({d.get('memory_gib', 0):.0f} GiB, cc {d.get('capability', '-')})"
    lines = [f"gpu_check on {name}, torch {d['torch']}, lightning {d['lightning']}, {r['seconds']:.0f} s", ""]
    lines.append(f"1. precision: DemoClassifier width {s['width']}, batch {s['batch']}, {s['steps']} timed steps,"
                 " batches resident on the device (fp32 convs may use TF32)")  # fmt: skip
    lines.append(f"{'precision':<14}{'samples/s':>11}{'step ms':>9}{'vs fp32':>9}{'peak GiB':>10}{'val_acc':>9}")
    for row in r["precision"]:
        lines.append(
            f"{row['precision']:<14}{row['samples_per_s']:>11,.0f}{row['step_ms']:>9.2f}{row['speedup_vs_fp32']:>9.2f}"
            f"{_f(row['peak_memory_gib'], '.2f', 10)}{row['val_acc']:>9.3f}"
        )
    lines += ["", f"2. UtilizationMonitor (NVML), batch {s['batch']}"]
    lines.append(
        f"{'run':<26}{'workers':>8}{'diagnosis':>15}{'wait':>7}{'samples/s':>11}{'util %':>8}{'mem GB':>8}"
        f"{'power W':>9}{'temp C':>8}{'SM MHz':>8}"
    )
    for row in r["monitor"]:
        util = None if row["gpu_utilization"] is None else 100 * row["gpu_utilization"]
        lines.append(
            f"{row['run']:<26}{row['num_workers']:>8}{row['diagnosis']:>15}{100 * row['data_wait_fraction']:>6.0f}%"
            f"{row['samples_per_s']:>11,.0f}{_f(util, '.0f', 8)}{_f(row['gpu_memory_used_gb'], '.1f', 8)}"
            f"{_f(row['gpu_power_w'], '.0f', 9)}{_f(row['gpu_temperature_c'], '.0f', 8)}"
            f"{_f(row['gpu_sm_clock_mhz'], '.0f', 8)}"
        )
    lines += [f"advice ({row['run']}): {row['advice'] or '-'}" for row in r["monitor"]]
    limit = r["batch_size"]["limit_gib"]
    lines += ["", f"3. BatchSizeFinder against real CUDA OOM (memory capped at {_f(limit, '.1f', 0)} GiB)"]
    lines.append(f"{'finder':<11}{'found':>7}{'search s':>10}{'peak GiB':>10}  after the search")
    for row in r["batch_size"]["rows"]:
        lines.append(
            f"{row['finder']:<11}{_f(row['found'], 'd', 7)}{row['search_s']:>10.1f}"
            f"{_f(row['peak_memory_gib'], '.2f', 10)}  {row['after_search']}"
        )
    q = r["int8"]
    v, lat = q.get("verification") or {}, q.get("latency") or {}
    lines += ["", "4. INT8 export of the 16-mixed-trained model (ONNX Runtime, CPU)"]
    lines.append(f"size {q['fp32_bytes'] / 1e6:.2f} MB -> {q['int8_bytes'] / 1e6:.2f} MB ({q['size_ratio']:.2f}x)")
    for key, timing in lat.items():
        if key.startswith("batch_"):
            lines.append(
                f"latency {key}: {timing['fp32_ms']:.2f} ms -> {timing['int8_ms']:.2f} ms ({timing['speedup']:.2f}x)"
            )
    lines.append(
        f"top-1 agreement {_f(v.get('top1_agreement'), '.3f', 0)}, accuracy fp32 {_f(v.get('metric_fp32'), '.3f', 0)}"
        f" -> int8 {_f(v.get('metric_int8'), '.3f', 0)}"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller run")
    parser.add_argument("--out", default=str(DEFAULT_OUT), help="where to write the JSON results")
    parser.add_argument("--allow-cpu", action="store_true", help=argparse.SUPPRESS)  # development: tiny run on CPU
    args = parser.parse_args(argv)
    return run(quick=args.quick, out=args.out, allow_cpu=args.allow_cpu)


if __name__ == "__main__":
    main(sys.argv[1:])
