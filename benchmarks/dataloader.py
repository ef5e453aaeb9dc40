"""Data loading: naive loader vs DataLoaderTuner (vs tuner + CachedDataset), on the demo and on an I/O-slow dataset.

For each setting, in one run:
- ``fit s``: wall seconds of the whole ``Trainer.fit``, the tuner's probe included, and ``fit vs naive``: that over
  the naive row of the same workload (below 1.00x: faster),
- ``train samples/s``: training throughput over the fit's steps (the probe's trial steps are not among them), from
  the UtilizationMonitor, and ``train data-wait``: the seconds those steps waited for data, and their share,
- ``load s/epoch``: seconds to iterate one full training epoch of the loader alone (decode + augment + collate).

Workloads: the demo (a JPEG decoded per sample, one epoch of the demo ResNet; ``num_workers=0`` is the naive
loader), an I/O-slow dataset (random images, each ``__getitem__`` sleeping like a read from a network disk, the
same model, several epochs), where worker processes win real training steps, and in-memory tensors (a
``TensorDataset`` of 32 features a row, batches of 64, a small MLP, several epochs), where fetching each batch at
once (``batched_fetch``) takes away the per-sample fetch and stack.

    python benchmarks/dataloader.py            # 5,000 demo images; 400 I/O-slow steps (2 ms asleep a sample); 900 MLP
    python benchmarks/dataloader.py --quick    # 600 demo images; tiny I/O-slow and tensor runs (no probe pays back)
    python benchmarks/dataloader.py --cache-only   # only the cache's random read and loader epochs (no JSON)

Every run also reports the packed cache beside the decoding pipeline: the median microseconds of a random read of
one sample, and ``load s/epoch`` of the demo's training loader with 0 and 2 worker processes.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from lightning_speedkit.data import CachedDataset
from lightning_speedkit.dataloader import DataLoaderTuner
from lightning_speedkit.demo import DemoClassifier, DemoDataModule
from lightning_speedkit.demo.data import DecodedShapes, ensure_shapes
from lightning_speedkit.hardware import cpu_info
from lightning_speedkit.monitor import UtilizationMonitor
from lightning_speedkit.report import write_json_atomic

if str(Path(__file__).resolve().parent) not in sys.path:  # _harness, also when a test loads this file by path
    sys.path.append(str(Path(__file__).resolve().parent))

from _harness import Column, print_and_write, quiet_trainer, table, timed_fit

DEFAULT_OUT = Path(__file__).parent / "results" / "dataloader.json"
CROP = 56  # the demo's crop size, for both workloads


class SleepyImages(Dataset[tuple[torch.Tensor, int]]):
    """Random 3x56x56 images and labels; each item first sleeps ``delay`` seconds, like a read from a slow disk."""

    def __init__(self, n: int, delay: float) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 3, CROP, CROP, generator=g)
        self.y = torch.randint(0, 10, (n,), generator=g)
        self.delay = delay

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        time.sleep(self.delay)
        return self.x[i], int(self.y[i])


class SleepyData(L.LightningDataModule):
    """The naive loader over `SleepyImages`: ``num_workers=0``, shuffled."""

    def __init__(self, n: int, delay: float, batch_size: int) -> None:
        super().__init__()
        self.n, self.delay, self.batch_size = n, delay, batch_size

    def train_dataloader(self) -> DataLoader[tuple[torch.Tensor, int]]:
        """The naive loader: everything default but the batch size and shuffling."""
        return DataLoader(SleepyImages(self.n, self.delay), batch_size=self.batch_size, shuffle=True)


class TensorRows(L.LightningDataModule):
    """The naive loader over ``n`` in-memory rows of 32 features (a ``TensorDataset``), 4 classes: shuffled."""

    def __init__(self, n: int, batch_size: int = 64) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        x = torch.randn(n, 32, generator=g)
        self.data = TensorDataset(x, (x[:, :4] + 0.5 * torch.randn(n, 4, generator=g)).argmax(dim=1))
        self.batch_size = batch_size

    def train_dataloader(self) -> DataLoader[tuple[torch.Tensor, ...]]:
        """The naive loader: everything default but the batch size and shuffling."""
        return DataLoader(self.data, batch_size=self.batch_size, shuffle=True)


class RowsMLP(L.LightningModule):
    """32 -> 128 -> 4, SGD: a step of little more than its loader's per-sample fetch."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 4))

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        """Cross-entropy of the batch."""
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        """Plain SGD."""
        return torch.optim.SGD(self.parameters(), lr=0.05)


def _loader_epoch_seconds(loader: Any) -> float:
    """Seconds for the second of two full passes: the steady per-epoch cost (persistent workers already up)."""
    seconds = 0.0
    for _ in range(2):
        start = time.perf_counter()
        for _ in loader:
            pass
        seconds = time.perf_counter() - start
    return seconds


def fit_row(
    name: str,
    workload: str,
    data: Callable[[], L.LightningDataModule],
    tune: bool,
    epochs: int = 1,
    model: Callable[[], L.LightningModule] = lambda: DemoClassifier(crop_size=CROP),
) -> dict[str, Any]:
    """One setting: a fit with the monitor (and the tuner), then one loader-only epoch of the loader it trained on."""
    L.seed_everything(0, verbose=False)
    datamodule = data()
    monitor = UtilizationMonitor(window=10)
    callbacks: list[L.Callback] = [monitor]
    tuner = DataLoaderTuner() if tune else None
    if tuner is not None:
        callbacks.insert(0, tuner)
    trainer = quiet_trainer(max_epochs=epochs, num_sanity_val_steps=0, limit_val_batches=0, callbacks=callbacks)
    fit = timed_fit(trainer, model(), datamodule)
    loader = trainer.train_dataloader
    load_s = _loader_epoch_seconds(loader)
    total = monitor.report()["total"]
    return {
        "setting": name,
        "workload": workload,
        "num_workers": loader.num_workers,
        "epochs": epochs,
        "fit_s": fit.seconds,
        "train_samples_per_s": total["samples_per_second"],
        "train_data_wait_s": total["data_wait_s"],
        "train_data_wait_fraction": total["data_wait_fraction"],
        "load_s_per_epoch": load_s,
        "tuner": _tuner_summary(tuner.report()) if tuner is not None else None,
    }


def _tuner_summary(report: dict[str, Any]) -> dict[str, Any]:
    """The tuner's report without its per-step trial lists (they are summarised in ``step_s``)."""
    return {key: value for key, value in report.items() if key != "trials"}


def per_sample_us(num_images: int, root: str, samples: int, repeats: int = 5) -> dict[str, float]:
    """Microseconds per random sample: open + decode one JPEG vs read the decoded sample from the packed cache.

    Each is the median of ``repeats`` passes over the same ``samples`` random indices (the cache's files are in the
    page cache after the build, as in training), in wall time (``*_us``) and in this process's CPU time
    (``*_cpu_us``), which a busy machine inflates less: both are one thread's work.
    """
    directory = ensure_shapes(num_images, root=root)
    decoded = DecodedShapes(directory, range(num_images))
    cached = CachedDataset(decoded, directory / "packed")
    order = torch.randperm(num_images, generator=torch.Generator().manual_seed(0))[:samples].tolist()
    result = {}
    for name, dataset in (("jpeg_decode", decoded), ("packed_read", cached)):
        wall, cpu = [], []
        for _ in range(repeats):
            start, start_cpu = time.perf_counter(), time.process_time()
            for index in order:
                dataset[index]
            wall.append(1e6 * (time.perf_counter() - start) / len(order))
            cpu.append(1e6 * (time.process_time() - start_cpu) / len(order))
        result[f"{name}_us"] = statistics.median(wall)
        result[f"{name}_cpu_us"] = statistics.median(cpu)
    return result


def cache_epochs(num_images: int, root: str, workers: tuple[int, ...] = (0, 2)) -> list[dict[str, Any]]:
    """Seconds of one training epoch of the demo's loader alone (read or decode, augment, collate), per pipeline.

    The decoding pipeline and the packed cache side by side, with ``workers`` DataLoader processes each (forked,
    persistent); the second of two passes is timed.
    """
    rows = []
    for cache in (False, True):
        for num_workers in workers:
            datamodule = DemoDataModule(num_images=num_images, root=root, cache=cache, num_workers=num_workers)
            datamodule.setup("fit")
            rows.append(
                {
                    "pipeline": "packed cache" if cache else "decode per sample",
                    "num_workers": num_workers,
                    "load_s_per_epoch": _loader_epoch_seconds(datamodule.train_dataloader()),
                }
            )
    return rows


def cache_table(per_sample: dict[str, float], epochs: list[dict[str, Any]]) -> str:
    """The cache's random read and a loader epoch, beside the decoding pipeline's."""
    workers = sorted({row["num_workers"] for row in epochs})
    rows = []
    for pipeline, key in (("decode per sample", "jpeg_decode"), ("packed cache", "packed_read")):
        seconds = {row["num_workers"]: row["load_s_per_epoch"] for row in epochs if row["pipeline"] == pipeline}
        read = f"{per_sample[f'{key}_us']:.1f}, {per_sample[f'{key}_cpu_us']:.1f}"
        rows.append({"pipeline": pipeline, "read": read, **{f"epoch_s_{w}": seconds[w] for w in workers}})
    columns = [Column("pipeline", 20, "pipeline", align="<"), Column("random read us (wall, CPU)", 27, "read")]
    columns += [Column(f"epoch s, {w} workers", 18, f"epoch_s_{w}", ".3f") for w in workers]
    return table(columns, rows, sep=" ", rule=True)


def fits_table(rows: list[dict[str, Any]]) -> str:
    """One line per setting: its fit, training throughput and data wait, and one loader epoch, against naive."""
    columns = [
        Column("setting", 45, "setting", align="<"),
        Column("workers", 7, "num_workers"),
        Column("fit s", 7, "fit_s", ".2f"),
        Column("vs naive", 8, "fit_ratio", ".2f", suffix="x"),
        Column("train samples/s", 15, "train_samples_per_s", ".0f"),
        Column("gain", 6, "train_throughput_gain", ".2f", suffix="x"),
        Column("wait %", 6, lambda r: 100 * r["train_data_wait_fraction"], ".1f", suffix="%"),
        Column("load s/epoch", 12, "load_s_per_epoch", ".2f"),
    ]
    lines = [table(columns, rows, sep=" ", rule=True)]
    for row in rows:
        if row["tuner"] is not None:
            tuner = row["tuner"]
            probe = f", probe {tuner['probe_s']:.1f} s" if tuner.get("probed") else ""
            lines.append(f"  {row['setting']}: {tuner.get('reason', tuner.get('left_alone'))}{probe}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the settings side by side, print the table and write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="600 demo images and a tiny I/O-slow run")
    parser.add_argument("--cache-only", action="store_true", help="only the cache's random read and loader epochs")
    parser.add_argument(
        "--out", default=None, help="JSON path (default: results/dataloader.json, none with --cache-only)"
    )
    parser.add_argument("--cache-dir", default=None, help="where images and the packed cache go (default: a temp dir)")
    args = parser.parse_args(argv)
    num_images = 600 if args.quick else 5000
    load_before = os.getloadavg()  # the machine may be shared: a busy one makes every ratio noisier
    root = args.cache_dir or tempfile.mkdtemp(prefix="speedkit-bench-")
    DemoDataModule(num_images=num_images, root=root).prepare_data()  # generation is not part of any setting
    start = time.perf_counter()
    DemoDataModule(num_images=num_images, root=root, cache=True).setup("fit")  # one-time pack, reported apart
    cache_build_s = time.perf_counter() - start
    per_sample = per_sample_us(num_images, root, samples=min(num_images, 2000))
    epochs = cache_epochs(num_images, root)
    if args.cache_only:
        print(f"\nCachedDataset on {cpu_info().available_cores} cores, demo ({num_images} images, batch 32):")
        print(cache_table(per_sample, epochs))
        result = {"num_images": num_images, "cores": cpu_info().available_cores, "python": sys.version}
        result |= {"load_average": {"before": load_before, "after": os.getloadavg()}, "cache_build_s": cache_build_s}
        result |= {"per_sample": per_sample, "cache_epochs": epochs}
        if args.out is not None:
            write_json_atomic(result, args.out)
        return result
    # I/O-slow: 400 steps of batch 16 in the full run, long enough for the tuner's probe to pay back.
    io_slow = {"num_images": 320 if args.quick else 640, "delay_s": 0.002, "batch_size": 16}
    io_slow["epochs"] = 1 if args.quick else 10
    tensors = {"rows": 640 if args.quick else 12_000, "batch_size": 64, "epochs": 1 if args.quick else 6}
    rows = _fit_rows(num_images, root, io_slow, tensors)
    load_after = os.getloadavg()
    result = {
        "num_images": num_images,
        "io_slow": io_slow,
        "tensors": tensors,
        "cores": cpu_info().available_cores,
        "torch_threads": torch.get_num_threads(),
        "load_average": {"before": load_before, "after": load_after},
        "python": sys.version,
        "cache_build_s": cache_build_s,
        "per_sample": per_sample,
        "cache_epochs": epochs,
        "rows": rows,
    }
    lines = [
        f"\ndata loading on {cpu_info().available_cores} cores: demo ({num_images} images, batch 32, 1 epoch);"
        f" I/O-slow ({io_slow['num_images']} images, {1e3 * io_slow['delay_s']:g} ms a sample, batch"
        f" {io_slow['batch_size']}, {io_slow['epochs']} epochs); tensors ({tensors['rows']} rows, batch 64,"
        f" {tensors['epochs']} epochs); load average {load_before[0]:.1f} before,"
        f" {load_after[0]:.1f} after",
        fits_table(rows),
        f"one-time CachedDataset build (decode every image once, pack): {cache_build_s:.2f} s",
        cache_table(per_sample, epochs),
    ]
    print_and_write("\n".join(lines), result, args.out or DEFAULT_OUT)
    return result


def _fit_rows(num_images: int, root: str, io_slow: dict[str, Any], tensors: dict[str, Any]) -> list[dict[str, Any]]:
    """Every setting's fit on the three workloads, each against the naive loader of its workload."""

    def demo(cache: bool = False) -> L.LightningDataModule:
        return DemoDataModule(num_images=num_images, root=root, cache=cache)

    def slow() -> L.LightningDataModule:
        return SleepyData(io_slow["num_images"], io_slow["delay_s"], io_slow["batch_size"])

    sleep_ms, slow_epochs = f"{1e3 * io_slow['delay_s']:g} ms", io_slow["epochs"]
    rows = [
        fit_row("naive (num_workers=0, decode per sample)", "demo", demo, tune=False),
        fit_row("DataLoaderTuner", "demo", demo, tune=True),
        fit_row("DataLoaderTuner + CachedDataset", "demo", lambda: demo(cache=True), tune=True),
        fit_row(f"I/O-slow naive (num_workers=0, {sleep_ms} a sample)", "io_slow", slow, False, slow_epochs),
        fit_row("I/O-slow DataLoaderTuner", "io_slow", slow, True, slow_epochs),
    ]
    rows_data, rows_epochs = (lambda: TensorRows(tensors["rows"], tensors["batch_size"])), tensors["epochs"]
    rows += [
        fit_row("tensors naive (fetch per sample)", "tensors", rows_data, False, rows_epochs, RowsMLP),
        fit_row("tensors DataLoaderTuner", "tensors", rows_data, True, rows_epochs, RowsMLP),
    ]
    naive = {row["workload"]: row for row in rows if row["tuner"] is None}
    for row in rows:
        base = naive[row["workload"]]
        row["fit_ratio"] = row["fit_s"] / base["fit_s"]
        row["train_throughput_gain"] = row["train_samples_per_s"] / base["train_samples_per_s"]
        row["load_time_reduction"] = 1.0 - row["load_s_per_epoch"] / base["load_s_per_epoch"]
    return rows


if __name__ == "__main__":
    main()
