"""A short job under preset() against a plain Trainer: no probe can pay back in tens of steps, so none may run.

The job of the measured-decisions issue: a small CNN on 1,400 in-memory 8x8 samples, batch 32, 2 epochs (88 steps).
Each repeat fits it with a plain ``lightning.Trainer`` and with ``speedkit.preset()`` (logger off, as the plain one),
alternating which goes first; the figure is the median fit time of each and their ratio, with what each of preset's
levers reported (every probe skipped, and why).

    python benchmarks/short_job.py            # about a minute on 2 CPU cores
    python benchmarks/short_job.py --quick    # a smoke run for the tests
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from typing_extensions import override

import lightning_speedkit as speedkit

if str(Path(__file__).resolve().parent) not in sys.path:  # _harness, also when a test loads this file by path
    sys.path.append(str(Path(__file__).resolve().parent))

from _harness import QUIET, alternated, fresh_decisions, print_and_write, quiet_trainer, timed_fit

DEFAULT_OUT = Path(__file__).parent / "results" / "short_job.json"
LEVERS = ("ChannelsLast", "PrecisionTuner", "DataLoaderTuner", "LRFinder")


class SmallCNN(L.LightningModule):
    """One 3x3 convolution and a linear head on 1x8x8 inputs, Adam at 1e-3."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(512, 10))
        self.example_input_array = torch.zeros(2, 1, 8, 8)

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)  # type: ignore[no-any-return]

    @override
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


class SmallData(L.LightningDataModule):
    """1,400 random 1x8x8 samples with 10 labels, shuffled, batch 32."""

    @override
    def train_dataloader(self) -> DataLoader[Any]:
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(1400, 1, 8, 8, generator=generator)
        y = torch.randint(0, 10, (1400,), generator=generator)
        return DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True)


def fit_once(kind: str, root: str, epochs: int) -> dict[str, Any]:
    """One fit of the job with a plain Trainer or preset(); its seconds and, for preset, each lever's report."""
    L.seed_everything(0, verbose=False)
    options: dict[str, Any] = {"max_epochs": epochs, "default_root_dir": root}
    if kind == "plain":
        trainer = quiet_trainer(devices=1, **options)
    else:
        fresh_decisions()  # preset's levers decide afresh in every repeat (no decision remembered from the last)
        trainer = speedkit.preset(verbose=False, **QUIET, **options)
    fit = timed_fit(trainer, SmallCNN(), SmallData())
    row: dict[str, Any] = {"run": kind, "fit_s": fit.seconds, "steps": fit.steps}
    if kind == "preset":
        levers = [c for c in trainer.callbacks if type(c).__name__ in LEVERS]  # type: ignore[attr-defined]
        reports = {type(c).__name__: c.report() for c in levers}
        row["levers"] = {name: {k: r.get(k) for k in ("probed", "reason", "probe_s")} for name, r in reports.items()}
    return row


def run(quick: bool = False, out: str | Path = DEFAULT_OUT) -> dict[str, Any]:
    """Alternate plain and preset fits, print the medians and their ratio, and write the JSON."""
    repeats, epochs = (1, 1) if quick else (7, 2)
    root = tempfile.mkdtemp(prefix="speedkit-short-job-")
    fit_once("plain", root, epochs)  # warm-up: imports and first-call costs are paid by neither side
    rows = []
    for repeat in range(repeats):
        for kind in alternated(("plain", "preset"), repeat):
            rows.append({"repeat": repeat, **fit_once(kind, root, epochs)})
    medians = {kind: statistics.median(r["fit_s"] for r in rows if r["run"] == kind) for kind in ("plain", "preset")}
    result = {
        "settings": {"quick": quick, "repeats": repeats, "epochs": epochs, "torch_threads": torch.get_num_threads()},
        "rows": rows,
        "median_fit_s": medians,
        "preset_over_plain": medians["preset"] / medians["plain"],
        "levers": next(r["levers"] for r in rows if r["run"] == "preset"),
    }
    steps = rows[0]["steps"]
    lines = [f"short job: {steps} steps; median fit plain {medians['plain']:.2f} s, preset {medians['preset']:.2f} s"]
    lines.append(f"preset / plain = {result['preset_over_plain']:.3f}")
    lines += [f"  {name:<16} probed={lever['probed']}  {lever['reason']}" for name, lever in result["levers"].items()]
    print_and_write("\n".join(lines), result, out)
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one repeat of one epoch, for smoke tests")
    parser.add_argument("--out", default=str(DEFAULT_OUT), help="where to write the JSON results")
    args = parser.parse_args(argv)
    return run(quick=args.quick, out=args.out)


if __name__ == "__main__":
    main()
