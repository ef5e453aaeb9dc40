"""benchmarks/step_overhead.py: each variant is fitted in its own process at two lengths, and the JSON says so."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import load_benchmark


def test_quick_run_fits_both_variants_at_both_lengths(tmp_path: Path) -> None:
    """--quick runs short wall-clock fits (no valgrind): every variant, both lengths, a fit time each."""
    out = tmp_path / "step_overhead.json"
    load_benchmark("step_overhead").main(["--quick", "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["settings"] == {"quick": True, "valgrind": False, "steps": [8, 16]}
    assert [row["variant"] for row in result["rows"]] == ["plain", "preset"]
    for row in result["rows"]:
        assert set(row["runs"]) == {"8", "16"}
        assert all(run["fit_s"] > 0 and run["instructions"] is None for run in row["runs"].values())
