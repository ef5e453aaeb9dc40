"""Two of preset()'s defaults against preset() without them, whole fits in the same run.

The two: the cool-down trial and the guard's measured snapshot interval.

- **cool-down**: ``preset()``, whose `lightning_speedkit.WarmupScheduler` decides the cool-down by a trial
  (``cooldown_check="trial"``), against ``preset(warmup={"cooldown_check": False})``, whose cool-down always runs (the
  default before the trial). On lr_tasks' MLP, the one task whose cool-down (180 steps) is long enough for the trial
  (its two sides, 2 x 32 steps, at most half the cool-down), and its conv net, whose 90-step cool-down skips it (the
  control: the two sides should only differ by noise), at user LRs of 10x too low, right and 10x too high, seeds 0-2.
  Each pair runs back to back in rotated order. Per fit: the time to the task's lr_tasks target (`TARGETS`) with
  every probe counted, the best and the final ``val_acc``, the fit's seconds.
- **guard interval**: ``preset()``, whose `lightning_speedkit.TrainingGuard` measures its snapshot interval (50 steps,
  doubled until a snapshot takes at most 1% of the steps' time), against ``preset(guard={"every_n_steps": 50})`` (the
  interval before) and ``preset(guard=False)``, on a model whose snapshot is cheap next to its step (lr_tasks' MLP at
  its right LR) and one whose snapshot is dear (`frozen`: a frozen 32M-weight embedding table under a small trained
  head, as when a pretrained part is kept fixed). ``rounds``
  rounds of the three fits in rotated order. Per fit: its seconds, its median step (the narrower figure), the guard's
  interval and its first snapshot's seconds.

Every fit decides afresh (`_harness.fresh_decisions`); one torch thread, as lr_tasks.

    python benchmarks/preset_defaults.py --out benchmarks/results/avx512/preset_defaults.json  # ~4 min on 2 cores
    python benchmarks/preset_defaults.py --quick    # a smoke run for the tests (JSON to a temp dir)
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
from torch import nn
from torch.utils.data import TensorDataset

import lightning_speedkit as speedkit
from lightning_speedkit.demo.run import Timeline
from lightning_speedkit.report import collect_reports, machine_and_load

if str(Path(__file__).resolve().parent) not in sys.path:  # _harness and lr_tasks, also when loaded by path
    sys.path.append(str(Path(__file__).resolve().parent))

from _harness import QUIET, StepTimes, fresh_decisions, print_and_write, quick_args, rotated
from lr_tasks import (
    QUICK_SIZES,
    TASKS,
    Classifier,
    Task,
    TensorData,
    _prepare,
    epoch_to_target,
    time_to_target,
    timed_points,
)

DEFAULT_OUT = Path(__file__).parent / "results" / "preset_defaults.json"
TARGETS = {"mlp": 0.871, "conv": 0.92}
"""lr_tasks' targets (98% of the best grid LR's mean peak val_acc; the same in its AVX2 and AVX-512 results)."""
FACTORS = (0.1, 1.0, 10.0)
SEEDS = (0, 1, 2)
COOLDOWN = {"trial": {}, "no check": {"warmup": {"cooldown_check": False}}}
GUARD = {"measured": {}, "every 50": {"guard": {"every_n_steps": 50}}, "no guard": {"guard": False}}


ROWS, DIM = 500_000, 64


def frozen_table() -> torch.Tensor:
    """The frozen table's weights (128 MB), the same for the model and its data's labels."""
    return torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(0))


def frozen_data(samples: int, seed: int, tokens: int = 8, classes: int = 4) -> TensorDataset:
    """``(tokens, label)``: random token ids; the label the argmax of a fixed projection of their mean embedding."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, ROWS, (samples, tokens), generator=g)
    projection = torch.randn(DIM, classes, generator=torch.Generator().manual_seed(1))
    return TensorDataset(ids, (frozen_table()[ids].mean(1) @ projection).argmax(1))


class FrozenTable(nn.Module):
    """A frozen embedding table (a pretrained part kept fixed: 32M weights) under a small trained head."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Embedding.from_pretrained(frozen_table(), freeze=True)
        self.head = nn.Sequential(nn.Linear(DIM, 64), nn.ReLU(), nn.Linear(64, 4))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """The head's logits on the mean of the tokens' frozen embeddings."""
        return self.head(self.table(ids).mean(1))  # type: ignore[no-any-return]


FROZEN = Task(
    "frozen", "adam", 3e-3, 5, 4000, 32,
    lambda task, seed, root: TensorData(frozen_data(task.samples, seed), task.batch_size),
    lambda task, lr: Classifier(FrozenTable(), task.optimizer, lr),
)  # fmt: skip
"""Its snapshot (the whole state dict: 128 MB) is dear next to its step (a lookup and a small head's update)."""


def fit(task: Task, factor: float, seed: int, root: Path, options: dict[str, Any]) -> dict[str, Any]:
    """One whole-budget fit of ``task`` under ``preset(**options)``, timed from ``trainer.fit``; its record."""
    data = task.make_data(task, seed, root)
    L.seed_everything(seed, verbose=False)  # the same weights and batch order on both sides
    model = task.make_model(task, task.right_lr * factor)
    timeline, steps = Timeline(verbose=False), StepTimes()
    fresh_decisions()
    budget = {"max_epochs": task.max_epochs, "num_sanity_val_steps": 0, "default_root_dir": str(root / "fits")}
    trainer = speedkit.preset(verbose=False, **QUIET, **budget, callbacks=[timeline, steps], **options)
    seconds, points = timed_points(trainer, model, data, timeline)
    reports, _ = collect_reports(trainer.callbacks)  # type: ignore[arg-type]
    warmup, guard = reports.get("WarmupScheduler") or {}, reports.get("TrainingGuard") or {}
    accs = [p["val_acc"] for p in points]
    return {
        "fit_s": round(seconds, 3),
        "steps": trainer.global_step,
        "median_step_ms": steps.median_ms(),
        "time_to_target_s": time_to_target(points, TARGETS[task.name]) if task.name in TARGETS else None,
        "epoch_to_target": epoch_to_target(points, TARGETS[task.name]) if task.name in TARGETS else None,
        "best_val_acc": max(accs) if accs else None,
        "final_val_acc": accs[-1] if accs else None,
        "cooldown": warmup.get("cooldown_check"),
        "guard": {k: guard.get(k) for k in ("every_n_steps", "snapshot_s", "snapshot_bytes")} if guard else None,
        "levers": {name: d["decision"] for name, d in trainer.speedkit.decisions().items()},  # type: ignore[attr-defined]
    }


def cooldown_rows(quick: bool, root: Path) -> list[dict[str, Any]]:
    """Every (task, user LR, seed) of the cool-down comparison: both variants' records."""
    rows = []
    for name in ("mlp", "conv"):
        task = TASKS[name]
        if quick:
            task = dataclasses.replace(task, max_epochs=QUICK_SIZES[name][0], samples=QUICK_SIZES[name][1])
        for seed in SEEDS[:1] if quick else SEEDS:
            _prepare(task, seed, root)
            for index, factor in enumerate((1.0,) if quick else FACTORS):
                row: dict[str, Any] = {"task": name, "factor": factor, "seed": seed}
                for variant in rotated(list(COOLDOWN), index + seed):
                    row[variant] = fit(task, factor, seed, root, COOLDOWN[variant])
                    print(
                        f"  {name:<5} x{factor:<4g} seed {seed}  {variant:<9} {row[variant]['fit_s']:6.2f} s",
                        flush=True,
                    )
                rows.append(row)
    return rows


def guard_rows(quick: bool, root: Path, rounds: int) -> list[dict[str, Any]]:
    """``rounds`` rounds of the three guard variants on each workload, in rotated order."""
    rows = []
    for task in (TASKS["mlp"], FROZEN):
        if quick:
            task = dataclasses.replace(task, max_epochs=1, samples=400)
        _prepare(task, 0, root)
        for r in range(rounds):
            for variant in rotated(list(GUARD), r):
                record = fit(task, 1.0, 0, root, GUARD[variant])
                rows.append({"workload": task.name, "round": r, "variant": variant, **record})
                print(f"  {task.name:<5} round {r}  {variant:<9} {record['fit_s']:6.2f} s", flush=True)
    return rows


def _paired(rows: list[dict[str, Any]], workload: str, variant: str, key: str) -> float | None:
    """The median over rounds of ``variant``'s ``key`` over the measured interval's, in the same round."""
    by = {(r["round"], r["variant"]): r[key] for r in rows if r["workload"] == workload}
    ratios = [by[(n, variant)] / by[(n, "measured")] for n, v in by if v == "measured" and by[(n, "measured")]]
    return round(statistics.median(ratios), 3) if ratios else None


def summary(cool: list[dict[str, Any]], guard: list[dict[str, Any]]) -> dict[str, Any]:
    """The counts of each cool-down task and the paired ratios of each guard workload.

    Per task: the cells where the trial side reached the target later (by more than 10%, or it missed where the other
    side reached it) and earlier (the same the other way). Per workload: the other variants' fit and median step times
    over the measured interval's, the median over rounds.
    """
    out: dict[str, Any] = {"cooldown": {}, "guard": {}}
    for name in TARGETS:
        cells = [r for r in cool if r["task"] == name]
        later = earlier = 0
        for r in cells:
            trial, plain = r["trial"]["time_to_target_s"], r["no check"]["time_to_target_s"]
            later += (trial is None and plain is not None) or (None not in (trial, plain) and trial > 1.1 * plain)
            earlier += (plain is None and trial is not None) or (None not in (trial, plain) and plain > 1.1 * trial)
        held = sum(bool((r["trial"]["cooldown"] or {}).get("held")) for r in cells)
        out["cooldown"][name] = {"cells": len(cells), "trial_later": later, "trial_earlier": earlier, "held": held}
    for workload in sorted({r["workload"] for r in guard}):
        out["guard"][workload] = {
            f"{variant}_over_measured": {k: _paired(guard, workload, variant, k) for k in ("fit_s", "median_step_ms")}
            for variant in GUARD
            if variant != "measured"
        }
    return out


def run(quick: bool = False, out: str | Path = DEFAULT_OUT, threads: int = 1, rounds: int = 3) -> dict[str, Any]:
    torch.set_num_threads(threads)
    root = Path(tempfile.mkdtemp(prefix="preset_defaults-"))
    load_before = list(os.getloadavg())
    print("the cool-down: preset() (trial) against preset(warmup={'cooldown_check': False})", flush=True)
    cool = cooldown_rows(quick, root)
    print("the guard: preset() (measured interval) against every 50 steps and no guard", flush=True)
    guard = guard_rows(quick, root, 1 if quick else rounds)
    result = {
        "settings": {"quick": quick, "threads": threads, "rounds": rounds, "targets": TARGETS},
        **machine_and_load(load_before),
        "cooldown": cool,
        "guard": guard,
        "summary": summary(cool, guard),
    }
    lines = [f"{'task':<6}{'user LR':>8}{'seed':>5}  {'trial: to target':>17} {'held':>5}  {'no check: to target':>20}"]
    for r in cool:
        t, p = r["trial"], r["no check"]
        shown = [f"{x['time_to_target_s']:.2f} s" if x["time_to_target_s"] is not None else "missed" for x in (t, p)]
        held = (t["cooldown"] or {}).get("held")
        lines.append(f"{r['task']:<6}{r['factor']:>7g}x{r['seed']:>5}  {shown[0]:>17} {held!s:>5}  {shown[1]:>20}")
    lines.append(
        f"{'workload':<9}{'round':>6}  {'variant':<10}{'fit s':>8}{'step ms':>9}{'every':>7}{'snapshot s':>11}"
    )
    for g in guard:
        every = (g["guard"] or {}).get("every_n_steps")
        snap = (g["guard"] or {}).get("snapshot_s")
        snap_text = f"{snap:.4f}" if snap is not None else "-"
        cells = (
            f"{g['workload']:<9}{g['round']:>6}  {g['variant']:<10}{g['fit_s']:>8.2f}{g['median_step_ms'] or 0:>9.2f}"
        )
        lines.append(f"{cells}{every if every is not None else '-'!s:>7}{snap_text:>11}")
    lines.append(f"summary: {result['summary']}")
    print_and_write("\n".join(lines), result, out)
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    quick, out, threads = quick_args(argv, __doc__, DEFAULT_OUT, "one seed at the right LR, tiny budgets: a smoke run")
    return run(quick=quick, out=out, threads=threads)


if __name__ == "__main__":
    main()
