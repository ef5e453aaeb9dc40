"""speedkit's BatchSizeFinder vs Lightning's, side by side in one run, on the demo workload with an injected limit.

The machine has no GPU allocator to run out of, so `lightning_speedkit.oom.MemoryLimit` raises a real
``torch.OutOfMemoryError`` (with CUDA's message, which Lightning's text matching recognises) whenever a forward pass
runs a batch above the limit; eval mode can have a lower limit, as when validation keeps more activations. Each
scenario fits DemoClassifier on DemoDataModule once per finder and reports the size found vs the true maximum, the
trials, the time from setup to the first training batch, whether the training and validation that follow run out of
memory, and the LR before and after. Run ``python benchmarks/batch_size.py [--quick] [--out PATH]``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import BatchSizeFinder as LightningFinder
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_speedkit.batch_size import BatchSizeFinder
from lightning_speedkit.demo import DemoClassifier, DemoDataModule
from lightning_speedkit.oom import MemoryLimit, batch_size_of, is_oom_error

if str(Path(__file__).resolve().parent) not in sys.path:  # _harness, also when a test loads this file by path
    sys.path.append(str(Path(__file__).resolve().parent))

from _harness import Column, alternated, print_and_write, quiet_trainer, table

DEFAULT_OUT = Path(__file__).parent / "results" / "batch_size.json"
CONFIGURED_BATCH = 32


class Watch(Callback):
    """Times setup -> first training batch, records the LR there, and counts trials from the forward batch sizes."""

    def __init__(self, model: L.LightningModule) -> None:
        self.sizes: list[int] = []
        self.searching = True
        self.phase = "search"
        self.t0 = self.t1 = self.cpu0 = self.cpu1 = 0.0
        self.lr_after: float | None = None
        model.register_forward_pre_hook(self._record, prepend=True)

    def _record(self, module: torch.nn.Module, args: Any) -> None:
        size = batch_size_of(args)
        if self.searching and module.training and size is not None and (not self.sizes or self.sizes[-1] != size):
            self.sizes.append(size)

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        """Start the clock."""
        self.t0, self.cpu0 = time.perf_counter(), time.process_time()

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Stop the clock when real training starts (both finders run in on_fit_start, before this)."""
        if self.searching:
            self.t1, self.cpu1 = time.perf_counter(), time.process_time()
            self.searching, self.phase = False, "training"
            self.lr_after = float(trainer.optimizers[0].param_groups[0]["lr"])

    @override
    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Validation of the real run (the finders' trials run with other callbacks removed)."""
        self.phase = "validation"

    @override
    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Back to training."""
        self.phase = "training"


def run_one(name: str, finder: Callback, scenario: dict[str, Any], root: Path) -> dict[str, Any]:
    """Fit once with ``finder`` under the scenario's limits; report the outcome."""
    L.seed_everything(0, verbose=False)
    data = DemoDataModule(num_images=scenario["num_images"], image_size=32, batch_size=CONFIGURED_BATCH, root=root)
    model = DemoClassifier(width=4, lr=1e-3, crop_size=data.crop_size)
    MemoryLimit(scenario["limit"], scenario["eval_limit"]).attach(model)
    watch = Watch(model)
    trainer = quiet_trainer(
        devices=1,
        max_epochs=1,
        limit_train_batches=3,
        limit_val_batches=2,
        num_sanity_val_steps=0,
        callbacks=[finder, watch],
        default_root_dir=root,
    )
    outcome = "ok"
    try:
        trainer.fit(model, data)
    except Exception as exc:
        if not is_oom_error(exc):
            raise
        outcome = f"OOM in {watch.phase}"
    found = int(data.batch_size)
    true_max = min(scenario["limit"], scenario["eval_limit"], scenario.get("max_val") or 10**9)
    return {
        "finder": name,
        "found": found,
        "true_max": true_max,
        "found_over_max": found / true_max,
        "trials": len(watch.sizes),
        "sizes_tried": watch.sizes,
        "search_s": watch.t1 - watch.t0 if watch.t1 else None,
        "search_cpu_s": watch.cpu1 - watch.cpu0 if watch.t1 else None,
        "after_search": outcome,
        "lr_before": 1e-3,
        "lr_after": watch.lr_after,
    }


def scenarios(quick: bool) -> list[dict[str, Any]]:
    """Training limit only; validation tighter than training; a max_val cap in power mode without any OOM."""
    n = 300 if quick else 2000
    big = 90 if quick else 600
    return [
        {"name": "train limit", "num_images": n, "limit": big // 2, "eval_limit": big // 2, "mode": "binsearch"},
        {"name": "eval needs more", "num_images": n, "limit": big // 2, "eval_limit": big // 3, "mode": "binsearch"},
        {"name": "max_val=100", "num_images": n, "limit": 10**6, "eval_limit": 10**6, "mode": "power", "max_val": 100},
    ]


def main(quick: bool = False, out: str | Path = DEFAULT_OUT) -> dict[str, Any]:
    """Run every scenario with both finders, print the table, write the JSON, return it."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        warm = {"num_images": scenarios(quick)[0]["num_images"], "limit": 10**6, "eval_limit": 10**6}
        run_one("warm-up", Callback(), warm, root)  # generate the images, fill the file cache, warm up torch
        for index, scenario in enumerate(scenarios(quick)):
            margin, max_val, mode = 0.05, scenario.get("max_val", 8192), scenario["mode"]
            ours = BatchSizeFinder(mode=mode, max_val=max_val, margin=margin)
            theirs = LightningFinder(mode=mode, max_val=max_val, margin=margin)
            pair = [("lightning", theirs), ("speedkit", ours)]
            for name, finder in alternated(pair, index):  # alternate which runs first
                row = run_one(name, finder, scenario, root)
                row["scenario"] = scenario["name"]
                rows.append(row)
            if index % 2:
                rows[-2:] = rows[-2:][::-1]  # lightning first in the table
    for lightning_row, ours_row in zip(rows[::2], rows[1::2], strict=True):
        if lightning_row["search_cpu_s"] and ours_row["search_cpu_s"]:
            ours_row["search_time_vs_lightning"] = ours_row["search_cpu_s"] / lightning_row["search_cpu_s"]
    result = {"quick": quick, "margin": 0.05, "configured_batch": CONFIGURED_BATCH, "rows": rows}
    print_and_write(format_table(rows), result, out)
    return result


def format_table(rows: list[dict[str, Any]]) -> str:
    """A plain-text table, one line per scenario and finder."""
    columns = [
        Column("scenario", 16, "scenario", align="<"),
        Column("finder", 10, "finder", align="<"),
        Column("found", 5, "found"),
        Column("max", 5, "true_max"),
        Column("ratio", 5, "found_over_max", ".2f"),
        Column("trials", 6, "trials"),
        Column("wall s", 6, lambda r: r["search_s"] or None, ".1f"),  # no search timed: "-"
        Column("CPU s", 6, lambda r: r["search_cpu_s"] if r["search_s"] else None, ".1f"),
        Column("vs L", 5, lambda r: f"{r['search_time_vs_lightning']:.2f}" if "search_time_vs_lightning" in r else ""),
        Column("after search", 18, "after_search", align="<"),
        Column("LR after", 9, lambda r: f"{r['lr_after']:.2e}" if r["lr_after"] else "-"),
    ]
    return table(columns, rows, sep=" ", rule=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller data set and limits (for tests)")
    parser.add_argument("--out", default=str(DEFAULT_OUT), help="where to write the JSON results")
    args = parser.parse_args()
    main(quick=args.quick, out=args.out)
