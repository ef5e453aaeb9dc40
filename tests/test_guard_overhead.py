"""benchmarks/guard_overhead.py: each size's rows, with their read interval, timed against the fit without a guard."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import load_benchmark


def test_quick_run_times_every_row_of_every_size(tmp_path: Path) -> None:
    """--quick fits each size without the guard, reading every step and reading 16 at a time; ratios to no guard."""
    out = tmp_path / "guard_overhead.json"
    load_benchmark("guard_overhead").main(["--quick", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [(row["size"], row["row"]) for row in rows] == [
        (size, row) for size in ("small", "larger") for row in ("none", "every step", "every 16")
    ]
    assert [row["check_every_n_steps"] for row in rows] == [None, 1, 16] * 2
    assert all(row["step_ms"] > 0 and len(row["rounds_ms"]) == 2 for row in rows)
    assert [row["vs_none"] for row in rows if row["row"] == "none"] == [1.0, 1.0]
