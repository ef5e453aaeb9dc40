"""The cells `lr_tasks` found late beyond its noise, over many rounding-level starts: a draw, or the variant's own?

`lr_tasks.py` judges a cell by one start, the seed's initial weights; its noise is the naive fit from those weights
nudged by 1, 2 and 3 float ulps (`lr_tasks.nudge_weights`). Near a run's edge of stability a rounding-level
difference moves the epoch at which a target is first crossed, and ``preset()`` differs from the plain loop by
rounding too (a fused optimizer's update, bf16's counted steps). So one start is one draw of each variant's time to
target, and a variant can land on a slow draw where the naive fits did not. Here each cell runs ``--starts N``
starts, the seed's weights nudged by 0, 1, ..., N-1 ulps (0: the benchmark's own start), every start fitted naive,
``preset()`` and ``preset(lr="auto")`` back to back in rotated order, every fit of the whole budget, its time from
the start of ``trainer.fit`` (every probe included) to the first validation epoch at or above the cell's target (the
`lr_tasks` result's). Per variant: its times over the starts, how many reached the target, at which epochs, and the
median (a miss is infinitely late). A variant whose median is more than `lr_tasks.NOISE` over naive's
(``later_as_a_distribution``) is later than naive over the starts: by its own cost (a probe's price) or its own
trajectory, not by a draw.

``--without fused_optimizer,...`` also fits ``preset()`` with each of those levers off (``preset_without_<lever>``),
one at a time: whether a lever's own rounding (the fused update's, bf16's counted steps) is what moves a trajectory.

The cells: ``--cells task:factor:seed,...`` of the ``--from`` result, or by default those it counts as later than every
naive fit in every re-run (its cells' ``*_later_repeated`` and ``*_later_than_every``). Read the result with the
``--from`` file's machine and ISA: run it on the same machine, forced to the same ISA (``ATEN_CPU_CAPABILITY=avx2
ONEDNN_MAX_CPU_ISA=AVX2`` for an ``avx2_forced`` result).

    python benchmarks/lr_starts.py --from benchmarks/results/xeon_amx/lr_tasks_cosine.json --threads 1 --out F
    python benchmarks/lr_starts.py --from FILE --cells transformer:10:1,mlp:1:0 --starts 8
    python benchmarks/lr_starts.py --from FILE --without fused_optimizer,tune_precision
    python benchmarks/lr_starts.py --quick   # a smoke run: lr_tasks --quick on the MLP, then two starts of one cell
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

if str(Path(__file__).resolve().parent) not in sys.path:  # _harness, also when a test loads this file by path
    sys.path.append(str(Path(__file__).resolve().parent))

import lr_tasks
from _harness import Column, print_and_write, rotated, table, torch_threads

from lightning_speedkit.hardware import cpu_info

VARIANTS = ("naive", "preset", "preset_auto")
"""The fits of every start: the plain loop, ``preset()`` and ``preset(lr="auto")``."""
STARTS = 8
"""Starts per cell by default: the seed's weights and seven rounding-level neighbours."""
LATE = {"preset": "preset_later", "preset_auto": "auto_later"}
"""Each variant `lr_tasks` can find late, by the key of that lateness in its cells."""
LEVERS = ("channels_last", "tune_precision", "fused_optimizer", "tune_data", "warmup", "guard", "monitor")
"""``preset()``'s levers that ``--without`` can switch off (its on-by-default boolean arguments)."""


def flagged(cell: Mapping[str, Any]) -> list[str]:
    """The variants `lr_tasks` counts as late beyond its noise in ``cell``.

    Late again in every re-run (``_repeated``), and later than every naive fit (``_than_every``).

    Example:
        >>> flagged({"preset_later_repeated": True, "preset_later_than_every": True, "auto_later_repeated": True})
        ['preset']
    """
    return [v for v, key in LATE.items() if cell.get(f"{key}_repeated") and cell.get(f"{key}_than_every")]


def parse_cells(text: str) -> list[tuple[str, float, int]]:
    """``task:factor:seed`` items, comma-separated; a ``ValueError`` naming ``--cells`` and the item otherwise.

    Example:
        >>> parse_cells("transformer:10:1, mlp:1:0")
        [('transformer', 10.0, 1), ('mlp', 1.0, 0)]
    """
    cells = []
    for item in (part.strip() for part in text.split(",") if part.strip()):
        parts = item.split(":")
        try:
            if len(parts) != 3:
                raise ValueError
            cells.append((parts[0], float(parts[1]), int(parts[2])))
        except ValueError:
            raise ValueError(f"--cells takes task:factor:seed items (transformer:10:1), got {item!r}") from None
    return cells


def select(result: Mapping[str, Any], wanted: Sequence[tuple[str, float, int]] = ()) -> list[dict[str, Any]]:
    """The cells to run: ``wanted`` (task, factor, seed) of ``result``, or every cell with a `flagged` variant.

    Each is the result's cell with its ``task`` and ``target``. Raises ``ValueError`` naming a wanted cell the result
    does not hold.
    """
    cells = [
        {**cell, "task": name, "target": summary["target"]}
        for name, summary in result["tasks"].items()
        for cell in summary["cells"]
    ]
    if not wanted:
        return [cell for cell in cells if flagged(cell)]
    chosen = []
    for task, factor, seed in wanted:
        found = [c for c in cells if (c["task"], c["factor"], c["seed"]) == (task, factor, seed)]
        if not found:
            raise ValueError(f"--cells: {task}:{factor:g}:{seed} is not a cell of the --from result")
        chosen.append(found[0])
    return chosen


def judge(
    times: Mapping[str, Sequence[float | None]],
    epochs: Mapping[str, Sequence[int | None]] | None = None,
    noise: float = lr_tasks.NOISE,
) -> dict[str, Any]:
    """Per variant, its times to target over the starts judged against naive's.

    ``reached``, ``median_s`` (a miss is ``inf``), ``min_s``, ``max_s``; for each variant but naive
    ``later_as_a_distribution`` (median more than ``noise`` over naive's; never when naive's median is a miss, as in
    `lr_tasks.later`) and ``over_naive`` (the ratio). With ``epochs``, start by start against naive's: ``later_epochs``
    and ``earlier_epochs`` (the starts that reached the target at a later or an earlier epoch, a miss the latest: the
    trajectory's part) and ``same_epoch_over_naive`` (the median ratio of the times at the starts that reached it at
    naive's epoch: the fixed price's part; None when there are none).

    Example:
        >>> times = {"naive": [1.0, 2.0, 1.5], "preset": [1.1, None, 1.2]}
        >>> out = judge(times, {"naive": [1, 2, 1], "preset": [1, None, 1]})["preset"]
        >>> out["reached"], out["median_s"], out["later_as_a_distribution"]
        (2, 1.2, False)
        >>> out["later_epochs"], out["earlier_epochs"], round(out["same_epoch_over_naive"], 2)
        (1, 0, 0.95)
        >>> judge({"naive": [1.0, 1.0], "preset": [None, None]})["preset"]["median_s"]
        inf
    """
    out: dict[str, Any] = {}
    for variant, values in times.items():
        finite = [v for v in values if v is not None]
        median = statistics.median([math.inf if v is None else v for v in values])
        out[variant] = {"reached": len(finite), "median_s": median}
        out[variant] |= {"min_s": min(finite, default=None), "max_s": max(finite, default=None)}
    naive = out["naive"]["median_s"]
    for variant in (v for v in out if v != "naive"):
        ratio = out[variant]["median_s"] / naive if math.isfinite(naive) else None
        out[variant]["over_naive"] = ratio
        out[variant]["later_as_a_distribution"] = lr_tasks.later(
            naive if math.isfinite(naive) else None, _none_if_inf(out[variant]["median_s"]), noise
        )
        if epochs is not None:
            out[variant] |= _by_start(times["naive"], times[variant], epochs["naive"], epochs[variant])
    return out


def _by_start(
    naive_s: Sequence[float | None],
    mine_s: Sequence[float | None],
    naive_e: Sequence[int | None],
    mine_e: Sequence[int | None],
) -> dict[str, Any]:
    """`judge`'s start-by-start comparison of one variant's epochs and times with naive's."""
    rank = [math.inf if e is None else e for e in naive_e], [math.inf if e is None else e for e in mine_e]
    pairs = list(zip(*rank, strict=True))
    same = [m / n for n, m, (a, b) in zip(naive_s, mine_s, pairs, strict=True) if n and m and a == b]
    return {
        "later_epochs": sum(b > a for a, b in pairs),
        "earlier_epochs": sum(b < a for a, b in pairs),
        "same_epoch_over_naive": statistics.median(same) if same else None,
    }


def _none_if_inf(value: float) -> float | None:
    return None if math.isinf(value) else value


def _json_safe(verdict: dict[str, Any]) -> dict[str, Any]:
    """``verdict`` with an infinite median (a miss) as the string ``"inf"``: JSON has no infinity."""
    return {
        v: {k: "inf" if isinstance(x, float) and math.isinf(x) else x for k, x in d.items()} for v, d in verdict.items()
    }


def _seconds(value: float | str | None) -> float | None:
    """A median from the JSON (`_json_safe`) for the table: None for a miss."""
    return None if value is None or value == "inf" else float(value)


def run_cell(
    task: lr_tasks.Task,
    cell: Mapping[str, Any],
    starts: int,
    root: Path,
    device: str,
    variants: Sequence[str] = VARIANTS,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Fit ``cell`` from ``starts`` rounding-level starts, each of ``variants``; the cell's record and the runs."""
    factor, seed, target = cell["factor"], cell["seed"], cell["target"]
    lr_tasks._prepare(task, seed, root)
    times: dict[str, list[float | None]] = {v: [] for v in variants}
    epochs: dict[str, list[int | None]] = {v: [] for v in variants}
    runs: list[dict[str, Any]] = []
    for ulps in range(starts):
        for variant in rotated(variants, ulps):
            run = lr_tasks.fit_one(task, variant, factor, seed, root, device, show=False, start_ulps=ulps)
            run |= {"time_to_target_s": lr_tasks.time_to_target(run["timeline"], target), "start_ulps": ulps}
            run["epoch_to_target"] = lr_tasks.epoch_to_target(run["timeline"], target)
            times[variant].append(run["time_to_target_s"])
            epochs[variant].append(run["epoch_to_target"])
            runs.append(run)
    first = {v: cell.get(f"{v}_s") for v in variants}
    record = {"task": task.name, "label": cell["label"], "factor": factor, "seed": seed, "target": target}
    record |= {"flagged": flagged(cell), "first_run_s": first, "times_s": times, "epochs": epochs}
    record["verdict"] = _json_safe(judge(times, epochs))
    return record, runs


def format_table(cells: Sequence[Mapping[str, Any]], starts: int) -> str:
    """One line per cell and variant: the first run's time, the starts reached, median, range, epochs, verdict."""
    rows = []
    for cell in cells:
        for variant in cell["verdict"]:
            verdict = cell["verdict"][variant]
            epochs = " ".join("-" if e is None else str(e) for e in cell["epochs"][variant])
            late = verdict.get("later_as_a_distribution")
            rows.append(
                {
                    "cell": f"{cell['task']} {cell['label']} s{cell['seed']}",
                    "variant": variant,
                    "first": cell["first_run_s"][variant],
                    "reached": f"{verdict['reached']}/{starts}",
                    "median": _seconds(verdict["median_s"]),
                    "moved": "" if variant == "naive" else f"{verdict['later_epochs']}/{verdict['earlier_epochs']}",
                    "price": verdict.get("same_epoch_over_naive"),
                    "min": verdict["min_s"],
                    "max": verdict["max_s"],
                    "epochs": epochs,
                    "later": "" if late is None else ("LATER" if late else "no"),
                }
            )
    columns = [
        Column("cell", 24, "cell", align="<"),
        Column("variant", 32, "variant", align="<"),
        Column("first", 7, "first", ".2f"),
        Column("reached", 8, "reached"),
        Column("median", 7, "median", ".2f"),
        Column("min", 6, "min", ".2f"),
        Column("max", 6, "max", ".2f"),
        Column("  epochs to target", 20, "epochs", align="<"),
        Column("later/earlier", 13, "moved"),
        Column("same-epoch", 11, "price", ".3f", suffix="x"),
        Column("later", 6, "later"),
    ]
    legend = (
        f"seconds to target over {starts} starts (ulps 0..{starts - 1}); first: the lr_tasks run's own; a miss is"
        " infinitely late; epochs: each start's (- a miss); later/earlier: the starts reaching it at a later or earlier"
        " epoch than naive; same-epoch: the median time ratio at the starts reaching it at naive's epoch; later: the"
        f" median over naive's by more than {lr_tasks.NOISE:.0%}"
    )
    return legend + "\n" + table(columns, rows, sep=" ", rule=True)


def run(
    source: str | Path,
    out: str | Path,
    wanted: Sequence[tuple[str, float, int]] = (),
    starts: int = STARTS,
    threads: int | None = None,
    without: Sequence[str] = (),
) -> dict[str, Any]:
    """The cells of the `lr_tasks` result at ``source`` (`select`) from ``starts`` starts; the result, to ``out``.

    ``without``: ``preset()`` arguments (levers) to also fit ``preset(<argument>=False)`` for, one at a time.
    """
    result: dict[str, Any] = json.loads(Path(source).read_text())
    cells = select(result, wanted)
    threads = threads or result["config"].get("torch_threads")
    variants = [*VARIANTS, *(lr_tasks.WITHOUT + name for name in without)]
    config = {"from": str(source), "starts": starts, "variants": variants, "noise_allowance": lr_tasks.NOISE}
    config |= {"schedule": result["config"].get("schedule", "constant"), "device": result["config"]["device"]}
    machine = cpu_info().machine()
    here, there = ((m.get("isa"), m.get("isa_limit") or "") for m in (machine, result["machine"]))
    if here != there:
        print(f"warning: this run's ISA {here} is not the --from run's {there}: other fits than its", file=sys.stderr)
    load_before, started = os.getloadavg(), time.perf_counter()
    records: list[dict[str, Any]] = []
    runs: list[dict[str, Any]] = []
    with (
        tempfile.TemporaryDirectory(prefix="speedkit-lr-starts-", ignore_cleanup_errors=True) as tmp,
        torch_threads(threads),
    ):
        root, warmed = Path(tmp), set()
        config["torch_threads"] = threads
        for cell in cells:
            task = dataclasses.replace(lr_tasks.TASKS[cell["task"]], **result["config"]["tasks"][cell["task"]])
            if task.name not in warmed:
                lr_tasks._warm(task, root, config["device"])
                warmed.add(task.name)
            record, cell_runs = run_cell(task, cell, starts, root, config["device"], variants)
            records.append(record)
            runs += cell_runs
    summary = {
        "cells": len(records),
        "later_as_a_distribution": {
            v: sum(bool(c["verdict"][v]["later_as_a_distribution"]) for c in records) for v in variants[1:]
        },
    }
    out_result: dict[str, Any] = {
        "config": config,
        "machine": machine,
        "source_machine": result["machine"],
    }
    out_result["load_average"] = {"before": list(load_before), "after": list(os.getloadavg())}
    out_result |= {"wall_s": time.perf_counter() - started, "cells": records, "summary": summary, "runs": runs}
    text = format_table(records, starts) + f"\nlater as a distribution: {summary['later_as_a_distribution']}"
    print_and_write(text, out_result, out)
    return out_result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--from", dest="source", default=None, help="an lr_tasks result JSON (its cells and targets)")
    parser.add_argument("--cells", default="", help="task:factor:seed,... (default: those late beyond its noise)")
    parser.add_argument("--starts", type=int, default=STARTS, help=f"starts per cell (default {STARTS})")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: the --from run's)")
    parser.add_argument("--out", default=None, help="the JSON (default: a new temp dir)")
    parser.add_argument(
        "--without", default="", help="preset() levers to switch off, one variant each (e.g. fused_optimizer)"
    )
    parser.add_argument("--quick", action="store_true", help="a smoke run: lr_tasks --quick (MLP), two starts")
    args = parser.parse_args(argv)
    if args.starts < 1:
        parser.error(f"--starts must be at least 1, got {args.starts}")
    try:
        wanted = list(dict.fromkeys(parse_cells(args.cells)))
    except ValueError as exc:
        parser.error(str(exc))
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads must be at least 1, got {args.threads}")
    without = list(dict.fromkeys(name.strip() for name in args.without.split(",") if name.strip()))
    unknown = [name for name in without if name not in LEVERS]
    if unknown:
        parser.error(f"--without takes preset() levers ({', '.join(LEVERS)}), got {', '.join(unknown)}")
    if args.quick and (args.source or args.cells):
        parser.error("--quick runs lr_tasks --quick itself and one of its cells; drop --from and --cells")
    if not args.quick and not args.source:
        parser.error("--from is required (an lr_tasks result), or pass --quick")
    if args.source:
        try:
            select(json.loads(Path(args.source).read_text()), wanted)
        except ValueError as exc:
            parser.error(str(exc))
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="speedkit-lr-starts-")) / "lr_starts.json"
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    if args.quick:  # `speedkit bench --quick`: lr_tasks' quick MLP (no result of its own), its right-LR cell
        source = out.with_name(out.stem + "_source.json")
        lr_tasks.run(quick=True, tasks=["mlp"], out=source, threads=args.threads or 1)
        return run(source, out, [("mlp", 1.0, 0)], starts=2, threads=args.threads or 1, without=without)
    return run(args.source, out, wanted, args.starts, args.threads, without)


if __name__ == "__main__":
    main()
