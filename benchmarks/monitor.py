"""UtilizationMonitor: its step-time overhead next to Lightning's monitors, and whether its diagnosis is right.

Part 1 (overhead): the same small training loop with no monitor, `UtilizationMonitor`, Lightning's
`DeviceStatsMonitor` and `ThroughputMonitor`, interleaved over several rounds (the order rotates each round). Each
run's step time is the median interval between consecutive training-batch ends, timed by an independent callback;
its CPU cost per step is this process's CPU time (all threads, so the monitor's sampling thread counts) over the
steps, which other processes sharing the cores disturb less. Overheads are ratios to the no-monitor run (and
microseconds per step); an empty callback shows what Lightning's hook dispatch costs any callback.

Part 2 (diagnosis): the demo workload twice, one deliberately data bound (demo JPEGs behind a storage wrapper that
sleeps per sample, num_workers=0, a narrow ResNet) and one compute bound (the default-width ResNet on decoded images
cached in memory), then the data-bound one again with the monitor's suggested DataLoader settings applied.

    python benchmarks/monitor.py            # minutes on 2 CPU cores
    python benchmarks/monitor.py --quick    # seconds: a smoke run for the tests
"""

from __future__ import annotations

import argparse
import itertools
import re
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, DeviceStatsMonitor, ThroughputMonitor
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from lightning_speedkit.demo import DemoClassifier, DemoDataModule
from lightning_speedkit.monitor import UtilizationMonitor

if str(Path(__file__).resolve().parent) not in sys.path:  # _harness, also when a test loads this file by path
    sys.path.append(str(Path(__file__).resolve().parent))

from _harness import Column, print_and_write, quiet_trainer, rotated, table

DEFAULT_OUT = Path(__file__).parent / "results" / "monitor.json"
VARIANTS = ("none", "empty_callback", "speedkit", "device_stats", "throughput")


def _settings(quick: bool) -> dict[str, Any]:
    if quick:
        return {"rounds": 1, "steps": 30, "warmup": 5, "num_images": 100, "diag_steps": 6, "delay_s": 0.004}
    return {"rounds": 7, "steps": 400, "warmup": 50, "num_images": 1200, "diag_steps": 40, "delay_s": 0.004}


class _StepClock(Callback):
    """Records the wall clock and the process's CPU time at every training-batch end, for every variant alike."""

    def __init__(self) -> None:
        self.ends: list[float] = []
        self.cpu_ends: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        """Note the times."""
        self.ends.append(time.perf_counter())
        self.cpu_ends.append(time.process_time())


class _MLP(L.LightningModule):
    """A small MLP on in-memory data: a step of about a millisecond, so a monitor's cost per step shows."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        """Cross-entropy on the batch."""
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        """Plain SGD."""
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _monitors(name: str) -> list[Callback]:
    if name == "empty_callback":  # the floor: what Lightning's hook dispatch costs for any one callback
        return [Callback()]
    if name == "speedkit":
        return [UtilizationMonitor(summary=False)]
    if name == "device_stats":
        return [DeviceStatsMonitor()]
    if name == "throughput":
        return [ThroughputMonitor(batch_size_fn=lambda batch: batch[0].size(0))]
    return []


def _trainer(root: Path, callbacks: list[Callback], **kwargs: Any) -> L.Trainer:
    """A quiet Trainer that logs to CSV (the monitors' metrics go somewhere, as in a real run) unless told not to."""
    options: dict[str, Any] = {"default_root_dir": root, "devices": 1, "logger": CSVLogger(root, name="logs")}
    return quiet_trainer(callbacks=callbacks, **{**options, **kwargs})


def _overhead(s: dict[str, Any], root: Path) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(s["steps"] * 64, 64, generator=g)
    data = TensorDataset(x, torch.randint(0, 10, (len(x),), generator=g))
    medians: dict[str, list[float]] = {name: [] for name in VARIANTS}
    cpu_means: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for round_index in range(s["rounds"]):
        for name in rotated(VARIANTS, round_index):
            clock = _StepClock()
            L.seed_everything(round_index, verbose=False)
            trainer = _trainer(root / name, [*_monitors(name), clock], max_steps=s["steps"])
            trainer.fit(_MLP(), DataLoader(data, batch_size=64, shuffle=True))
            medians[name].append(_median_gap(clock.ends[s["warmup"] :]))
            cpu = clock.cpu_ends[s["warmup"] :]
            cpu_means[name].append((cpu[-1] - cpu[0]) / (len(cpu) - 1))
    base, cpu_base = statistics.median(medians["none"]), statistics.median(cpu_means["none"])
    rows = {}
    for name in VARIANTS:
        step, cpu = statistics.median(medians[name]), statistics.median(cpu_means[name])  # median over rounds
        rows[name] = {
            "step_ms": 1e3 * step,
            "overhead_ratio": step / base - 1.0,
            "overhead_us_per_step": 1e6 * (step - base),
            "cpu_step_ms": 1e3 * cpu,
            "cpu_overhead_ratio": cpu / cpu_base - 1.0,
            "cpu_overhead_us_per_step": 1e6 * (cpu - cpu_base),
            "round_step_ms": [1e3 * m for m in medians[name]],
        }
    return rows


def _median_gap(times: list[float]) -> float:
    return statistics.median(b - a for a, b in itertools.pairwise(times))


class _SlowStorage(Dataset[tuple[torch.Tensor, int]]):
    """Wraps a dataset and sleeps per sample, as reading from slow network storage would."""

    def __init__(self, dataset: Dataset[tuple[torch.Tensor, int]], delay_s: float) -> None:
        self.dataset, self.delay_s = dataset, delay_s

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        time.sleep(self.delay_s)
        return self.dataset[index]


class _SlowDemoData(DemoDataModule):
    """The demo data behind slow storage."""

    def __init__(self, delay_s: float, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.delay_s = delay_s

    def train_dataloader(self) -> DataLoader[tuple[torch.Tensor, int]]:
        """The demo loader's settings over the slow dataset."""
        loader = super().train_dataloader()
        return DataLoader(
            _SlowStorage(loader.dataset, self.delay_s),
            batch_size=self.batch_size,
            shuffle=True,
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
            persistent_workers=self.num_workers > 0,
        )


def _cached(dm: DemoDataModule) -> DataLoader[tuple[torch.Tensor, ...]]:
    """The demo training images decoded once into memory: data that costs nothing to load."""
    dm.setup("fit")
    assert dm.train_set is not None
    pairs = [dm.train_set[i] for i in range(len(dm.train_set))]
    images = torch.stack([image for image, _ in pairs])
    labels = torch.tensor([label for _, label in pairs])
    return DataLoader(TensorDataset(images, labels), batch_size=dm.batch_size, shuffle=True)


def _diagnose_run(model: L.LightningModule, data: Any, steps: int, root: Path) -> dict[str, Any]:
    monitor = UtilizationMonitor(window=max(4, steps // 4), summary=False)
    trainer = _trainer(root, [monitor], max_steps=steps, logger=False, limit_val_batches=0)
    if isinstance(data, L.LightningDataModule):
        trainer.fit(model, datamodule=data)
    else:
        trainer.fit(model, data)
    return monitor.report()


def _diagnosis(s: dict[str, Any], root: Path, cache: Path) -> dict[str, Any]:
    common = {"num_images": s["num_images"], "batch_size": 32, "root": cache}
    L.seed_everything(0, verbose=False)
    data_bound = _diagnose_run(
        DemoClassifier(width=2), _SlowDemoData(s["delay_s"], **common), s["diag_steps"], root / "data"
    )
    L.seed_everything(0, verbose=False)
    compute_bound = _diagnose_run(
        DemoClassifier(width=16), _cached(DemoDataModule(**common)), s["diag_steps"], root / "compute"
    )
    suggested = re.search(r"num_workers=(\d+)", data_bound["advice"].split("try ")[-1])
    workers = int(suggested.group(1)) if suggested else 2
    L.seed_everything(0, verbose=False)
    fixed = _diagnose_run(
        DemoClassifier(width=2),
        _SlowDemoData(s["delay_s"], num_workers=workers, **common),
        s["diag_steps"],
        root / "fixed",
    )
    runs = {"data_bound": data_bound, "compute_bound": compute_bound, "data_bound_fixed": fixed}
    out = {}
    for name, report in runs.items():
        out[name] = {k: report[k] for k in ("diagnosis", "advice", "data_wait_fraction", "samples_per_second")}
        out[name]["median_data_wait_fraction"] = report["median_data_wait_fraction"]
    out["data_bound"]["correct"] = data_bound["diagnosis"] == "data_bound"
    out["compute_bound"]["correct"] = compute_bound["diagnosis"] == "compute_bound"
    out["data_bound_fixed"]["num_workers"] = workers
    out["data_bound_fixed"]["speedup"] = fixed["samples_per_second"] / max(1e-9, data_bound["samples_per_second"])
    return out


def _table(result: dict[str, Any]) -> str:
    overhead = [
        Column("monitor", 16, "monitor", align="<"),
        Column("step ms", 9, "step_ms", ".3f"),
        Column("overhead", 10, lambda r: 100 * r["overhead_ratio"], ".1f", suffix="%"),
        Column("us/step", 9, "overhead_us_per_step", ".0f"),
        Column("CPU ms", 9, "cpu_step_ms", ".3f"),
        Column("CPU overhead", 14, lambda r: 100 * r["cpu_overhead_ratio"], ".1f", suffix="%"),
    ]
    diagnosis = [
        Column("run", 18, "run", align="<"),
        Column("diagnosis", 15, "diagnosis", align="<"),
        Column("data wait", 10, lambda r: 100 * r["median_data_wait_fraction"], ".0f", suffix="%"),
        Column("samples/s", 11, "samples_per_second", ".1f"),
    ]
    fixed = result["diagnosis"]["data_bound_fixed"]
    return "\n".join(
        [
            "overhead (median step time, interleaved rounds)",
            table(overhead, [{"monitor": name, **row} for name, row in result["overhead"].items()]),
            "",
            "diagnosis",
            table(diagnosis, [{"run": name, **row} for name, row in result["diagnosis"].items()]),
            f"advice on the data-bound run: {result['diagnosis']['data_bound']['advice']}",
            f"applying num_workers={fixed['num_workers']}: {fixed['speedup']:.2f}x samples/s",
        ]
    )


def run(quick: bool = False, out: str | Path = DEFAULT_OUT, root: str | Path | None = None) -> dict[str, Any]:
    """Run both parts, print the table, write the JSON to ``out`` and return it."""
    s = _settings(quick)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # several OpenMP threads on shared, oversubscribed cores make step times erratic
    warnings.filterwarnings("ignore")  # Lightning's advice about workers and loggers is not the subject here
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(root) if root is not None else Path(tmp) / "cache"
        result = {
            "settings": {**s, "quick": quick, "torch_threads": 1, "torch": torch.__version__},
            "overhead": _overhead(s, Path(tmp) / "overhead"),
            "diagnosis": _diagnosis(s, Path(tmp) / "diagnosis", cache),
        }
    torch.set_num_threads(threads)
    print_and_write(_table(result), result, out)
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tiny run for smoke tests")
    parser.add_argument("--out", default=str(DEFAULT_OUT), help="where to write the JSON results")
    parser.add_argument("--root", default=None, help="cache directory for the demo images")
    args = parser.parse_args(argv)
    return run(quick=args.quick, out=args.out, root=args.root)


if __name__ == "__main__":
    main()
