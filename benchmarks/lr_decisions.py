"""The LR search's decision in every cell of `lr_tasks`, and nothing after it: a change to the search checked fast.

`lr_tasks.py` fits every cell for its whole budget (half an hour on 2 CPU cores). A change to the LR trials
(`lightning_speedkit.lr_search`, `lightning_speedkit.LRFinder`) first changes what they decide, and that can be read
without the fits: here each task, user LR and seed starts ``preset(lr="auto")`` exactly as `lr_tasks.fit_one` does
(the same data, seed, initial weights and user schedule, every decision afresh) and stops the fit at its first
training step, when every fit-start decision is made (`StopAfterDecisions`). Each cell's record is the LR finder's
report: its scale, chosen LR, steps, seconds, reason and every trial's losses. ``--compare A B`` lists the cells
whose scale differs between two such files (a change that decides every cell alike needs no new time-to-target run
to stay as safe).

    python benchmarks/lr_decisions.py --threads 1 --out /tmp/before.json   # every cell: about a minute on 2 cores
    python benchmarks/lr_decisions.py --threads 1 --tasks mlp --schedule cosine --out /tmp/after.json
    python benchmarks/lr_decisions.py --compare /tmp/before.json /tmp/after.json
    python benchmarks/lr_decisions.py --quick                     # the MLP at two user LRs: a smoke run

The seconds here are not a benchmark's (no warm-up fit, first-call costs included): read them as the trials' order
of magnitude only; `lr_tasks.py` times them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import lightning as L
from typing_extensions import override

from lightning_speedkit.demo.run import parse_seeds
from lightning_speedkit.hardware import cpu_info
from lightning_speedkit.report import collect_reports

if str(Path(__file__).resolve().parent) not in sys.path:  # _harness, also when a test loads this file by path
    sys.path.append(str(Path(__file__).resolve().parent))

import lr_tasks
from _harness import Column, print_and_write, table, torch_threads


class Decided(Exception):
    """Raised by `StopAfterDecisions` at a fit's first training step: every fit-start decision is made."""


class StopAfterDecisions(L.Callback):
    """Ends the fit at its first training step (`Decided`), keeping the trainer to read the decisions from."""

    def __init__(self) -> None:
        self.trainer: L.Trainer | None = None

    @override
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self.trainer = trainer
        raise Decided


def decide_one(task: lr_tasks.Task, factor: float, seed: int, root: Path, device: str) -> dict[str, Any]:
    """``preset(lr="auto")``'s LR decision on ``task`` at ``factor`` x its right LR for ``seed``; the cell's record.

    The record: the cell (``task``, ``factor``, ``seed``, ``lr``), ``stopped_at_step`` and the LR finder's report
    (`lightning_speedkit.LRFinder.report`: ``scale``, ``chosen_lr``, ``steps``, ``probe_s``, ``reason``, ``trials``...).

    Raises:
        RuntimeError: If the fit ended before its first training step (nothing was decided).
    """
    stop = StopAfterDecisions()
    with contextlib.suppress(Decided):
        lr_tasks.fit_one(task, "preset_auto", factor, seed, root, device, show=False, callbacks=[stop])
    if stop.trainer is None:
        raise RuntimeError(f"{task.name} x{factor:g} seed {seed}: the fit ended before its first training step")
    reports, _ = collect_reports(stop.trainer.callbacks)  # type: ignore[attr-defined]
    record = {"task": task.name, "factor": factor, "seed": seed, "lr": task.right_lr * factor}
    return record | {"stopped_at_step": stop.trainer.global_step} | reports.get("LRFinder", {})


def run(
    tasks: Sequence[str],
    seeds: Sequence[int],
    out: str | Path,
    schedule: str = "constant",
    threads: int | None = None,
    factors: Sequence[float] = tuple(lr_tasks.FACTORS),
) -> dict[str, Any]:
    """Every cell's decision (`decide_one`) at the tasks' full budgets; the result, printed and written to ``out``.

    Args:
        tasks: Names of `lr_tasks.TASKS`.
        seeds: The seeds of every task and user LR.
        out: The JSON written.
        schedule: The user's own LR schedule in every fit (`lr_tasks.SCHEDULES`).
        threads: Torch's intra-op threads during the run (None: as they are).
        factors: The user's LRs, as multiples of each task's right LR.
    """
    started, decisions = time.perf_counter(), []
    with torch_threads(threads), tempfile.TemporaryDirectory(prefix="speedkit-lr-decisions-") as tmp:
        chosen, settings = lr_tasks.run_settings(False, tasks, seeds, schedule=schedule)  # full budgets, threads set
        config = {"tasks": settings["tasks"], "factors": list(factors), "seeds": list(seeds), "schedule": schedule}
        config |= {"device": settings["device"], "torch_threads": settings["torch_threads"]}
        for task in chosen.values():
            for factor in factors:
                for seed in seeds:
                    decisions.append(decide_one(task, factor, seed, Path(tmp), settings["device"]))
    result = {"config": config, "machine": cpu_info().machine(), "wall_s": time.perf_counter() - started}
    result["decisions"] = decisions
    print_and_write(format_decisions(decisions), result, out)
    return result


_COLUMNS = (
    Column("task", 12, "task", align="<"),
    Column("user LR", 10, lambda r: lr_tasks.FACTORS.get(r["factor"], f"x{r['factor']:g}"), align="<"),
    Column("seed", 5, "seed"),
    Column("scale", 8, lambda r: f"x{r['scale']:g}" if r.get("scale") is not None else None),
    Column("steps", 7, "steps"),
    Column("s", 7, "probe_s", ".3f"),
    Column("  reason", 100, lambda r: f"  {r.get('reason') or ''}"[:100], align="<"),
)


def format_decisions(decisions: Sequence[Mapping[str, Any]], which: bool = False) -> str:
    """One line per cell: task, user LR, seed, the scale chosen, the search's steps and seconds, the reason.

    ``which``: a first column with each row's ``which`` (``before``/``after``, `compare`'s pairs).
    """
    columns = (Column("", 7, "which", align="<"), *_COLUMNS) if which else _COLUMNS
    return table(columns, decisions, rule=True)


def _key(record: Mapping[str, Any]) -> tuple[str, float, int]:
    return record["task"], float(record["factor"]), int(record["seed"])


COMPARED = ("schedule", "tasks", "device")
"""The config that must match for two results' cells to be the same cells (`compare` names any that differs)."""


def compare(before: Mapping[str, Any], after: Mapping[str, Any]) -> dict[str, Any]:
    """The cells of both results, those whose scale differs (both records each), those in one only, and what differs.

    ``config_differs`` names the `COMPARED` config entries and the machine's ISA where the two results differ: their
    cells are then not the same jobs (another schedule, budget or device), and a difference may be that.

    Example:
        >>> a = {"decisions": [{"task": "mlp", "factor": 0.1, "seed": 0, "scale": 10.0}]}
        >>> b = {"decisions": [{"task": "mlp", "factor": 0.1, "seed": 0, "scale": 1.0}]}
        >>> summary = compare(a, b)
        >>> summary["cells"], summary["same_scale"], summary["differ"][0]["after"]["scale"], summary["config_differs"]
        (1, 0, 1.0, [])
    """
    old = {_key(r): r for r in before["decisions"]}
    new = {_key(r): r for r in after["decisions"]}
    both = [key for key in old if key in new]
    differ = [{"before": old[key], "after": new[key]} for key in both if old[key].get("scale") != new[key].get("scale")]
    configs = before.get("config", {}), after.get("config", {})
    differs = [name for name in COMPARED if configs[0].get(name) != configs[1].get(name)]
    if before.get("machine", {}).get("isa") != after.get("machine", {}).get("isa"):
        differs.append("machine isa")
    return {
        "cells": len(both),
        "same_scale": len(both) - len(differ),
        "differ": differ,
        "before_only": sorted(list(key) for key in old.keys() - new.keys()),
        "after_only": sorted(list(key) for key in new.keys() - old.keys()),
        "config_differs": differs,
    }


def _compare_files(before: str, after: str) -> dict[str, Any]:
    """`compare` of two files, printed: what differs in their configs, the count, and each differing cell twice."""
    summary = compare(json.loads(Path(before).read_text()), json.loads(Path(after).read_text()))
    if summary["config_differs"]:
        print(f"warning: the two results differ in {', '.join(summary['config_differs'])}: not the same jobs")
    print(f"the same scale in {summary['same_scale']} of {summary['cells']} cells")
    if summary["differ"]:
        rows = [{**pair[which], "which": which} for pair in summary["differ"] for which in ("before", "after")]
        print(format_decisions(rows, which=True))
    for which in ("before_only", "after_only"):
        if summary[which]:
            print(f"in {which.removesuffix('_only')} only: {summary[which]}")
    return summary


QUICK = {"tasks": "mlp", "seeds": "0", "factors": "0.1,1"}
"""``--quick``: the MLP at 10x too low and at its right LR, seed 0 (a few seconds)."""


def _numbers(parser: argparse.ArgumentParser, option: str, text: str) -> list[float]:
    """The positive finite numbers of a comma-separated option, or a parser error naming it and the value."""
    try:
        values = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        values = []
    if not values or not all(math.isfinite(v) and v > 0 for v in values):
        parser.error(f"{option} must be positive multiples of the right LR, comma-separated, got {text!r}")
    return values


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--tasks", default=",".join(lr_tasks.TASKS), help=f"of {', '.join(lr_tasks.TASKS)}")
    parser.add_argument("--seeds", default=",".join(map(str, lr_tasks.SEEDS)), help="e.g. 0,1,2 or 0-4")
    parser.add_argument("--factors", default=",".join(map(str, lr_tasks.FACTORS)), help="user LRs, x the right one")
    parser.add_argument("--schedule", choices=lr_tasks.SCHEDULES, default="constant", help="the user's own schedule")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (1 on a busy shared machine)")
    parser.add_argument("--out", default=None, help="the JSON (default: a new temp dir)")
    parser.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"), help="two results: the cells that differ")
    parser.add_argument("--quick", action="store_true", help=f"a smoke run: {QUICK} (speedkit bench --quick)")
    args = parser.parse_args(argv)
    if args.compare:
        return _compare_files(*args.compare)
    if args.quick:
        given = [f"--{name}" for name in QUICK if getattr(args, name) != parser.get_default(name)]
        if given:
            parser.error(f"--quick sets {', '.join(QUICK)} itself; drop {', '.join(given)}")
        args.tasks, args.seeds, args.factors = QUICK["tasks"], QUICK["seeds"], QUICK["factors"]
    tasks = lr_tasks.task_names(parser, args.tasks)
    try:
        seeds = parse_seeds(args.seeds)
    except ValueError as exc:
        parser.error(f"--seeds: {exc}")
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads must be at least 1, got {args.threads}")
    factors = _numbers(parser, "--factors", args.factors)
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    out = args.out or Path(tempfile.mkdtemp(prefix="speedkit-lr-decisions-")) / "lr_decisions.json"
    return run(tasks, seeds, out, args.schedule, args.threads, factors)


if __name__ == "__main__":
    main()
