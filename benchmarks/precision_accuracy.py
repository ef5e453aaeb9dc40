"""Does bf16 autocast change the time to accuracy? Plain fits in fp32 and in bf16-mixed, epoch by epoch.

`lightning_speedkit.PrecisionTuner` (on by default in ``preset()``) chooses the precision by the time of a step and a
loss check over its probe's few steps; bf16 autocast also changes the numerics of every forward and backward, which
a few steps cannot show. For each task of `benchmarks/lr_tasks.py` at its right LR and each seed, the same plain
``Trainer.fit`` (no speedkit callback, the same weights and batch order) runs in ``"32-true"`` and in
``"bf16-mixed"``, back to back in rotated order. Per fit: the epoch and the time at which it first reaches the task's
lr_tasks target (`TARGETS`, the AVX-512 result's), the best and the final ``val_acc``, the median step. Only a CPU with
bf16 instructions runs bf16 at speed; elsewhere it is emulated (slow), but the epochs still say what it does to the
trajectory.

    python benchmarks/precision_accuracy.py --out benchmarks/results/avx512/precision_accuracy.json  # ~6 min
    python benchmarks/precision_accuracy.py --quick    # a smoke run for the tests (JSON to a temp dir)
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import lightning as L
import torch

from lightning_speedkit.demo.run import Timeline
from lightning_speedkit.report import machine_and_load

if str(Path(__file__).resolve().parent) not in sys.path:  # _harness and lr_tasks, also when loaded by path
    sys.path.append(str(Path(__file__).resolve().parent))

from _harness import QUIET, StepTimes, print_and_write, quick_args, rotated
from lr_tasks import QUICK_SIZES, TASKS, Task, _prepare, epoch_to_target, time_to_target, timed_points

DEFAULT_OUT = Path(__file__).parent / "results" / "precision_accuracy.json"
TARGETS = {"mlp": 0.871, "conv": 0.92, "transformer": 0.943, "demo": 0.833}
"""lr_tasks' targets, from its AVX-512 result (``benchmarks/results/avx512/lr_tasks.json``)."""
PRECISIONS = ("32-true", "bf16-mixed")
SEEDS = (0, 1, 2, 3, 4)


def fit(task: Task, seed: int, root: Path, precision: str) -> dict[str, Any]:
    """One whole-budget plain fit of ``task`` at its right LR in ``precision``; its record."""
    data = task.make_data(task, seed, root)
    L.seed_everything(seed, verbose=False)  # the same weights and batch order in both precisions
    model = task.make_model(task, task.right_lr)
    timeline, steps = Timeline(verbose=False), StepTimes()
    options = {"max_epochs": task.max_epochs, "num_sanity_val_steps": 0, "default_root_dir": str(root / "fits")}
    trainer = L.Trainer(
        accelerator="cpu", devices=1, precision=precision, callbacks=[timeline, steps], **QUIET, **options
    )
    seconds, points = timed_points(trainer, model, data, timeline)
    target = TARGETS[task.name]
    accs = [p["val_acc"] for p in points]
    return {
        "fit_s": round(seconds, 3),
        "median_step_ms": steps.median_ms(),
        "epoch_to_target": epoch_to_target(points, target),
        "time_to_target_s": time_to_target(points, target),
        "best_val_acc": max(accs) if accs else None,
        "final_val_acc": accs[-1] if accs else None,
        "val_acc": [round(a, 4) for a in accs],
    }


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per task, how bf16 compares with fp32 on the same seeds.

    The seeds where bf16 reached the target in fewer, the same or more epochs than fp32 (a miss counts as more when
    fp32 reached it), the median step ratio (bf16 over fp32) and the median time-to-target ratio where both reached it.
    """
    out: dict[str, Any] = {}
    for name in dict.fromkeys(r["task"] for r in rows):
        cells = [r for r in rows if r["task"] == name]
        fewer = same = more = 0
        time_ratios, step_ratios = [], []
        for r in cells:
            fp32, bf16 = r["32-true"], r["bf16-mixed"]
            a, b = fp32["epoch_to_target"], bf16["epoch_to_target"]
            if a is not None or b is not None:
                inf = float("inf")
                a_, b_ = (inf if a is None else a), (inf if b is None else b)
                fewer, same, more = fewer + (b_ < a_), same + (b_ == a_), more + (b_ > a_)
            if fp32["time_to_target_s"] and bf16["time_to_target_s"]:
                time_ratios.append(bf16["time_to_target_s"] / fp32["time_to_target_s"])
            if fp32["median_step_ms"] and bf16["median_step_ms"]:
                step_ratios.append(bf16["median_step_ms"] / fp32["median_step_ms"])
        out[name] = {
            "seeds": len(cells),
            "bf16_fewer_epochs": fewer,
            "bf16_same_epochs": same,
            "bf16_more_epochs": more,
            "bf16_over_fp32_step": round(statistics.median(step_ratios), 3) if step_ratios else None,
            "bf16_over_fp32_time_to_target": round(statistics.median(time_ratios), 3) if time_ratios else None,
        }
    return out


def run(quick: bool = False, out: str | Path = DEFAULT_OUT, threads: int = 1) -> dict[str, Any]:
    torch.set_num_threads(threads)
    root = Path(tempfile.mkdtemp(prefix="precision_accuracy-"))
    load_before = list(os.getloadavg())
    rows: list[dict[str, Any]] = []
    for name in ("mlp",) if quick else tuple(TARGETS):
        task = TASKS[name]
        if quick:
            task = dataclasses.replace(task, max_epochs=QUICK_SIZES[name][0], samples=QUICK_SIZES[name][1])
        for seed in SEEDS[:1] if quick else SEEDS:
            _prepare(task, seed, root)
            row: dict[str, Any] = {"task": name, "seed": seed}
            for precision in rotated(PRECISIONS, seed):
                row[precision] = fit(task, seed, root, precision)
            print(f"  {name:<12} seed {seed}  epochs to target: fp32 {row['32-true']['epoch_to_target']},"
                  f" bf16 {row['bf16-mixed']['epoch_to_target']}", flush=True)  # fmt: skip
            rows.append(row)
    result = {
        "settings": {"quick": quick, "threads": threads, "targets": TARGETS, "seeds": list(SEEDS)},
        **machine_and_load(load_before),
        "rows": rows,
        "summary": summary(rows),
    }
    lines = [f"{'task':<12}{'seed':>5}  {'fp32: epoch, s, best':>24}  {'bf16: epoch, s, best':>24}"]
    for r in rows:
        shown = []
        for p in PRECISIONS:
            x = r[p]
            t = f"{x['time_to_target_s']:.2f}" if x["time_to_target_s"] is not None else "missed"
            shown.append(f"{x['epoch_to_target']!s:>4} {t:>7} {x['best_val_acc']:.3f}")
        lines.append(f"{r['task']:<12}{r['seed']:>5}  {shown[0]:>24}  {shown[1]:>24}")
    lines.append(f"summary: {result['summary']}")
    print_and_write("\n".join(lines), result, out)
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    quick, out, threads = quick_args(argv, __doc__, DEFAULT_OUT, "the MLP, one seed, tiny budget: a smoke run")
    return run(quick=quick, out=out, threads=threads)


if __name__ == "__main__":
    main()
