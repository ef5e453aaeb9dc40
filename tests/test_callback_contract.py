"""The callback contract: every callback's report is a plain dict; every lever decides, resumes, skips and coexists.

Every exported callback's ``report()`` is a plain dict before and after a real fit; every lever
(`lightning_speedkit.trials.Lever`) decides, resumes its decision unprobed, skips a probe that cannot pay back, and
coexists with a second instance in one checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from conftest import TinyClassifier, tiny_trainer
from lightning.pytorch.callbacks import ModelCheckpoint

import lightning_speedkit as speedkit
from lightning_speedkit.loggers import RunSummary
from lightning_speedkit.report import Reports
from lightning_speedkit.trials import Lever, TrialSession

EXPORTED_CALLBACKS = sorted(
    name
    for name in speedkit.__all__
    if isinstance(getattr(speedkit, name), type) and issubclass(getattr(speedkit, name), L.Callback)
)

# The smallest arguments with which each callback acts (or says why not) in a 3-epoch fit of TinyClassifier.
ARGS: dict[str, dict[str, Any]] = {
    "BatchSizeFinder": {"max_val": 16},
    "ChannelsLast": {},
    "Compile": {"backend": "eager"},
    "DataLoaderTuner": {"probe_steps": 2, "max_workers": 0},
    "FusedOptimizer": {},
    "Int8Export": {"calibration_batches": 1, "latency_repeats": 0},
    "LRFinder": {},
    "PrecisionTuner": {},
    "RunSummary": {},
    "StructuredPruning": {"amount": 0.5, "start_epoch": 1, "finetune_epochs": 1, "round_to": None,
                          "latency_batch_sizes": ()},
    "TrainingGuard": {"every_n_steps": 2, "window": 4},
    "UtilizationMonitor": {"window": 2, "summary": False},
    "WarmupScheduler": {"warmup": 2},
    "WeightAverage": {},
}  # fmt: skip


def test_the_table_covers_every_exported_callback() -> None:
    """Each Callback in ``speedkit.__all__`` has arguments here (a new one is checked, not silently skipped)."""
    assert EXPORTED_CALLBACKS
    assert sorted(ARGS) == EXPORTED_CALLBACKS


@pytest.mark.parametrize("name", EXPORTED_CALLBACKS)
def test_report_is_a_dict_before_and_after_a_real_fit(name: str, tmp_path: Path) -> None:
    """``report()`` is a method (the `Reports` protocol) returning a JSON-ready dict; `RunSummary` gathers it."""
    callback = getattr(speedkit, name)(**ARGS[name])
    assert isinstance(callback, Reports)
    assert isinstance(callback.report(), dict)
    summary = callback if isinstance(callback, RunSummary) else RunSummary()
    callbacks = [callback] if callback is summary else [callback, summary]
    L.seed_everything(0, verbose=False)
    trainer = tiny_trainer(tmp_path, max_epochs=3, limit_train_batches=4, limit_val_batches=2, callbacks=callbacks)
    trainer.fit(TinyClassifier())
    report = callback.report()
    assert isinstance(report, dict)
    assert json.loads(json.dumps(report, default=str)).keys() == {str(key) for key in report}
    written = json.loads((tmp_path / "speedkit_summary.json").read_text())
    if callback is summary:
        assert report == written == {}  # nothing else to gather
    else:
        assert report, f"{name}.report() is empty after a fit"
        assert summary.report()[name] == report
        assert written[name] == json.loads(json.dumps(report, default=str))


# ---------------------------------------------------------------------------------------------- the lever contract
LEVERS = [name for name in EXPORTED_CALLBACKS if issubclass(getattr(speedkit, name), Lever)]
DECISION_KEYS = {"decision", "reason", "probed", "probe_s", "source", "rejected"}

# A second instance of each lever, one argument changed: its state_key differs from the first one's.
OTHER: dict[str, dict[str, Any]] = {
    "BatchSizeFinder": {"max_val": 8},
    "ChannelsLast": {"margin": 0.2},
    "Compile": {"backend": "eager", "margin": 0.2},
    "DataLoaderTuner": {"probe_steps": 3, "max_workers": 0},
    "FusedOptimizer": {"margin": 0.2},
    "LRFinder": {"steps": 6},
    "PrecisionTuner": {"margin": 0.2},
}


def test_every_lever_is_in_the_contract_tables() -> None:
    """Each exported lever subclasses trials.Lever and has a second set of arguments here."""
    assert sorted(LEVERS) == sorted(OTHER)
    levers = {"ChannelsLast", "PrecisionTuner", "FusedOptimizer", "DataLoaderTuner", "BatchSizeFinder", "LRFinder"}
    assert levers | {"Compile"} == set(LEVERS)


@pytest.mark.parametrize("name", LEVERS)
def test_a_misspelt_argument_is_named_with_the_lever(name: str) -> None:
    """``BatchSizeFinder(max_vall=64)`` says which class refused it (it raised a bare "unexpected keyword argument")."""
    with pytest.raises(TypeError, match=f"^{name}: got an unexpected keyword argument 'misspelt'"):
        getattr(speedkit, name)(misspelt=1)


def _fit(tmp_path: Path, callbacks: list[L.Callback], ckpt_path: Path | None = None, **kwargs: Any) -> L.Trainer:
    L.seed_everything(0, verbose=False)
    saver = ModelCheckpoint(tmp_path / "ckpt", filename="last")
    options = {"max_epochs": 3, "limit_val_batches": 2, "enable_checkpointing": True, **kwargs}
    trainer = tiny_trainer(tmp_path, callbacks=[*callbacks, saver], **options)
    trainer.fit(TinyClassifier(), ckpt_path=ckpt_path)
    return trainer


@pytest.mark.parametrize("name", LEVERS)
def test_a_lever_decides_then_resumes_its_decision_without_probing(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fit leaves a Decision in report() and the checkpoint; a resumed fit applies it as "resumed", unprobed."""
    lever = getattr(speedkit, name)(**ARGS[name])
    _fit(tmp_path, [lever])
    report = lever.report()
    assert set(report) >= DECISION_KEYS, report
    assert report["source"] in ("measured", "skipped")
    assert report["reason"]
    saved = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)["callbacks"][lever.state_key]
    assert saved["decision"]["decision"] == report["decision"]
    monkeypatch.setattr(TrialSession, "__enter__", lambda self: pytest.fail(f"{name} probed on resume"))
    resumed = getattr(speedkit, name)(**ARGS[name])
    _fit(tmp_path, [resumed], ckpt_path=tmp_path / "ckpt" / "last.ckpt", max_epochs=4)
    again = resumed.report()
    assert again["source"] == "resumed"
    assert (again["decision"], again["reason"]) == (report["decision"], report["reason"])


@pytest.mark.parametrize("name", LEVERS)
def test_a_lever_skips_its_probe_on_a_job_too_short_and_says_why(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two steps cannot repay any probe: the decision is "skipped", nothing is timed, and the reason says why."""
    if name == "BatchSizeFinder":  # a search is no probe weighed against the run: it is skipped by a resume
        pytest.skip("the batch-size search runs whenever it is added; its skip is the resume rule (tested above)")
    monkeypatch.setattr(TrialSession, "__enter__", lambda self: pytest.fail(f"{name} probed a 2-step job"))
    lever = getattr(speedkit, name)(**ARGS[name])
    _fit(tmp_path, [lever], max_epochs=None, max_steps=2)
    report = lever.report()
    assert (report["source"], report["probed"], report["probe_s"]) == ("skipped", False, 0.0)
    assert report["reason"]


@pytest.mark.parametrize("name", LEVERS)
def test_two_instances_of_a_lever_coexist_in_one_checkpoint(name: str, tmp_path: Path) -> None:
    """Two instances with different arguments have their own state_key, both saved, each resumed into its twin."""
    first, second = getattr(speedkit, name)(**ARGS[name]), getattr(speedkit, name)(**OTHER[name])
    assert first.state_key != second.state_key
    _fit(tmp_path, [first, second])
    states = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)["callbacks"]
    assert {first.state_key, second.state_key} <= set(states)
    twins = getattr(speedkit, name)(**ARGS[name]), getattr(speedkit, name)(**OTHER[name])
    _fit(tmp_path, list(twins), ckpt_path=tmp_path / "ckpt" / "last.ckpt", max_epochs=4)
    for original, twin in zip((first, second), twins, strict=True):
        assert twin.report()["source"] == "resumed"
        assert twin.report()["decision"] == original.report()["decision"]
