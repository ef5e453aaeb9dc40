"""benchmarks/preset_defaults.py: the summary's counts and ratios, the frozen workload, a quick run's JSON."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from conftest import load_benchmark


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    """The benchmark script, loaded by path."""
    return load_benchmark("preset_defaults")


def _side(seconds: float | None, held: bool = False) -> dict[str, Any]:
    return {"time_to_target_s": seconds, "cooldown": {"held": held}}


def test_summary_counts_cells_where_the_trial_side_is_later_or_earlier(bench: ModuleType) -> None:
    """Later: a miss where the other side reached, or more than 10% slower; earlier, the same the other way."""
    cool = [
        {"task": "mlp", "trial": _side(1.0, held=True), "no check": _side(None)},  # earlier: the other side missed
        {"task": "mlp", "trial": _side(1.05), "no check": _side(1.0)},  # within 10%: neither
        {"task": "mlp", "trial": _side(1.2), "no check": _side(1.0)},  # later
        {"task": "conv", "trial": _side(None), "no check": _side(None)},  # both missed: neither
    ]
    guard = [
        {"workload": "frozen", "round": r, "variant": v, "fit_s": s, "median_step_ms": 1.0}
        for r, times in enumerate([(1.0, 2.0, 0.9), (2.0, 3.0, 1.8)])
        for v, s in zip(("measured", "every 50", "no guard"), times, strict=True)
    ]
    summary = bench.summary(cool, guard)
    assert summary["cooldown"]["mlp"] == {"cells": 3, "trial_later": 1, "trial_earlier": 1, "held": 1}
    assert summary["cooldown"]["conv"] == {"cells": 1, "trial_later": 0, "trial_earlier": 0, "held": 0}
    ratios = summary["guard"]["frozen"]
    assert ratios["every 50_over_measured"] == {"fit_s": 1.75, "median_step_ms": 1.0}  # the median of 2.0 and 1.5
    assert ratios["no guard_over_measured"]["fit_s"] == pytest.approx(0.9)


def test_the_frozen_workloads_labels_follow_its_table(bench: ModuleType) -> None:
    """The labels are a function of the frozen table's rows, so the trained head can learn them."""
    data = bench.frozen_data(64, seed=0)
    ids, labels = data.tensors
    assert ids.shape == (64, 8)
    model = bench.FrozenTable()
    assert not model.table.weight.requires_grad
    assert torch.equal(model.table.weight, bench.frozen_table())
    projection = torch.randn(bench.DIM, 4, generator=torch.Generator().manual_seed(1))
    assert torch.equal(labels, (model.table(ids).mean(1) @ projection).argmax(1))
    assert model(ids).shape == (64, 4)


@pytest.mark.slow
def test_quick_run_records_both_comparisons(bench: ModuleType, tmp_path: Path) -> None:
    """Each cool-down cell has both sides' records; each guard fit its interval (none without the guard)."""
    out = tmp_path / "preset_defaults.json"
    result = bench.main(["--quick", "--out", str(out)])
    assert json.loads(out.read_text()) == result
    assert [row["task"] for row in result["cooldown"]] == ["mlp", "conv"]
    for row in result["cooldown"]:
        assert row["trial"]["cooldown"]["method"] == "trial"
        assert row["no check"]["cooldown"]["enabled"] is False
        assert row["trial"]["steps"] == row["no check"]["steps"]
    variants = {(g["workload"], g["variant"]): g for g in result["guard"]}
    assert set(variants) == {(w, v) for w in ("mlp", "frozen") for v in ("measured", "every 50", "no guard")}
    assert variants[("frozen", "every 50")]["guard"]["every_n_steps"] == 50
    assert variants[("frozen", "no guard")]["guard"] is None
    assert variants[("frozen", "measured")]["guard"]["snapshot_bytes"] > 100 * 2**20
