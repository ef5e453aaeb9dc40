"""Streaming from litdata against our CachedDataset, whole fits on the demo's images (end to end, one run each).

Every fit trains the demo model (`lightning_speedkit.demo`) for the same epochs on the same split, validating each
epoch; its seconds include everything the fit does (probes, worker start-ups, validation). The data is written once
before the fits and that time is reported apart: litdata's ``optimize`` (`lightning_speedkit.data.write_streaming`,
both splits) and the CachedDataset's pack (both splits). An untimed two-step fit first warms the process up (the
first fit of a process pays torch's one-time start-up), so no setting pays it. Each row keeps the 1-minute load
average before and after its fit: on a shared 2-core machine a fit that ran beside another job is several times
slower (two intra-op threads stall for whole time slices), and its row says so. Four epochs by default: the loader
probe (4 settings) cannot pay back in three epochs of 125 steps (`lightning_speedkit.decisions`), and then there
would be nothing tuned to compare.

- ``streaming naive``: a litdata ``StreamingDataLoader``, ``num_workers=0``, a plain Trainer: the reference.
- ``streaming + DataLoaderTuner``: the same, with the loader tuner (workers and prefetch timed on real steps).
- ``streaming + preset()``: the same data under the whole pack.
- ``CachedDataset naive`` / ``CachedDataset + preset()``: our packed cache, a plain ``DataLoader``.

Usage::

    python benchmarks/streaming.py            # 5000 images, 4 epochs -> benchmarks/results/streaming.json
    python benchmarks/streaming.py --quick    # 300 images, 1 epoch (a smoke run; its ratios mean nothing)
    python benchmarks/streaming.py --threads 1   # one intra-op thread: on a machine another job shares, two
                                                 # threads stall for whole time slices and the fits crawl
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import QUIET, Column, fresh_decisions, print_and_write, quiet_trainer, table, timed_fit

from lightning_speedkit import DataLoaderTuner, preset
from lightning_speedkit.demo.data import DecodedShapes, DemoDataModule, ensure_shapes, ensure_streaming
from lightning_speedkit.demo.model import DemoClassifier
from lightning_speedkit.hardware import cpu_info

OUT = Path(__file__).resolve().parent / "results" / "streaming.json"
SETTINGS = (
    "streaming naive",
    "streaming + DataLoaderTuner",
    "streaming + preset()",
    "CachedDataset naive",
    "CachedDataset + preset()",
)


def prepare(num_images: int, root: str) -> dict[str, float]:
    """Generate the images (untimed), then write litdata's copy and the packed cache of both splits, each timed."""
    DemoDataModule(num_images=num_images, root=root).prepare_data()
    directory = ensure_shapes(num_images, root=root)
    splits = DemoDataModule(num_images=num_images, root=root)._splits()
    shutil.rmtree(directory / "litdata", ignore_errors=True)
    shutil.rmtree(directory / "packed", ignore_errors=True)
    start = time.perf_counter()
    for indices in splits:
        ensure_streaming(DecodedShapes(directory, indices), directory)
    optimize_s = time.perf_counter() - start
    start = time.perf_counter()
    cached = DemoDataModule(num_images=num_images, root=root, cache=True)
    cached.setup("fit")
    for dataset in (cached.train_set, cached.val_set):
        dataset.build()  # type: ignore[union-attr]
    return {"litdata_optimize_s": optimize_s, "cache_build_s": time.perf_counter() - start}


def warm_up(num_images: int, root: str) -> None:
    """Two untimed steps on the cached data: the process's one-time start-up is paid before any timed fit."""
    data = DemoDataModule(num_images=num_images, root=root, cache=True)
    quiet_trainer(max_steps=2, limit_val_batches=1).fit(DemoClassifier(crop_size=data.crop_size), data)


def fit_one(setting: str, num_images: int, root: str, epochs: int) -> dict[str, Any]:
    """One timed fit of ``setting``: seconds, steps, samples/s, val_acc and the loader tuner's decision."""
    L.seed_everything(0, verbose=False)
    streaming = setting.startswith("streaming")
    data = DemoDataModule(num_images=num_images, root=root, streaming=streaming, cache=not streaming)
    model = DemoClassifier(crop_size=data.crop_size)
    tuner = DataLoaderTuner() if "DataLoaderTuner" in setting else None
    if "preset" in setting:
        fresh_decisions()
        trainer = preset(accelerator="cpu", verbose=False, max_epochs=epochs, **QUIET)
    else:
        trainer = quiet_trainer(max_epochs=epochs, callbacks=[tuner] if tuner else [])
    load_before, cpu_before = os.getloadavg()[0], time.process_time()
    fit = timed_fit(trainer, model, data)
    cpu_s, load_after = time.process_time() - cpu_before, os.getloadavg()[0]
    found = next((c for c in trainer.callbacks if isinstance(c, DataLoaderTuner)), None)  # type: ignore[attr-defined]
    report = found.report() if found is not None else None
    loader = trainer.train_dataloader
    train_samples = len(data.train_set) * epochs  # type: ignore[arg-type]
    return {
        "setting": setting,
        "fit_s": fit.seconds,
        "steps": fit.steps,
        "samples_per_s": train_samples / fit.seconds,
        "val_acc": fit.val_acc,
        "loader": type(loader).__name__,
        "num_workers": getattr(loader, "num_workers", None),
        "load_1m": [load_before, load_after],  # above ~2 on 2 cores: another job shared them (the fit is slower)
        "cpu_s": cpu_s,  # this process's CPU seconds (workers not counted)
        "tuner": None if report is None else {k: report.get(k) for k in ("decision", "reason", "probed", "probe_s")},
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Prepare the data, run every setting once, print the table and write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="300 images, 1 epoch: a smoke run")
    parser.add_argument("--epochs", type=int, default=None, help="epochs of every fit (default 4; 1 with --quick)")
    parser.add_argument("--out", default=str(OUT), help="JSON path (default: %(default)s)")
    parser.add_argument(
        "--threads", type=int, default=None, help="torch intra-op threads (default: torch's); 1 on a shared machine"
    )
    parser.add_argument("--cache-dir", default=None, help="where images and both formats go (default: a temp dir)")
    args = parser.parse_args(argv)
    num_images = 300 if args.quick else 5000
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    epochs = args.epochs or (1 if args.quick else 4)
    root = args.cache_dir or tempfile.mkdtemp(prefix="speedkit-bench-streaming-")
    load_before = os.getloadavg()
    prepared = prepare(num_images, root)
    warm_up(num_images, root)
    rows = [fit_one(setting, num_images, root, epochs) for setting in SETTINGS]
    for row in rows:
        row["fit_ratio"] = rows[0]["fit_s"] / row["fit_s"]
    import litdata  # type: ignore[import-untyped]

    result = {
        "num_images": num_images,
        "epochs": epochs,
        "batch_size": 32,
        "cores": cpu_info().available_cores,
        "torch_threads": torch.get_num_threads(),
        "load_average": {"before": load_before, "after": os.getloadavg()},
        "versions": {"litdata": litdata.__version__, "torch": torch.__version__, "lightning": L.__version__},
        "python": sys.version,
        "command": " ".join(["python benchmarks/streaming.py", *(argv if argv is not None else sys.argv[1:])]),
        "prepare": prepared,
        "rows": rows,
    }
    columns = [
        Column("setting", 29, "setting", align="<"),
        Column("fit s", 8, "fit_s", ".1f"),
        Column("samples/s", 10, "samples_per_s", ".0f"),
        Column("vs naive", 9, "fit_ratio", ".2f", suffix="x"),
        Column("workers", 8, "num_workers"),
        Column("val_acc", 8, "val_acc", ".3f"),
        Column("load", 6, lambda row: max(row["load_1m"]), ".1f"),
    ]
    lines = [
        f"\nstreaming vs cached on {result['cores']} cores: demo ({num_images} images, batch 32, {epochs} epochs);"
        f" litdata optimize {prepared['litdata_optimize_s']:.1f} s, cache build {prepared['cache_build_s']:.1f} s;"
        f" load average {load_before[0]:.1f} before, {result['load_average']['after'][0]:.1f} after",
        table(columns, rows, sep=" ", rule=True),
    ]
    lines += [f"  {r['setting']}: {r['tuner']['reason']}" for r in rows if r["tuner"] is not None]
    print_and_write("\n".join(lines), result, args.out)
    return result


if __name__ == "__main__":
    main()
