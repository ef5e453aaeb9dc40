"""benchmarks/precision_accuracy.py: the summary's epoch counts and ratios, and a quick run's JSON."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from conftest import load_benchmark


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    """The benchmark script, loaded by path."""
    return load_benchmark("precision_accuracy")


def _fit(epoch: int | None, seconds: float | None, step_ms: float) -> dict[str, Any]:
    return {"epoch_to_target": epoch, "time_to_target_s": seconds, "median_step_ms": step_ms}


def test_summary_counts_epochs_and_a_miss_is_more(bench: ModuleType) -> None:
    """Fewer, same, more epochs per seed (bf16 missing where fp32 reached is more; both missing is none of them)."""
    rows = [
        {"task": "conv", "32-true": _fit(2, 2.0, 10.0), "bf16-mixed": _fit(3, 2.7, 9.0)},  # more
        {"task": "conv", "32-true": _fit(3, 3.0, 10.0), "bf16-mixed": _fit(3, 2.7, 8.0)},  # same
        {"task": "conv", "32-true": _fit(3, 3.0, 10.0), "bf16-mixed": _fit(None, None, 9.0)},  # more: a miss
        {"task": "conv", "32-true": _fit(None, None, 10.0), "bf16-mixed": _fit(None, None, 9.0)},  # neither
        {"task": "mlp", "32-true": _fit(None, None, 1.0), "bf16-mixed": _fit(4, 3.0, 1.2)},  # fewer
    ]
    summary = bench.summary(rows)
    conv = summary["conv"]
    counts = conv["bf16_fewer_epochs"], conv["bf16_same_epochs"], conv["bf16_more_epochs"]
    assert (conv["seeds"], *counts) == (4, 0, 1, 2)
    assert conv["bf16_over_fp32_step"] == 0.9
    assert conv["bf16_over_fp32_time_to_target"] == pytest.approx(1.125)  # the median of 2.7/2.0 and 2.7/3.0
    assert summary["mlp"]["bf16_fewer_epochs"] == 1
    assert summary["mlp"]["bf16_over_fp32_time_to_target"] is None


@pytest.mark.slow
def test_quick_run_records_both_precisions(bench: ModuleType, tmp_path: Path) -> None:
    """Each row has an fp32 and a bf16 fit of the same task and seed, with their epochs' val_acc."""
    out = tmp_path / "precision_accuracy.json"
    result = bench.main(["--quick", "--out", str(out)])
    assert json.loads(out.read_text()) == result
    (row,) = result["rows"]
    assert row["task"] == "mlp"
    for precision in ("32-true", "bf16-mixed"):
        assert len(row[precision]["val_acc"]) == 2  # the quick budget's two epochs
        assert row[precision]["median_step_ms"] > 0
    assert set(result["summary"]) == {"mlp"}
