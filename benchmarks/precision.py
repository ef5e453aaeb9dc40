"""Precision on this CPU: ``32-true`` against ``bf16-mixed`` autocast for the demo model, per step and end to end.

Whether bf16 autocast is faster depends on the chip, so this records the CPU's bf16-relevant flags beside the figures:
- ``per step``: median milliseconds of a full training step (forward, loss, backward, AdamW) of the demo ResNet at
  batch 32, in each precision and layout, from the same weights on the same batch, in interleaved rounds;
- ``end to end``: a whole fit of the demo (packed cache, batch 32) in each precision with a plain Trainer, in the same
  run, with its final val_acc, beside the fit under `PrecisionTuner` (its probe included) and what it chose.

    python benchmarks/precision.py            # about two minutes on 2 CPU cores
    python benchmarks/precision.py --quick    # seconds: a smoke run for the tests
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import lightning as L
import torch

from lightning_speedkit.demo import DemoClassifier, DemoDataModule, DemoResNet
from lightning_speedkit.hardware import cpu_info
from lightning_speedkit.layout import to_channels_last
from lightning_speedkit.precision import PrecisionTuner

if str(Path(__file__).resolve().parent) not in sys.path:  # _harness, also when a test loads this file by path
    sys.path.append(str(Path(__file__).resolve().parent))

from _harness import (
    Column,
    alternated,
    fixed_batch,
    interleaved_ms,
    print_and_write,
    quiet_trainer,
    table,
    timed_fit,
    train_step,
)

DEFAULT_OUT = Path(__file__).parent / "results" / "precision.json"
PRECISIONS = ("32-true", "bf16-mixed")


def _settings(quick: bool) -> dict[str, Any]:
    if quick:
        return {"rounds": 1, "repeats": 2, "batch": 8, "images": 400, "epochs": 1, "fits": 1}
    return {"rounds": 5, "repeats": 10, "batch": 32, "images": 3000, "epochs": 3, "fits": 2}


def per_step(batch: int, rounds: int, repeats: int) -> list[dict[str, Any]]:
    """Median ms per training step for each layout and precision, in interleaved rounds."""
    x, y = fixed_batch(batch, 56)
    torch.manual_seed(0)
    base = DemoResNet(width=16)
    runs: dict[tuple[str, str], Any] = {}
    for layout in ("NCHW", "NHWC"):
        for precision in PRECISIONS:
            model = copy.deepcopy(base)
            if layout == "NHWC":
                to_channels_last(model)
            runs[layout, precision] = train_step(model, x, y, torch.bfloat16 if precision == "bf16-mixed" else None)
    ms = interleaved_ms(runs, rounds, repeats)
    rows = []
    for layout in ("NCHW", "NHWC"):
        fp32, bf16 = ms[layout, "32-true"], ms[layout, "bf16-mixed"]
        rows.append({"layout": layout, "fp32_ms": fp32, "bf16_ms": bf16, "speedup": fp32 / bf16})
    return rows


def end_to_end(root: str, images: int, batch: int, epochs: int, fits: int) -> list[dict[str, Any]]:
    """Whole fits in each fixed precision and under PrecisionTuner, alternating, each timed from fit() to its end."""
    DemoDataModule(num_images=images, root=root, cache=True).setup("fit")  # build the packed cache once, untimed
    rows: list[dict[str, Any]] = []
    for repeat in range(fits):
        for name in alternated((*PRECISIONS, "PrecisionTuner"), repeat):
            L.seed_everything(0, verbose=False)
            datamodule = DemoDataModule(num_images=images, root=root, cache=True, batch_size=batch)
            tuner = PrecisionTuner() if name == "PrecisionTuner" else None
            trainer = quiet_trainer(
                precision="32-true" if tuner is not None else name,
                max_epochs=epochs,
                num_sanity_val_steps=0,
                callbacks=[tuner] if tuner is not None else [],
            )
            model = DemoClassifier(crop_size=datamodule.crop_size)
            fit = timed_fit(trainer, model, datamodule)
            row = {"run": name, "repeat": repeat, "fit_s": fit.seconds, "val_acc": fit.val_acc}
            row["precision_used"] = trainer.precision
            if tuner is not None:
                row["tuner"] = tuner.report()
            rows.append(row)
    return rows


def run(quick: bool = False, out: str | Path = DEFAULT_OUT, cache_dir: str | None = None) -> dict[str, Any]:
    """Measure, print the tables and write the JSON."""
    s = _settings(quick)
    cpu = cpu_info()
    steps = per_step(s["batch"], s["rounds"], s["repeats"])
    root = cache_dir or tempfile.mkdtemp(prefix="speedkit-precision-")
    fits = end_to_end(root, s["images"], s["batch"], s["epochs"], s["fits"])
    summary = {}
    for name in (*PRECISIONS, "PrecisionTuner"):
        own = [r for r in fits if r["run"] == name]
        summary[name] = {
            "fit_s_median": statistics.median(r["fit_s"] for r in own),
            "val_acc": [r["val_acc"] for r in own],
        }
    fastest = min(PRECISIONS, key=lambda p: summary[p]["fit_s_median"])
    chosen = {r["tuner"]["decision"] for r in fits if r["run"] == "PrecisionTuner"}
    result = {
        "settings": {"quick": quick, **s, "torch_threads": torch.get_num_threads()},
        "cpu": {"model": cpu.model, "flags": list(cpu.flags), "bf16_instructions": cpu.bf16_instructions},
        "per_step": steps,
        "end_to_end": fits,
        "summary": summary,
        "fastest_end_to_end": fastest,
        "tuner_chose": sorted(chosen),
        "tuner_matches_fastest": chosen == {fastest},
    }
    print_and_write(format_tables(result), result, out)
    return result


def format_tables(result: dict[str, Any]) -> str:
    """The per-step and end-to-end tables as fixed-width text."""
    lines = [f"CPU: {result['cpu']['model']} (bf16 instructions: {result['cpu']['bf16_instructions'] or 'none'})"]
    columns = [
        Column("layout", 8, "layout", align="<"),
        Column("fp32 ms", 10, "fp32_ms", ".2f"),
        Column("bf16 ms", 10, "bf16_ms", ".2f"),
        Column("speed-up", 10, "speedup", ".2f", suffix="x"),
    ]
    lines.append(table(columns, result["per_step"]))
    lines.append(f"\n{'fit':<16}{'median s':>10}  val_acc per fit")
    for name, row in result["summary"].items():
        accs = ", ".join(f"{a:.3f}" for a in row["val_acc"])
        lines.append(f"{name:<16}{row['fit_s_median']:>10.2f}  {accs}")
    lines.append(f"fastest end to end: {result['fastest_end_to_end']}; PrecisionTuner chose {result['tuner_chose']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tiny run for smoke tests")
    parser.add_argument("--out", default=str(DEFAULT_OUT), help="where to write the JSON results")
    parser.add_argument("--cache-dir", default=None, help="where the demo images go (default: a temp dir)")
    args = parser.parse_args(argv)
    return run(quick=args.quick, out=args.out, cache_dir=args.cache_dir)


if __name__ == "__main__":
    main()
