"""The report contract: every exported callback's ``report()`` returns a plain dict, before and after a real fit."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning as L
import pytest
from conftest import TinyClassifier, tiny_trainer

import lightning_speedkit as speedkit
from lightning_speedkit.loggers import RunSummary
from lightning_speedkit.report import Reports

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
    "Int8Export": {"calibration_batches": 1, "latency_repeats": 0},
    "LRFinder": {},
    "PrecisionTuner": {},
    "RunSummary": {},
    "StructuredPruning": {"amount": 0.5, "start_epoch": 1, "finetune_epochs": 1, "round_to": None,
                          "latency_batch_sizes": ()},
    "TrainingGuard": {"every_n_steps": 2, "window": 4},
    "UtilizationMonitor": {"window": 2, "summary": False},
    "WarmupScheduler": {"warmup": 2},
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
