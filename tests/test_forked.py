"""Tests for `lightning_speedkit.forked`: rank zero's decisions and summary handed to the process that called fit."""

from __future__ import annotations

from pathlib import Path

from conftest import TinyClassifier, callback_of

import lightning_speedkit as speedkit
from lightning_speedkit.forked import adopt_results, rank_zero_results
from lightning_speedkit.loggers import RunSummary
from lightning_speedkit.preset import preset


def _trainer(root: Path, max_epochs: int) -> object:
    return preset(logger=False, verbose=False, default_root_dir=root, max_epochs=max_epochs, remember=False,
                  enable_checkpointing=False, enable_progress_bar=False)  # fmt: skip


def test_a_fresh_trainer_takes_the_decisions_as_made_and_a_later_fit_applies_them(tmp_path: Path) -> None:
    """The results of a fit, put into another Trainer's callbacks (the notebook's after a forked fit), read the same.

    Each lever keeps the decision's source (measured, skipped), not "resumed"; the run summary is rank zero's; a fit of
    that Trainer then applies the decisions without probing, as a second fit in one process does.
    """
    ran = _trainer(tmp_path / "ran", max_epochs=2)
    ran.fit(TinyClassifier(num_samples=4096, optimizer="adam"))  # long enough for levers to measure
    results = rank_zero_results(ran.callbacks)
    assert results["decisions"]
    assert results["summary"] == callback_of(ran, RunSummary).report()

    assert ran.speedkit.decisions()["FusedOptimizer"]["source"] == "measured"
    notebook = _trainer(tmp_path / "notebook", max_epochs=1)
    assert notebook.speedkit.decisions() == {}
    adopt_results(notebook.callbacks, results)
    assert notebook.speedkit.decisions() == ran.speedkit.decisions()
    assert callback_of(notebook, RunSummary).report() == results["summary"]

    tuner = callback_of(notebook, speedkit.FusedOptimizer)
    before = tuner.report()
    notebook.fit(TinyClassifier(num_samples=4096, optimizer="adam"))  # the same job (another one decides anew)
    assert tuner.report()["probe_s"] == before["probe_s"]  # applied, not measured again
    assert tuner.report()["source"] == before["source"]


def test_a_lever_of_another_state_key_takes_no_decision(tmp_path: Path) -> None:
    """A decision goes only to the lever of the same ``state_key`` (the same class and arguments)."""
    finder, other = speedkit.LRFinder(max_scale=10.0), speedkit.LRFinder(max_scale=100.0)
    adopt_results([finder], {"decisions": {other.state_key: {"decision": "x10", "reason": "raised"}}})
    assert finder.decision is None
    adopt_results([finder], {"decisions": {finder.state_key: {"decision": "x10", "reason": "raised"}}})
    assert (finder.decision.decision, finder.decision.source) == ("x10", "measured")
