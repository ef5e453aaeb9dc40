"""What TrainingGuard costs a step: the same fit without it, reading each loss, and reading them 16 at a time.

Reading a loss on a GPU (``float(loss)``) waits for the step to finish, so the host cannot queue the next step's
kernels meanwhile; on a small model whose steps are short, that wait could be a share of every step. The guard reads
its losses every ``check_every_n_steps`` steps (1 by default).

Each size (a small and a larger demo model) is fitted on batches resident on the device (`_gpu_resident`): no
loader, no decoding, the timed steps between two synchronisations after the warm-up. Rows, in an order that rotates
from round to round: ``none`` (no guard), ``every step`` (``check_every_n_steps=1``, the default) and ``every 16``
(``check_every_n_steps=16``). Each row's figure is the median step over the rounds, and ``vs none`` its
ratio to the fit without the guard. The guard's snapshots (at its chosen interval) are in every guarded row.

    python benchmarks/guard_overhead.py --out guard_overhead.json      # on a GPU: about a minute
    python benchmarks/guard_overhead.py --quick                        # tiny, on any device (the tests run it)
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__":  # a lent machine has the checkout, not an installed package
    sys.path.insert(1, str(Path(__file__).resolve().parents[1]))
if str(Path(__file__).resolve().parent) not in sys.path:  # _harness, also when a test loads this file by path
    sys.path.append(str(Path(__file__).resolve().parent))

import statistics
import tempfile
from typing import Any

import torch
from _gpu_device import describe
from _gpu_resident import resident_fit
from _harness import Column, print_and_write, quick_args, rotated, table

from lightning_speedkit import TrainingGuard

DEFAULT_OUT = Path(__file__).parent / "results" / "guard_overhead.json"
ROWS = ("none", "every step", "every 16")
SIZES = {"small": {"width": 16, "batch": 64}, "larger": {"width": 64, "batch": 256}}


def guard_of(row: str) -> list[TrainingGuard]:
    """The callbacks of a row: no guard, or the guard reading its losses every step or 16 at a time."""
    if row == "none":
        return []
    return [TrainingGuard(check_every_n_steps=1 if row == "every step" else 16)]


def run(quick: bool, out: Path) -> dict[str, Any]:
    """Every size's rows over the rounds; print the table, write the JSON."""
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    rounds, warmup, steps, crop = (2, 3, 12, 24) if quick else (3, 30, 300, 56)
    precision = "16-mixed" if device.type == "cuda" else "32-true"
    result: dict[str, Any] = {"device": describe(device), "precision": precision, "rounds": rounds}
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for size, shape in SIZES.items():
            batch = 8 if quick else shape["batch"]
            s = {"width": 8 if quick else shape["width"], "warmup": warmup, "steps": steps}
            gen = torch.Generator().manual_seed(0)
            train = [
                (torch.randn(batch, 3, crop, crop, generator=gen).to(device), torch.randint(0, 10, (batch,)).to(device))
                for _ in range(8)
            ]
            times: dict[str, list[float]] = {row: [] for row in ROWS}
            checks: dict[str, int] = {}
            for index in range(rounds):
                for row in rotated(ROWS, index):
                    callbacks = guard_of(row)
                    figures, _ = resident_fit(s, device, Path(tmp), crop, train, precision, callbacks)
                    times[row].append(figures["step_ms"])
                    if callbacks:
                        checks[row] = callbacks[0].report()["check_every_n_steps"]
            none = statistics.median(times["none"])
            for row in ROWS:
                median = statistics.median(times[row])
                record = {"size": size, "row": row, "width": s["width"], "batch": batch, "step_ms": median}
                record |= {"vs_none": median / none, "check_every_n_steps": checks.get(row), "rounds_ms": times[row]}
                rows.append(record)
    result["rows"] = rows
    columns = [
        Column("size", 8, "size", align="<"),
        Column("row", 12, "row", align="<"),
        Column("batch", 7, "batch", "d"),
        Column("step ms", 10, "step_ms", ".3f"),
        Column("vs none", 9, "vs_none", ".3f"),
        Column("reads every", 13, "check_every_n_steps", "d"),
    ]
    name = result["device"].get("name", "CPU")
    text = f"TrainingGuard's cost on {name} ({precision}, median of {rounds} rounds)\n" + table(columns, rows)
    print_and_write(text, result, out)
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    quick, out, threads = quick_args(argv, __doc__, DEFAULT_OUT, "a tiny run on any device")
    torch.set_num_threads(threads)
    return run(quick, out)


if __name__ == "__main__":
    main(sys.argv[1:])
