"""Data loading on the embedded demo workload: naive loader vs DataLoaderTuner vs tuner + CachedDataset.

For each setting, in one run:
- ``load s/epoch``: seconds to iterate one full training epoch of the loader alone (decode + augment + collate),
- ``train data-wait``: in a real one-epoch ``Trainer.fit`` of the demo model, the seconds the steps waited for data
  and their share of step time, from the UtilizationMonitor.
Ratios are against the naive loader (``num_workers=0``, one JPEG decoded per sample) measured in the same run.

    python benchmarks/dataloader.py            # 5,000 images (about 2 minutes)
    python benchmarks/dataloader.py --quick    # 600 images
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

from lightning_speedkit.data import CachedDataset
from lightning_speedkit.dataloader import DataLoaderTuner
from lightning_speedkit.demo import DemoClassifier, DemoDataModule
from lightning_speedkit.demo.data import DecodedShapes, ensure_shapes
from lightning_speedkit.hardware import cpu_info
from lightning_speedkit.monitor import UtilizationMonitor
from lightning_speedkit.report import write_json_atomic


def _loader_epoch_seconds(loader: Any) -> float:
    """Seconds for the second of two full passes: the steady per-epoch cost (persistent workers already up)."""
    seconds = 0.0
    for _ in range(2):
        start = time.perf_counter()
        for _ in loader:
            pass
        seconds = time.perf_counter() - start
    return seconds


def measure(name: str, num_images: int, root: str, tune: bool, cache: bool, probe_batches: int) -> dict[str, Any]:
    """One setting: a one-epoch fit with the monitor (and the tuner), then one loader-only epoch."""
    L.seed_everything(0, verbose=False)
    datamodule = DemoDataModule(num_images=num_images, root=root, cache=cache)
    datamodule.prepare_data()
    monitor = UtilizationMonitor(window=10)
    callbacks: list[L.Callback] = [monitor]
    tuner = DataLoaderTuner(probe_batches=probe_batches) if tune else None
    if tuner is not None:
        callbacks.insert(0, tuner)
    trainer = L.Trainer(
        accelerator="cpu",
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=callbacks,
    )
    start = time.perf_counter()
    trainer.fit(DemoClassifier(crop_size=datamodule.crop_size), datamodule)
    fit_s = time.perf_counter() - start
    loader = trainer.train_dataloader
    load_s = _loader_epoch_seconds(loader)
    total = monitor.report()["total"]
    return {
        "setting": name,
        "num_workers": loader.num_workers,
        "load_s_per_epoch": load_s,
        "train_data_wait_s": total["data_wait_s"],
        "train_data_wait_fraction": total["data_wait_fraction"],
        "fit_s": fit_s,
        "tuner": tuner.report() if tuner is not None else None,
    }


def per_sample_us(num_images: int, root: str, samples: int) -> dict[str, float]:
    """Microseconds per random sample: open + decode one JPEG vs read the decoded sample from the packed cache."""
    directory = ensure_shapes(num_images, root=root)
    decoded = DecodedShapes(directory, range(num_images))
    cached = CachedDataset(decoded, directory / "packed")
    order = torch.randperm(num_images, generator=torch.Generator().manual_seed(0))[:samples].tolist()
    result = {}
    for name, dataset in (("jpeg_decode_us", decoded), ("packed_read_us", cached)):
        start = time.perf_counter()
        for index in order:
            dataset[index]
        result[name] = 1e6 * (time.perf_counter() - start) / len(order)
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the three settings side by side, print the table and write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="600 images instead of 5,000")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "dataloader.json"))
    parser.add_argument("--cache-dir", default=None, help="where images and the packed cache go (default: a temp dir)")
    args = parser.parse_args(argv)
    num_images = 600 if args.quick else 5000
    root = args.cache_dir or tempfile.mkdtemp(prefix="speedkit-bench-")
    DemoDataModule(num_images=num_images, root=root).prepare_data()  # generation is not part of any setting
    probe = 5 if args.quick else 20
    start = time.perf_counter()
    DemoDataModule(num_images=num_images, root=root, cache=True).setup("fit")  # one-time pack, reported apart
    cache_build_s = time.perf_counter() - start
    per_sample = per_sample_us(num_images, root, samples=min(num_images, 2000))
    rows = [
        measure(
            "naive (num_workers=0, decode per sample)", num_images, root, tune=False, cache=False, probe_batches=probe
        ),
        measure("DataLoaderTuner", num_images, root, True, False, probe),
        measure("DataLoaderTuner + CachedDataset", num_images, root, True, True, probe),
    ]
    base = rows[0]
    for row in rows:
        row["load_time_reduction"] = 1.0 - row["load_s_per_epoch"] / base["load_s_per_epoch"]
        row["train_data_wait_reduction"] = (
            1.0 - row["train_data_wait_s"] / base["train_data_wait_s"] if base["train_data_wait_s"] else 0.0
        )
    header = f"{'setting':<42} {'workers':>7} {'load s/epoch':>12} {'vs naive':>9} {'train wait s':>12} {'wait %':>7}"
    print(f"\ndata loading, demo workload ({num_images} images, batch 32), {cpu_info().available_cores} cores")
    print(header)
    print("-" * len(header))
    for row in rows:
        print(
            f"{row['setting']:<42} {row['num_workers']:>7} {row['load_s_per_epoch']:>12.2f}"
            f" {0.0 - 100 * row['load_time_reduction']:>+8.0f}% {row['train_data_wait_s']:>12.2f}"
            f" {100 * row['train_data_wait_fraction']:>6.1f}%"
        )
    result = {
        "num_images": num_images,
        "cores": cpu_info().available_cores,
        "python": sys.version,
        "cache_build_s": cache_build_s,
        "per_sample": per_sample,
        "rows": rows,
    }
    write_json_atomic(result, args.out)
    print(f"one-time CachedDataset build (decode every image once, pack): {cache_build_s:.2f} s")
    print(
        f"per random sample: open + decode JPEG {per_sample['jpeg_decode_us']:.0f} us,"
        f" read from the packed cache {per_sample['packed_read_us']:.1f} us"
    )
    print(f"wrote {os.path.relpath(args.out)}")
    return result


if __name__ == "__main__":
    main()
