"""RunSummary: every callback's report in ``speedkit_summary.json`` and the W&B run summary; bad reports skipped."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning as L
import pytest
from conftest import TinyClassifier, tiny_trainer

from lightning_speedkit.loggers import RunSummary


class Decides(L.Callback):
    """A callback with a proper report."""

    def report(self) -> dict[str, Any]:
        """What it decided."""
        return {"decision": "kept", "steps": 3}


class SaysText(L.Callback):
    """A callback whose ``report()`` returns a string, not a dict."""

    def report(self) -> str:
        """Not a dict."""
        return "kept"


class ReportAttribute(L.Callback):
    """A callback whose ``report`` is a property (Int8Export's old form), not a method."""

    @property
    def report(self) -> dict[str, Any]:
        """A dict, but not through a call."""
        return {"decision": "kept"}


class ReportsNothing(L.Callback):
    """A callback whose report is empty."""

    def report(self) -> dict[str, Any]:
        """Nothing to say."""
        return {}


def test_run_summary_gathers_dict_reports_and_skips_the_others_with_a_warning(tmp_path: Path) -> None:
    """Dict reports land in the JSON; a non-dict ``report()`` and a ``report`` property are left out, each named."""
    summary = RunSummary()
    callbacks = [Decides(), SaysText(), ReportAttribute(), ReportsNothing(), Decides(), summary]
    with pytest.warns(UserWarning, match="^RunSummary: ") as caught:
        tiny_trainer(tmp_path, max_epochs=1, limit_train_batches=2, callbacks=callbacks).fit(TinyClassifier())
    messages = [str(w.message) for w in caught if str(w.message).startswith("RunSummary:")]
    assert messages == [
        "RunSummary: SaysText.report() must return a dict, got str 'kept'; left out of the summary.",
        "RunSummary: ReportAttribute.report must be a method returning a dict, got a dict; left out of the summary.",
    ]
    expected = {"Decides": {"decision": "kept", "steps": 3}, "Decides#2": {"decision": "kept", "steps": 3}}
    assert json.loads((tmp_path / "speedkit_summary.json").read_text()) == expected
    assert summary.report() == expected


def test_run_summary_leaves_other_run_summaries_out(tmp_path: Path) -> None:
    """A second RunSummary's report (a summary itself) is not nested into the first's."""
    first, second = RunSummary(), RunSummary()
    tiny_trainer(tmp_path, max_epochs=1, limit_train_batches=2, callbacks=[Decides(), first, second]).fit(
        TinyClassifier()
    )
    assert first.report() == second.report() == {"Decides": {"decision": "kept", "steps": 3}}


def test_a_fast_dev_run_writes_no_summary_over_the_real_runs(tmp_path: Path) -> None:
    """``fast_dev_run`` writes nothing, as Lightning's loggers and checkpoints: the real run's summary file stays.

    It overwrote the real run's ``speedkit_summary.json`` with its one batch's reports; `report` still has them.
    """
    tiny_trainer(tmp_path, max_epochs=1, callbacks=[Decides(), RunSummary()]).fit(TinyClassifier())
    written = (tmp_path / "speedkit_summary.json").read_text()
    (tmp_path / "speedkit_summary.json").write_text(written.replace('"kept"', '"the real run\'s"'))
    dry = RunSummary()
    tiny_trainer(tmp_path, fast_dev_run=True, callbacks=[Decides(), dry]).fit(TinyClassifier())
    assert "the real run's" in (tmp_path / "speedkit_summary.json").read_text()
    assert dry.report() == {"Decides": {"decision": "kept", "steps": 3}}


def test_preset_takes_a_list_of_loggers_as_the_trainer_does(tmp_path: Path) -> None:
    """``preset(logger=[a, b])`` is used as it is (it was refused, where ``Trainer(logger=[...])`` takes it)."""
    from lightning.pytorch.loggers import CSVLogger

    from lightning_speedkit import preset

    loggers = [CSVLogger(tmp_path, name="a"), CSVLogger(tmp_path, name="b")]
    trainer = preset(logger=loggers, verbose=False, default_root_dir=tmp_path)
    assert trainer.loggers == loggers
    assert trainer.speedkit["logger"] == "CSVLogger, CSVLogger"
    with pytest.raises(ValueError, match="a Logger or a list of them, got \\[1\\]"):
        preset(logger=[1], verbose=False)


_PRESET_EXPORT_RUN = """
import json, sys
sys.path.insert(0, {tests!r})
from conftest import TinyClassifier
from lightning.pytorch.loggers import WandbLogger
from lightning_speedkit import preset
logger = WandbLogger(save_dir={root!r}, offline=True, project="speedkit")
export = {{"dirpath": {int8!r}, "calibration_batches": 1, "latency_repeats": 0}}
trainer = preset(logger=logger, export=export, default_root_dir={root!r}, max_epochs=1, enable_progress_bar=False)
trainer.fit(TinyClassifier())
print("WANDB_SUMMARY " + json.dumps(dict(logger.experiment.summary), default=str))
"""


@pytest.mark.slow
def test_preset_export_report_reaches_the_summary_json_and_the_offline_wandb_summary(tmp_path: Path) -> None:
    """After ``preset(export=...)`` the Int8Export report is in ``speedkit_summary.json`` and the W&B run summary."""
    # A fresh process: wandb keeps its mode per process, and the other tests run it disabled.
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(WANDB_MODE="offline", WANDB_SILENT="true")
    code = _PRESET_EXPORT_RUN.format(tests=str(Path(__file__).parent), root=str(tmp_path), int8=str(tmp_path / "int8"))
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, check=True, capture_output=True, text=True
    )
    line = next(line for line in done.stdout.splitlines() if line.startswith("WANDB_SUMMARY "))
    wandb_summary = json.loads(line.removeprefix("WANDB_SUMMARY "))

    report = json.loads(next(tmp_path.rglob("speedkit_summary.json")).read_text())["Int8Export"]
    assert report["exported"] is True
    assert report == json.loads((tmp_path / "int8" / "model.json").read_text()) | {"exported": True}
    assert Path(report["int8_path"]).is_file()

    assert wandb_summary["speedkit/Int8Export/exported"] is True
    assert wandb_summary["speedkit/Int8Export/int8_path"] == report["int8_path"]
    assert wandb_summary["speedkit/Int8Export/size_ratio"] == pytest.approx(report["size_ratio"])
    assert wandb_summary["speedkit/Int8Export/verification/top1_agreement"] == pytest.approx(
        report["verification"]["top1_agreement"]
    )
    runs = list(tmp_path.glob("wandb/offline-run-*/run-*.wandb"))  # what `wandb sync` uploads
    assert len(runs) == 1
    assert b"speedkit/Int8Export/size_ratio" in runs[0].read_bytes()


_TWO_PRESETS_RUN = """
import json, sys
sys.path.insert(0, {tests!r})
import wandb
from conftest import TinyClassifier
from lightning_speedkit import preset

def fit(name):
    trainer = preset(default_root_dir={root!r} + "/" + name, max_epochs=1, enable_progress_bar=False, verbose=False)
    trainer.fit(TinyClassifier())
    return trainer.logger.experiment

own = wandb.init(project="speedkit", dir={root!r})
in_own = fit("own")
own_open = wandb.run is own
wandb.finish()
first, second = fit("first"), fit("second")
print("RUNS " + json.dumps({{
    "own": own.id, "in_own": in_own.id, "own_open": own_open,
    "first": first.id, "second": second.id, "open": wandb.run.id,
    "second_summary": sorted(k for k in dict(second.summary) if k.startswith("speedkit/")),
}}))
"""


@pytest.mark.slow
def test_each_preset_trainer_logs_into_a_wandb_run_of_its_own_and_a_users_own_run_is_kept(tmp_path: Path) -> None:
    """A second preset() in one process gets its own W&B run (not the first's, left open); the user's run is used."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(WANDB_MODE="offline", WANDB_SILENT="true")
    code = _TWO_PRESETS_RUN.format(tests=str(Path(__file__).parent), root=str(tmp_path))
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, check=True, capture_output=True, text=True
    )
    runs = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("RUNS ")).removeprefix("RUNS "))
    assert runs["in_own"] == runs["own"]  # the user's own run is logged into ...
    assert runs["own_open"]  # ... and not finished
    assert len({runs["own"], runs["first"], runs["second"]}) == 3
    assert runs["open"] == runs["second"]  # the first preset's run was finished when the second started its own
    assert runs["second_summary"]  # its reports reached its own run
