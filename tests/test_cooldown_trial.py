"""benchmarks/cooldown_trial.py: the policies' summary and a quick run's JSON."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest
from conftest import load_benchmark


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    """The benchmark script, loaded by path."""
    return load_benchmark("cooldown_trial")


def test_summary_counts_each_policys_agreement_and_the_accuracy_its_verdicts_lose(bench: ModuleType) -> None:
    """A verdict agrees when it picks the better continuation; what it loses is the gap to that one."""

    def row(verdict: str, check: bool, held: float, cooled: float) -> dict[str, object]:
        outcome = {"held_val_acc": held, "cooled_val_acc": cooled}
        return {"trial": {"verdict": verdict}, "loss_check_holds": check, "outcome": outcome}

    rows = [row("hold", True, 0.9, 0.8), row("cool down", True, 0.7, 0.9)]
    policies = bench.summarise(rows)["policies"]
    assert policies["trial"] == {"agrees": 2, "lost_max": 0.0, "lost_mean": 0.0}
    assert policies["loss check"] == {"agrees": 1, "lost_max": 0.2, "lost_mean": 0.1}
    assert policies["always cool"] == {"agrees": 1, "lost_max": 0.1, "lost_mean": 0.05}
    assert policies["always hold"] == policies["loss check"]


def test_quick_run_records_the_trial_the_loss_check_and_both_continuations(bench: ModuleType, tmp_path: Path) -> None:
    """Each case has the trial's verdict, the loss check's, and the held and cooled continuations' val_acc."""
    out = tmp_path / "cooldown_trial.json"
    result = bench.main(["--quick", "--out", str(out)])
    assert json.loads(out.read_text()) == result
    assert result["settings"]["cooled"] == pytest.approx(1 / 3)
    (row,) = result["rows"]
    assert row["task"] == "mlp"
    assert row["cooldown_start"] == round(0.8 * row["steps"])
    assert row["trial"]["verdict"] in ("hold", "cool down")
    assert row["trial"]["verdict"] == ("hold" if row["trial"]["z"] < -result["settings"]["z"] else "cool down")
    assert 0.0 <= row["outcome"]["held_val_acc"] <= 1.0
    assert 0.0 <= row["outcome"]["cooled_val_acc"] <= 1.0
    assert row["outcome"]["cooldown_helped"] == (row["outcome"]["cooled_val_acc"] > row["outcome"]["held_val_acc"])
    summary = result["summary"]
    assert summary["cases"] == 1
    assert set(summary["policies"]) == {"trial", "loss check", "always cool", "always hold"}
    for figures in summary["policies"].values():
        assert 0 <= figures["agrees"] <= 1
        assert figures["lost_max"] >= figures["lost_mean"] >= 0.0
