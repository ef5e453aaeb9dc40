"""Decisions remembered across runs: applied unprobed on the same fingerprint, probed again on a change or bad file."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from conftest import ROOT, tiny_trainer
from torch.utils.data import DataLoader, TensorDataset

import lightning_speedkit as speedkit
from lightning_speedkit import channels_last
from lightning_speedkit.demo import DemoClassifier
from lightning_speedkit.trials import Decision, Lever, TrialSession
from lightning_speedkit.trials.counted import queued_steps
from lightning_speedkit.trials.measure import DETERMINISTIC
from lightning_speedkit.trials.memory import DecisionMemory, Remembering, fingerprint_key, outside_band

pytestmark = pytest.mark.usefixtures("one_thread")  # a shared 2-core machine: one thread steps steadily


def _images(n: int = 256, size: int = 16) -> DataLoader[tuple[torch.Tensor, ...]]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(n, 3, size, size, generator=generator)
    return DataLoader(TensorDataset(x, torch.randint(0, 10, (n,), generator=generator)), batch_size=8)


def _levers(**kwargs: Any) -> list[Lever]:
    """Two levers that measure on this fit: the layout, and fp32 against bf16 (timed whatever the CPU)."""
    precision = speedkit.PrecisionTuner(candidates=["32-true", "bf16-mixed"], probe_steps=3, **kwargs)
    return [speedkit.ChannelsLast(probe_steps=3, **kwargs), precision]


def _fit(
    tmp_path: Path, levers: list[Lever], width: int = 16, extra: Sequence[L.Callback] = (), **kwargs: Any
) -> L.Trainer:
    L.seed_everything(0, verbose=False)
    model = DemoClassifier(width=width, crop_size=16)
    trainer = tiny_trainer(tmp_path, max_epochs=12, callbacks=[*levers, *extra], limit_val_batches=0, **kwargs)
    trainer.fit(model, _images())
    return trainer


def _no_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    """No lever measures: any trial fails the test, but ChannelsLast's one-step check that the steps run NHWC.

    That check is not a measurement: it runs on every fit with NHWC in place (`tests/test_channels_last.py`).
    """
    monkeypatch.setattr(TrialSession, "__enter__", lambda self: pytest.fail("probed a remembered decision"))
    monkeypatch.setattr(channels_last, "_step_problem", lambda trainer: None)


def test_the_same_job_again_applies_every_decision_without_probing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A second fit with the same fingerprint recalls each lever's decision (source, where and when), unprobed."""
    first = _levers()
    _fit(tmp_path / "a", first)
    assert all(lever.report()["source"] == "measured" for lever in first)
    assert len(DecisionMemory().entries()) == 2
    _no_probe(monkeypatch)
    second = _levers()
    _fit(tmp_path / "b", second)
    for old, new in zip(first, second, strict=True):
        report = new.report()
        assert report["source"] == "remembered", report
        assert (report["decision"], report["reason"]) == (old.report()["decision"], old.report()["reason"])
        assert report["remembered_at"]
        assert report["remembered_in"].startswith(str(DecisionMemory().root))
        assert report["probe_s"] == old.report()["probe_s"]  # the figure of the run that measured it


@pytest.fixture
def deterministic_off_after(monkeypatch: pytest.MonkeyPatch) -> Any:
    """`Trainer(deterministic=True)` turns torch's deterministic algorithms on for the process: off again after."""
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)  # Lightning sets it too; restored at teardown
    yield
    torch.use_deterministic_algorithms(False)


@pytest.mark.usefixtures("deterministic_off_after")
def test_a_deterministic_run_times_nothing_and_recalls_nothing(tmp_path: Path) -> None:
    """With `Trainer(deterministic=True)` no lever chooses by timing steps, nor applies a timed choice remembered.

    A timed choice (layout, precision, fused update, loader workers) can differ from run to run with the machine's
    load, and each changes the arithmetic; a deterministic run keeps the settings in place, so two of them train to
    the same weights whatever the machine remembers.
    """
    _fit(tmp_path / "a", _levers())  # a run that measures, and remembers what it chose
    assert len(DecisionMemory().entries()) == 2
    runs = []
    for name in ("b", "c"):
        levers = [*_levers(), speedkit.FusedOptimizer(), speedkit.DataLoaderTuner()]
        L.seed_everything(0, verbose=False)
        data = L.LightningDataModule.from_datasets(_images().dataset, batch_size=8)  # a loader the tuner may tune
        trainer = tiny_trainer(
            tmp_path / name, max_epochs=12, callbacks=levers, limit_val_batches=0, deterministic=True
        )
        trainer.fit(DemoClassifier(width=16, crop_size=16), data)
        for lever in levers:
            report = lever.report()
            assert (report["source"], report["reason"], report["probed"]) == ("skipped", DETERMINISTIC, False), report
        runs.append({k: v.clone() for k, v in trainer.lightning_module.state_dict().items()})
    assert all(torch.equal(runs[0][k], runs[1][k]) for k in runs[0])
    assert len(DecisionMemory().entries()) == 2  # nothing new written, nothing recalled


@pytest.mark.parametrize(
    "change",
    # a wider model, not a narrower one: at width 8 the oneDNN guard keeps NCHW on an AVX-512 CPU (oneDNN #6035)
    [{"width": 32}, {"accumulate_grad_batches": 2}, {"lever": {"margin": 0.2}}, {"limit_train_batches": 0.5}],
    ids=["model", "accumulation", "arguments", "limits"],  # limits: a batch size found for more batches may not fit
)
def test_any_change_in_the_fingerprint_probes_again(tmp_path: Path, change: dict[str, Any]) -> None:
    """Another model, another gradient accumulation or another lever argument: a new fingerprint, measured afresh."""
    _fit(tmp_path / "a", [speedkit.ChannelsLast(probe_steps=3)])
    lever = speedkit.ChannelsLast(probe_steps=3, **change.pop("lever", {}))
    _fit(tmp_path / "b", [lever], **change)
    assert lever.report()["source"] == "measured", lever.report()["reason"]
    assert len(DecisionMemory().entries()) == 2


def test_a_second_fit_of_the_same_levers_takes_their_decisions_only_for_the_same_job(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same callbacks fitting again: the same model applies the decisions unprobed, another model decides anew.

    An earlier fit's decision was applied to any model: a precision measured safe on one model was kept on another
    whose loss it ruined, and a layout measured on one was forced on one that cannot run it.
    """
    levers = _levers(remember=False)
    _fit(tmp_path / "a", levers)
    first = [lever.decision for lever in levers]
    _fit(tmp_path / "other", levers, width=32)  # another model: decided again
    other = [lever.decision for lever in levers]
    assert all(new is not old for new, old in zip(other, first, strict=True))
    assert [decision.extra["job"] for decision in other] != [decision.extra["job"] for decision in first]
    with monkeypatch.context() as patched:  # the same job as the fit before: its decisions, unprobed
        _no_probe(patched)
        _fit(tmp_path / "again", levers, width=32)
    assert all(lever.decision is decision for lever, decision in zip(levers, other, strict=True))


def test_a_loader_speedkit_rebuilt_fingerprints_as_the_users_loader(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A loader the tuner rebuilt (a remembered loader decision applied first) is the user's job: no new probe."""
    from lightning_speedkit.dataloader.rebuild import rebuild_dataloader
    from lightning_speedkit.trials.memory import Remembering

    # the live check is not what this test is about: steps of a few ms came out over 1.5x off the remembered ones in
    # about one fit in four on a quiet 2-core AVX-512 EPYC (also at b061d44), and it then forgot the entry
    monkeypatch.setattr(Remembering, "BAND", math.inf)
    _fit(tmp_path / "a", [speedkit.ChannelsLast(probe_steps=3)])
    rebuilt = rebuild_dataloader(_images(), {"num_workers": 0, "pin_memory": True})
    lever = speedkit.ChannelsLast(probe_steps=3)
    L.seed_everything(0, verbose=False)
    trainer = tiny_trainer(tmp_path / "b", max_epochs=12, callbacks=[lever], limit_val_batches=0)
    trainer.fit(DemoClassifier(width=16, crop_size=16), rebuilt)
    assert lever.report()["source"] == "remembered"
    assert len(DecisionMemory().entries()) == 1


class _SlowFp32(L.Callback):
    """Steps in fp32 take 20 ms more (a real sleep), so the precision probe keeps bf16 on any CPU."""

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.precision == "32-true":
            time.sleep(0.02)


def test_a_remembered_precision_put_in_place_first_leaves_the_next_levers_remembered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A remembered precision is in place before the layout fingerprints the run: still the job as built (fp32).

    So the layout's remembered decision is found too (before the fix, the layout was probed again).
    """
    monkeypatch.setattr(Remembering, "BAND", math.inf)  # not the live check: under load it forgot both entries
    first = _levers()[::-1]  # the acting order: the precision first
    _fit(tmp_path / "a", first, extra=[_SlowFp32()])
    assert first[0].report()["decision"] == "bf16-mixed", first[0].report()
    second = _levers()[::-1]
    trainer = _fit(tmp_path / "b", second, extra=[_SlowFp32()])
    assert [lever.report()["source"] for lever in second] == ["remembered", "remembered"]
    assert trainer.precision == "bf16-mixed"
    assert len(DecisionMemory().entries()) == 2


@pytest.mark.parametrize(
    ("damage", "note"),
    [
        (lambda entry: "{not json", "cannot be read"),
        (lambda entry: json.dumps({**entry, "speedkit": "0.0.1"}), "is from speedkit 0.0.1"),
        (lambda entry: json.dumps({**entry, "format": 99}), "is not a speedkit decision file"),
        (lambda entry: json.dumps({**entry, "fingerprint": {"lever": "another"}}), "another run's fingerprint"),
        (lambda entry: json.dumps({**entry, "decision": {**entry["decision"], "probed": "yes"}}), "cannot be read"),
    ],
    ids=["corrupt", "other version", "other format", "foreign", "damaged decision"],
)
def test_a_bad_or_foreign_file_is_ignored_with_a_note_and_probed_again(
    tmp_path: Path, damage: Any, note: str, recwarn: pytest.WarningsRecorder
) -> None:
    """A corrupt file, another version's, another format's or another fingerprint's: a note, a probe, no crash."""
    _fit(tmp_path / "a", [speedkit.ChannelsLast(probe_steps=3)])
    (path,) = DecisionMemory().root.glob("*/*.json")
    path.write_text(damage(json.loads(path.read_text())))
    lever = speedkit.ChannelsLast(probe_steps=3)
    _fit(tmp_path / "b", [lever])
    report = lever.report()
    assert report["source"] == "measured"
    assert note in report["memory_note"]
    assert json.loads(path.read_text())["decision"]["decision"] == report["decision"]  # rewritten by the new probe


def test_an_unwritable_cache_is_one_warning_and_the_run_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A decisions directory that cannot be made: one logged warning for the run, every decision still applied."""
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    monkeypatch.setenv("SPEEDKIT_DECISIONS_DIR", str(blocker / "decisions"))
    levers = _levers()
    with caplog.at_level("WARNING", logger="lightning_speedkit.trials.memory"):
        _fit(tmp_path, levers)
    assert sum("lever decisions are not remembered" in r.getMessage() for r in caplog.records) == 1
    assert all(lever.report()["source"] == "measured" for lever in levers)
    assert all("not remembered: cannot write" in lever.report()["memory_note"] for lever in levers)


def test_remember_false_neither_reads_nor_writes(tmp_path: Path) -> None:
    """``remember=False`` on a lever (or ``preset(remember=False)``) probes every time and writes nothing."""
    _fit(tmp_path / "a", _levers(remember=False))
    assert DecisionMemory().entries() == []
    _fit(tmp_path / "b", _levers())
    levers = _levers(remember=False)
    _fit(tmp_path / "c", levers)
    assert all(lever.report()["source"] == "measured" for lever in levers)
    trainer = speedkit.preset(logger=False, verbose=False, remember=False)
    assert all(not c.remember for c in trainer.callbacks if isinstance(c, Lever))


@pytest.mark.parametrize("stored_from", [True, False], ids=["same batches", "file without live_from"])
def test_a_remembered_decision_far_from_the_runs_steps_is_forgotten(tmp_path: Path, stored_from: bool) -> None:
    """The live steps are timed at no cost; a remembered figure 10x off makes the next run probe again.

    A file of an earlier version, without the batches its figure timed, is checked on the run's first steps.
    """
    _fit(tmp_path / "a", [speedkit.ChannelsLast(probe_steps=3)])
    (path,) = DecisionMemory().root.glob("*/*.json")
    entry = json.loads(path.read_text())
    live = entry["decision"]["live_step_s"]
    assert live > 0  # the measuring run recorded its own steps
    entry["decision"]["live_step_s"] = live * 10  # as if remembered on a far slower (loaded) machine
    if not stored_from:
        del entry["decision"]["live_from"]
    path.write_text(json.dumps(entry))
    lever = speedkit.ChannelsLast(probe_steps=3)
    _fit(tmp_path / "b", [lever])
    check = lever.report()["memory_check"]
    assert check["stale"] is True
    assert check["ratio"] < 1 / Remembering.BAND
    assert not path.exists()
    assert "the next run probes again" in lever.report()["memory_note"]


class _FirstFreeBatch(L.Callback):
    """The first training batch at whose start no counted probe was pending any more."""

    def __init__(self) -> None:
        self.batch: int | None = None

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int) -> None:
        if self.batch is None and not queued_steps(trainer):
            self.batch = trainer.fit_loop.epoch_loop.total_batch_idx


def test_the_check_times_the_runs_own_settings_and_a_later_run_the_same_batches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Like with like: a measured decision's steps are timed once no counted probe is pending.

    The precision, decided at fit start, waits for the layout's counted blocks; a remembered run times the same
    batches of its run.
    """
    first, free = _levers(), _FirstFreeBatch()
    _fit(tmp_path / "a", first, extra=[free])
    assert free.batch is not None
    assert free.batch > 0  # the layout's counted blocks came first
    stored = [json.loads(p.read_text())["decision"] for p in sorted(DecisionMemory().root.glob("*/*.json"))]
    assert [d["live_from"] for d in stored] == [free.batch + Remembering.CHECK_SKIP] * 2
    timed: dict[int, list[int]] = {}
    step_ended = Remembering.step_ended

    def recording(self: Remembering, trainer: L.Trainer, decision: Any) -> None:
        before = len(self._times)
        step_ended(self, trainer, decision)
        if len(self._times) > before:
            timed.setdefault(id(self), []).append(trainer.fit_loop.epoch_loop.total_batch_idx)

    monkeypatch.setattr(Remembering, "step_ended", recording)
    monkeypatch.setattr(Remembering, "BAND", math.inf)  # what is timed, not the verdict
    second = _levers()
    _fit(tmp_path / "b", second)
    assert all(lever.report()["source"] == "remembered" for lever in second)
    assert all("memory_check" in lever.report() for lever in second)
    first_batch = free.batch + Remembering.CHECK_SKIP
    expected = list(range(first_batch, first_batch + Remembering.CHECK_STEPS))
    assert list(timed.values()) == [expected, expected]


@pytest.mark.parametrize(
    ("live", "remembered", "stale"),
    [(0.020, 0.020, False), (0.029, 0.020, False), (0.031, 0.020, True), (0.014, 0.020, False), (0.013, 0.020, True)],
)
def test_a_remembered_figure_is_stale_only_outside_the_band_either_way(
    live: float, remembered: float, stale: bool
) -> None:
    """Within 1.5x either way a remembered decision stands; beyond it (slower, or faster: decided under load) not."""
    assert outside_band(live, remembered, Remembering.BAND) is stale


def test_doctor_lists_and_forget_clears_what_is_remembered(tmp_path: Path) -> None:
    """``speedkit doctor`` names each remembered decision; ``speedkit forget`` removes them all."""
    _fit(tmp_path, _levers())
    script = Path(sys.executable).parent / "speedkit"
    listed = subprocess.run([str(script), "doctor"], capture_output=True, text=True, check=True).stdout
    assert "ChannelsLast" in listed
    assert "PrecisionTuner" in listed
    forgot = subprocess.run([str(script), "forget"], capture_output=True, text=True, check=True).stdout
    assert forgot.startswith("speedkit forget: 2 remembered decision(s) removed")
    assert DecisionMemory().entries() == []


def test_forget_removes_the_decisions_and_nothing_else(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``forget`` removes the remembered decisions and nothing else of a directory the user chose.

    The directories the decisions leave empty go too; the count is what was removed.
    """
    root = tmp_path / "mine"
    monkeypatch.setenv("SPEEDKIT_DECISIONS_DIR", str(root))
    memory = DecisionMemory()
    decision = Decision(decision="channels_last", reason="faster", source="measured")
    assert memory.remember({"lever": "ChannelsLast{}"}, decision) == ""
    assert memory.remember({"lever": "PrecisionTuner{}"}, decision) == ""
    (root / "notes.txt").write_text("mine")
    (root / "project").mkdir()
    (root / "project" / "train.json").write_text("{}")
    beside = next(p for p in root.iterdir() if p.is_dir() and p.name != "project")
    (beside / "keep.json").write_text('{"mine": true}')
    assert memory.forget() == 2
    assert [(e["lever"], e["reason"]) for e in memory.entries()] == [("keep", "unreadable")]  # not a decision: kept
    assert (root / "notes.txt").read_text() == "mine"
    assert (root / "project" / "train.json").is_file()
    assert (beside / "keep.json").is_file()
    empty = tmp_path / "empty"
    monkeypatch.setenv("SPEEDKIT_DECISIONS_DIR", str(empty))
    assert DecisionMemory().remember({"lever": "X"}, decision) == ""
    assert DecisionMemory().forget() == 1
    assert not empty.exists()  # nothing of the user's there: the directory goes too


def test_the_fingerprint_key_is_stable_and_sensitive() -> None:
    """The same fingerprint always maps to one directory; any field changed maps elsewhere."""
    base = {"lever": "ChannelsLast{}", "device": {"name": "EPYC", "flags": ["avx2"]}, "versions": {"torch": "2.13"}}
    assert fingerprint_key(base) == fingerprint_key(json.loads(json.dumps(base)))
    assert fingerprint_key(base) != fingerprint_key({**base, "device": {"name": "EPYC", "flags": ["avx2", "avx512f"]}})


DDP_SCRIPT = """
import json, sys
import lightning as L, torch
from torch.utils.data import DataLoader, TensorDataset
import lightning_speedkit as speedkit
from lightning_speedkit.demo import DemoClassifier

out = sys.argv[1]
torch.set_num_threads(1)
# the live check is not what this test is about: it can forget the entry when a few-ms step comes out 1.5x off
from lightning_speedkit.trials.memory import Remembering
Remembering.BAND = float("inf")
g = torch.Generator().manual_seed(0)
x = torch.randn(512, 3, 16, 16, generator=g)
data = DataLoader(TensorDataset(x, torch.randint(0, 10, (512,), generator=g)), batch_size=8)
lever = speedkit.ChannelsLast(probe_steps=3)
trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=12, logger=False, callbacks=[lever],
                    enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
L.seed_everything(0, verbose=False)
trainer.fit(DemoClassifier(width=16, crop_size=16), data)
report = lever.report()
with open(f"{out}/rank{trainer.global_rank}.json", "w") as f:
    json.dump({"source": report["source"], "decision": report["decision"]}, f)
# tear the gloo group down before exit: its threads outliving the interpreter abort the process now and then
# ("terminate called without an active exception"), as tests/scripts/combined_ddp.py does
if torch.distributed.is_initialized():
    torch.distributed.destroy_process_group()
"""


@pytest.mark.slow
@pytest.mark.ddp
def test_under_ddp_rank_zero_remembers_and_every_rank_applies_the_same(tmp_path: Path) -> None:
    """Two gloo ranks: the first run measures and rank zero writes one file; the second run recalls it on both."""
    script = tmp_path / "job.py"
    script.write_text(DDP_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    records = []
    for run in ("first", "second"):
        out = tmp_path / run
        out.mkdir()
        subprocess.run([sys.executable, str(script), str(out)], check=True, cwd=tmp_path, env=env, timeout=600)
        records.append([json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)])
    assert [r["source"] for r in records[0]] == ["measured", "measured"]
    assert [r["source"] for r in records[1]] == ["remembered", "remembered"]
    assert records[1][0]["decision"] == records[1][1]["decision"] == records[0][0]["decision"]
    assert len(DecisionMemory().entries()) == 1
