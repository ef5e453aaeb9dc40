"""The trial mechanism: real steps under a setting, and the run afterwards exactly as it would be without them."""

from __future__ import annotations

import hashlib
import json
import logging
import random
import time
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import pytest
import torch
from conftest import TinyClassifier, rank_records, tiny_trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torchmetrics import SumMetric
from typing_extensions import override

from lightning_speedkit.trials import AsIs, BatchSize, LeaveOut, Setting, TrialSession, measure
from lightning_speedkit.trials import session as session_module
from lightning_speedkit.trials.session import LIGHTNING_INFO


class _Dropout(TinyClassifier):
    """Adam, a StepLR schedule and dropout, so optimizer state, scheduler state and the RNG all matter."""

    def __init__(self) -> None:
        super().__init__(lr=0.01, batch_size=8, num_samples=64, optimizer="adam")
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 4))

    @override
    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.Adam(self.parameters(), lr=self.lr)
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5)}


class _TenfoldLR(L.Callback):
    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        for group in trainer.optimizers[0].param_groups:
            group["lr"] *= 10


class _LRSchedule(Setting):
    """An LR schedule for the length of a trial: the LR grows tenfold every step (an LR range test's shape)."""

    name = "lr schedule"

    @override
    def callbacks(self) -> list[L.Callback]:
        return [_TenfoldLR()]


class _Trials(L.Callback):
    """Runs trials of several kinds of setting at fit start, as a lever would."""

    def __init__(self) -> None:
        self.results: list[Any] = []

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        with TrialSession(trainer, steps=3) as session:
            self.results = [session.run(s) for s in (AsIs(), BatchSize("batch_size", 4), _LRSchedule())]


def _digest(value: Any) -> str:
    return hashlib.sha256(repr(value).encode()).hexdigest()


class _Recorder(L.Callback):
    """Writes, at the first real training batch and at the end, everything a trial must leave as it found it."""

    def __init__(self, out: Path, name: str) -> None:
        self.out, self.name = out, name
        self.first: dict[str, Any] | None = None

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int) -> None:
        if self.first is not None:
            return
        optimizer = trainer.optimizers[0]
        self.first = {
            "weights": [p.detach().tolist() for p in pl_module.parameters()],
            "optimizer": _digest({k: {n: t.tolist() for n, t in v.items()} for k, v in optimizer.state.items()}),
            "lrs": [g["lr"] for g in optimizer.param_groups] + trainer.lr_scheduler_configs[0].scheduler.get_last_lr(),
            "torch_rng": _digest(torch.get_rng_state().tolist()),
            "numpy_rng": _digest(np.random.get_state()[1].tolist()),
            "python_rng": _digest(random.getstate()),
            "batch": [t.tolist() for t in batch],
            "global_step": trainer.global_step,
        }

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        record = {"first": self.first, "final": [p.detach().tolist() for p in pl_module.parameters()]}
        (self.out / f"{self.name}{trainer.global_rank}.json").write_text(json.dumps(record))


def _fit(tmp_path: Path, name: str, trials: bool, **kwargs: Any) -> _Trials:
    L.seed_everything(0, verbose=False)
    runner = _Trials()
    callbacks = ([runner] if trials else []) + [_Recorder(tmp_path, name)]
    tiny_trainer(tmp_path, max_epochs=2, callbacks=callbacks, **kwargs).fit(_Dropout())
    return runner


def test_a_trial_leaves_the_run_exactly_as_without_it(tmp_path: Path) -> None:
    """Weights, optimizer state, LRs, RNG streams, the next batch and the final weights equal a run without trials."""
    runner = _fit(tmp_path, "with", trials=True)
    _fit(tmp_path, "without", trials=False)
    with_trials, without = rank_records(tmp_path, "with", 1)[0], rank_records(tmp_path, "without", 1)[0]
    assert with_trials == without
    assert [r.fits for r in runner.results] == [True, True, True]
    assert [len(r.step_s) for r in runner.results] == [3, 3, 3]
    assert runner.results[1].samples == [4, 4, 4]
    assert all(loss is not None for r in runner.results for loss in r.losses)


class _CountsItsHooks(_Dropout):
    """Counts the module's own fit, train and epoch hooks."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: dict[str, int] = {}

    def _count(self, name: str) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1

    def on_fit_start(self) -> None:
        self._count("on_fit_start")

    def on_fit_end(self) -> None:
        self._count("on_fit_end")

    def on_train_start(self) -> None:
        self._count("on_train_start")

    def on_train_end(self) -> None:
        self._count("on_train_end")

    def on_train_epoch_end(self) -> None:
        self._count("on_train_epoch_end")


def test_a_trial_runs_the_modules_train_hooks_as_a_short_fit_and_its_fit_hooks_run_once(tmp_path: Path) -> None:
    """Each trial is a short fit of the module (as Lightning's own LR finder runs): its train hooks run around it.

    ``on_fit_start`` and ``on_fit_end`` run once a fit, the place for once-a-run work (README: measured decisions).
    """
    L.seed_everything(0, verbose=False)
    module = _CountsItsHooks()
    tiny_trainer(tmp_path, max_epochs=2, callbacks=[_Trials()]).fit(module)
    trials = 3
    assert module.calls == {
        "on_fit_start": 1,
        "on_fit_end": 1,
        "on_train_start": 1 + trials,
        "on_train_end": 1 + trials,
        "on_train_epoch_end": 2 + trials,
    }


class _TrialAtTrainStart(L.Callback):
    """Runs one trial from ``on_train_start`` (where a callback does its epoch-start work that Lightning skips)."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        with TrialSession(trainer, steps=2) as session:
            session.run(AsIs())


class _EpochStarts(L.Callback):
    def __init__(self) -> None:
        self.epochs: list[int] = []

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.epochs.append(trainer.current_epoch)


@pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`, callbacks used to create the checkpoint")
def test_a_trial_at_the_start_of_a_fit_resumed_mid_epoch_keeps_lightnings_restart_stage(tmp_path: Path) -> None:
    """A resumed fit with a trial at its start runs the epochs, hooks and weights of the resumed fit without one.

    Resumed from a checkpoint written at an epoch's last batch, Lightning goes on into the next epoch without its
    epoch-start hooks; the trial's loop reset its restart stage, and Lightning then called them as for a new epoch.
    """
    L.seed_everything(0, verbose=False)
    every = ModelCheckpoint(tmp_path / "ckpt", every_n_train_steps=8, save_top_k=-1, filename="{step}")
    tiny_trainer(tmp_path, max_epochs=3, callbacks=[every], enable_checkpointing=True).fit(_Dropout())
    resumed = []
    for trial in (False, True):
        L.seed_everything(0, verbose=False)
        module, starts = _Dropout(), _EpochStarts()
        callbacks = [_TrialAtTrainStart(), starts] if trial else [starts]
        tiny_trainer(tmp_path, max_epochs=3, callbacks=callbacks).fit(
            module, ckpt_path=str(tmp_path / "ckpt" / "step=8.ckpt")
        )
        resumed.append((starts.epochs, [p.detach().clone() for p in module.parameters()]))
    (plain_epochs, plain), (trial_epochs, tried) = resumed
    assert trial_epochs == plain_epochs == [2]  # epoch 1 (batches 8-15) began without its hooks, as Lightning does
    assert all(torch.equal(a, b) for a, b in zip(plain, tried, strict=True))


class _ValidatingTrialAtFitStart(L.Callback):
    """Runs one trial with a validation batch at fit start, as `ChannelsLast`'s check of a resumed NHWC fit does."""

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        with TrialSession(trainer, steps=2, validate=True) as session:
            session.run(AsIs())


class _Batches(L.Callback):
    def __init__(self) -> None:
        self.seen: list[tuple[int, int]] = []
        self.validations = 0

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int) -> None:
        self.seen.append((trainer.current_epoch, idx))

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.validations += 1


@pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`, callbacks used to create the checkpoint")
@pytest.mark.parametrize("max_steps", [-1, 20])
def test_a_validating_trial_at_a_resumed_fits_start_leaves_it_training(tmp_path: Path, max_steps: int) -> None:
    """A trial's validation batch at the start of a fit resumed from a validation's end leaves the run as without it.

    It left the validation loop marked as run: the resumed epoch loop, still restarting, took each epoch for done and
    the fit trained no batch (with ``max_steps``, it ran empty epochs without end).
    """
    L.seed_everything(0, verbose=False)
    last = ModelCheckpoint(tmp_path / "ckpt", save_last=True)
    tiny_trainer(tmp_path, max_epochs=1, val_check_interval=0.5, callbacks=[last], enable_checkpointing=True).fit(
        _Dropout()
    )
    runs = []
    for trial in (False, True):
        L.seed_everything(0, verbose=False)
        module, batches = _Dropout(), _Batches()
        callbacks = [_ValidatingTrialAtFitStart(), batches] if trial else [batches]
        trainer = tiny_trainer(tmp_path, max_epochs=3, max_steps=max_steps, val_check_interval=0.5, callbacks=callbacks)
        trainer.fit(module, ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))
        runs.append(
            (batches.seen, batches.validations, trainer.global_step, [p.detach().clone() for p in module.parameters()])
        )
    (seen, validations, step, weights), (seen_t, validations_t, step_t, weights_t) = runs
    assert step == (24 if max_steps == -1 else 20)
    assert (seen_t, validations_t, step_t) == (seen, validations, step)
    assert all(torch.equal(a, b) for a, b in zip(weights, weights_t, strict=True))


class _MidFitTrials(L.Callback):
    """Runs three trials at the start of epoch 1, once the optimizer and the scheduler hold state."""

    def __init__(self, replay: bool = False) -> None:
        self.results: list[Any] = []
        self.replay = replay

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.current_epoch == 1:
            with TrialSession(trainer, steps=3, replay=self.replay) as session:
                self.results = [session.run(s) for s in (AsIs(), _LRSchedule(), AsIs())]


class _EpochOneRecorder(_Recorder):
    """`_Recorder`'s record, taken at the first batch of epoch 1 (after any trial there)."""

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int) -> None:
        if trainer.current_epoch == 1:
            super().on_train_batch_start(trainer, pl_module, batch, idx)


def test_trials_at_an_epoch_start_mid_fit_leave_the_run_exactly_as_without_them(tmp_path: Path) -> None:
    """At the start of a later epoch (optimizer and scheduler state built), trials run their steps and put it back.

    Each trial trains its steps from the same state (the first and the last, alike, get the same losses); the run
    then goes on as if there had been none: the same state and batch at the epoch's first step, the same final
    weights. The snapshot is copied into the optimizer, so a trial's in-place updates cannot reach it.
    """
    runs = {}
    for name, trials in (("with", True), ("without", False)):
        L.seed_everything(0, verbose=False)
        runner = _MidFitTrials()
        callbacks = ([runner] if trials else []) + [_EpochOneRecorder(tmp_path, name)]
        tiny_trainer(tmp_path, max_epochs=3, callbacks=callbacks).fit(_Dropout())
        runs[name] = runner
    assert rank_records(tmp_path, "with", 1)[0] == rank_records(tmp_path, "without", 1)[0]
    results = runs["with"].results
    assert [len(r.step_s) for r in results] == [3, 3, 3]
    assert results[0].losses == results[2].losses
    assert results[1].losses[1:] != results[0].losses[1:]  # the LR schedule's steps train differently


class _Counting(TinyClassifier):
    """Counts the samples it trained on in a torchmetrics `SumMetric` that spans the fit (never reset)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = SumMetric()

    @override
    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.seen.update(torch.tensor(float(len(batch[0]))))
        return super().training_step(batch, batch_idx)


def test_trials_mid_fit_take_out_their_metric_updates_and_keep_the_runs(tmp_path: Path) -> None:
    """A metric's state is not in ``state_dict``: trials at a later epoch put back what it held, not an empty metric.

    The session reset every metric: a counter spanning the fit lost the epochs before the trials (preset's cool-down
    trial at the last epoch left a fit of 6,400 samples counting 1,600).
    """
    L.seed_everything(0, verbose=False)
    model = _Counting()
    trainer = tiny_trainer(tmp_path, max_epochs=3, callbacks=[_MidFitTrials()])
    trainer.fit(model)
    assert model.seen.compute().item() == trainer.global_step * model.batch_size


def test_every_trial_starts_from_the_same_state_and_batches(tmp_path: Path) -> None:
    """Two trials of the same setting train on the same batches from the same weights: identical losses."""

    class Twice(L.Callback):
        def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            with TrialSession(trainer, steps=3) as session:
                self.losses = [session.run(AsIs()).losses for _ in range(2)]

    twice = Twice()
    L.seed_everything(0, verbose=False)
    tiny_trainer(tmp_path, max_epochs=1, callbacks=[twice]).fit(_Dropout())
    assert twice.losses[0] == twice.losses[1]


def test_a_session_on_the_cpu_leaves_garbage_to_python_and_counts_its_clean_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the CPU a successful session runs no ``gc.collect()`` on exit, and ``elapsed_s`` includes the clean-up.

    A full collection costs ~0.2 s in the demo's process; ``probe_s`` of every lever is ``elapsed_s``.
    """
    collected: list[int] = []
    monkeypatch.setattr("gc.collect", lambda *args: collected.append(1) or 0)
    released: list[float] = []  # when the session's clean-up returned
    real_release = session_module.release_memory

    def release(collect: bool = True) -> None:
        real_release(collect)
        released.append(time.perf_counter())

    monkeypatch.setattr(session_module, "release_memory", release)

    class Timed(L.Callback):
        def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            with TrialSession(trainer, steps=3) as session:
                session.run(AsIs())
            self.session = session

    timed = Timed()
    tiny_trainer(tmp_path, max_epochs=1, callbacks=[timed]).fit(_Dropout())
    assert collected == []
    assert len(released) == 1
    assert timed.session._started + timed.session.elapsed_s >= released[0]  # the clock stopped after the clean-up


def test_trials_hold_back_lightning_info_lines_about_their_own_loops(tmp_path: Path) -> None:
    """No "`Trainer.fit` stopped: `max_steps=3` reached." per trial; the run's own lines and the level come back."""
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger(LIGHTNING_INFO)
    logger.addHandler(handler)
    level, disabled = logger.level, logger.disabled
    logger.setLevel(logging.INFO)  # as Lightning sets it, whatever an earlier test in this process left
    logger.disabled = False
    try:
        _fit(tmp_path, "quiet", trials=True, max_steps=12)
        assert logger.level == logging.INFO  # the trials put the level back
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        logger.disabled = disabled
    assert "`Trainer.fit` stopped: `max_steps=3` reached." not in records
    assert "`Trainer.fit` stopped: `max_steps=12` reached." in records  # the run's own line still shows


@pytest.mark.slow
@pytest.mark.ddp
def test_under_ddp_trials_leave_both_ranks_as_without_them(tmp_path: Path) -> None:
    """2-process DDP: on each rank the run after the trials equals the run without them, and the ranks agree."""
    for name, trials in (("with", True), ("without", False)):
        strategy = DDPStrategy(start_method="spawn", process_group_backend="gloo")
        _fit(tmp_path, name, trials=trials, strategy=strategy, devices=2)
    with_trials, without = rank_records(tmp_path, "with"), rank_records(tmp_path, "without")
    assert with_trials == without
    flat = [[x for row in rank["final"] for x in np.ravel(row)] for rank in with_trials]
    assert flat[0] == pytest.approx(flat[1], abs=1e-6)


def test_measure_skips_a_probe_that_cannot_pay_back(tmp_path: Path) -> None:
    """A run of a few steps gets no probe: the setting in place stays and the reason gives the numbers."""

    class Lever(L.Callback):
        def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            self.report = measure(trainer, AsIs(), [BatchSize("batch_size", 4)], 3, margin=0.05, max_gain=0.5).as_dict()

    lever = Lever()
    tiny_trainer(tmp_path, max_epochs=1, callbacks=[lever]).fit(_Dropout())
    assert lever.report["decision"] == "as is"
    assert not lever.report["probed"]
    assert lever.report["reason"] == (
        "skipped: the probe (12 steps) cannot pay back in 8 steps left (at best 4 saved, 48 needed)"
    )


class _Sleep(L.Callback):
    def on_train_batch_end(self, *args: Any) -> None:
        time.sleep(0.05)  # far slower than a step of this net, on any machine


class _SlowSteps(Setting):
    """A setting whose every step sleeps 50 ms: clearly slower than the setting in place."""

    name = "slow"

    @override
    def callbacks(self) -> list[L.Callback]:
        return [_Sleep()]


def test_a_candidate_clearly_slower_in_the_first_round_is_not_timed_again(tmp_path: Path) -> None:
    """A candidate that loses the first round by far runs one round only; the others run both; it is not chosen."""

    class Lever(L.Callback):
        def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            self.report = measure(
                trainer, AsIs(), [_SlowSteps(), AsIs("again")], 3, margin=0.05, max_gain=0.5
            ).as_dict()

    lever = Lever()
    tiny_trainer(tmp_path, max_epochs=40, callbacks=[lever]).fit(_Dropout())
    assert lever.report["probed"]
    assert "slow" in lever.report["dropped"]
    names = [t["setting"] for t in lever.report["trials"]]
    assert names[:3] == ["as is", "slow", "again"]  # the first round times every setting
    if "again" in lever.report["dropped"]:  # its twin can lose a round of ~1 ms steps by chance on a busy machine
        assert names[3:] == []
    else:  # a third round when its twin won one round and lost the other (a coin toss)
        assert names[3:] in (["as is", "again"], ["as is", "again"] * 2)
        assert (len(names) > 5) == (lever.report["added_rounds"] == 1)
    assert lever.report["decision"] != "slow"  # "as is" or its twin "again": two equal settings, a coin toss
    assert lever.report["step_s"]["slow"] > lever.report["step_s"]["as is"]


def test_candidates_left_out_after_the_reference_run_no_trial(tmp_path: Path) -> None:
    """``after_reference`` may leave some candidates out: they run no trial; the reason and ``left_out`` name them."""

    class Lever(L.Callback):
        def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            leave = LeaveOut(("slow",), "its start-up cannot pay back")
            decision = measure(
                trainer, AsIs(), [_SlowSteps(), AsIs("again")], 3, 0.05, 0.5, after_reference=lambda *_: leave
            )
            self.report = decision.as_dict()

    lever = Lever()
    tiny_trainer(tmp_path, max_epochs=40, callbacks=[lever]).fit(_Dropout())
    names = [t["setting"] for t in lever.report["trials"]]
    assert "slow" not in names
    assert names[:2] == ["as is", "again"]
    assert lever.report["left_out"] == ["slow"]
    assert lever.report["reason"].endswith("; slow not tried: its start-up cannot pay back")
    assert "slow" not in lever.report["step_s"]


class _Nap(L.Callback):
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_train_batch_end(self, *args: Any) -> None:
        time.sleep(self.seconds)


class _Steady(Setting):
    """The setting in place of the next test: every step sleeps 20 ms."""

    name = "steady"

    @override
    def callbacks(self) -> list[L.Callback]:
        return [_Nap(0.02)]


class _LoadedSecondRound(Setting):
    """A candidate far faster than `_Steady`, but for its second trial, whose steps sleep 40 ms (a load spike)."""

    name = "faster"

    def __init__(self) -> None:
        self.trials = 0

    @override
    def callbacks(self) -> list[L.Callback]:
        self.trials += 1
        return [_Nap(0.04 if self.trials == 2 else 0.0)]


def test_a_third_round_runs_when_the_leading_candidates_rounds_disagree(tmp_path: Path) -> None:
    """Faster in round one, slower in round two: one more round of both, and the median of three rounds decides."""

    class Lever(L.Callback):
        def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            candidate = _LoadedSecondRound()
            self.report = measure(trainer, _Steady(), [candidate], 3, margin=0.05, max_gain=0.5).as_dict()

    lever = Lever()
    tiny_trainer(tmp_path, max_epochs=40, callbacks=[lever]).fit(_Dropout())
    assert [t["setting"] for t in lever.report["trials"]] == ["steady", "faster"] * 3
    assert lever.report["added_rounds"] == 1
    assert lever.report["decision"] == "faster"
    assert lever.report["reason"].endswith("(a round added: the leading candidate's rounds disagreed)")


def test_when_every_candidate_is_clearly_slower_no_second_round_runs(tmp_path: Path) -> None:
    """With its only candidate dropped after the first round, the setting in place is not timed alone again."""

    class Lever(L.Callback):
        def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            self.report = measure(trainer, AsIs(), [_SlowSteps()], 3, margin=0.05, max_gain=0.5).as_dict()

    lever = Lever()
    tiny_trainer(tmp_path, max_epochs=40, callbacks=[lever]).fit(_Dropout())
    assert [t["setting"] for t in lever.report["trials"]] == ["as is", "slow"]
    assert (lever.report["decision"], lever.report["dropped"]) == ("as is", ["slow"])


def test_a_probe_longer_than_the_loader_is_refused(tmp_path: Path) -> None:
    """More probe steps than the train loader has batches: a ValueError naming `probe_steps` and both numbers."""

    class Lever(L.Callback):
        def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            measure(trainer, AsIs(), [AsIs("again")], 9, margin=0.05, max_gain=0.5)

    with pytest.raises(ValueError, match=r"`probe_steps` .* got 9, the loader has 8 batches"):
        tiny_trainer(tmp_path, max_epochs=100, callbacks=[Lever()]).fit(_Dropout())


@pytest.mark.parametrize(("kwargs", "match"), [({"steps": 0}, "`steps`"), ({"steps": 3, "warmup": 3}, "`warmup`")])
def test_bad_session_arguments_are_refused(tmp_path: Path, kwargs: dict[str, Any], match: str) -> None:
    """Non-positive steps, or a warm-up that leaves no timed step, get a ValueError naming the argument."""
    with pytest.raises(ValueError, match=match):
        TrialSession(tiny_trainer(tmp_path), **kwargs)


class _Interrupt(BaseException):
    """Not an ``Exception``: what a ``KeyboardInterrupt`` or ``SystemExit`` inside a trial looks like to it."""


class _Interrupted(Setting):
    """A setting whose trial is interrupted at its first step; it records whether it was reverted."""

    def __init__(self) -> None:
        self.applied = self.reverted = False

    def apply(self, trainer: L.Trainer) -> None:
        self.applied = True

    def revert(self, trainer: L.Trainer) -> None:
        self.reverted = True

    def callbacks(self) -> list[L.Callback]:
        class _Raise(L.Callback):
            def on_train_batch_end(self, *args: Any) -> None:
                raise _Interrupt

        return [_Raise()]


class _InterruptedTrial(L.Callback):
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.setting = _Interrupted()
        self.weights = [p.detach().clone() for p in pl_module.parameters()]
        with TrialSession(trainer, 3, warmup=0) as session:
            with pytest.raises(_Interrupt):
                session.run(self.setting)
            self.after = [p.detach().clone() for p in pl_module.parameters()]


def test_an_interrupted_trial_is_still_reverted_and_its_state_put_back(tmp_path: Path) -> None:
    """An interrupt inside a trial (not an ``Exception``) still reverts the setting and puts the weights back.

    Before, only an ``Exception`` did: a setting that patches the module (the LR trials' forward-only reference)
    stayed in place for whatever ran next in the process.
    """
    trials = _InterruptedTrial()
    L.seed_everything(0, verbose=False)
    tiny_trainer(tmp_path, callbacks=[trials], max_epochs=1, limit_val_batches=0).fit(TinyClassifier(num_samples=32))
    assert trials.setting.applied
    assert trials.setting.reverted
    assert all(torch.equal(a, b) for a, b in zip(trials.weights, trials.after, strict=True))


def test_steps_left_on_a_resume_counts_from_the_checkpoints_step(tmp_path: Path) -> None:
    """At ``on_fit_start`` of a resumed fit the steps left are the budget less the checkpoint's step, not the budget.

    Lightning restores the loops' progress after ``on_fit_start``: ``global_step`` read 0 there, so a lever probing
    on a resume weighed its probe against the whole run (168 steps left taken as 180).
    """
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_speedkit.trials.measure import steps_left

    class Left(L.Callback):
        def __init__(self) -> None:
            self.left: list[float] = []

        @override
        def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            self.left.append(steps_left(trainer))

    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=4, save_top_k=-1)
    first = Left()
    options: dict[str, Any] = {"max_epochs": 10, "enable_checkpointing": True}
    tiny_trainer(tmp_path, max_steps=12, callbacks=[first, checkpoint], **options).fit(TinyClassifier())
    resumed = Left()
    path = next((tmp_path / "ck").glob("*step=12*.ckpt"))
    tiny_trainer(tmp_path, max_steps=30, max_epochs=10, callbacks=[resumed]).fit(TinyClassifier(), ckpt_path=path)
    assert first.left == [12.0]
    assert resumed.left == [18.0]


class _TwoOptimizers(TinyClassifier):
    """Manual optimization, two optimizers stepped every batch (a GAN's shape): two optimizer steps a batch."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.batches = 0

    @override
    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.batches += 1
        loss = nn.functional.cross_entropy(self(batch[0]), batch[1])
        for optimizer in self.optimizers():  # type: ignore[union-attr]
            optimizer.zero_grad()
        self.manual_backward(loss)
        for optimizer in self.optimizers():  # type: ignore[union-attr]
            optimizer.step()
        return loss

    @override
    def configure_optimizers(self) -> Any:
        first, second = self.net[0], self.net[2]
        return [torch.optim.SGD(first.parameters(), lr=0.1), torch.optim.SGD(second.parameters(), lr=0.1)]


def test_a_trial_under_manual_optimization_runs_its_steps_in_batches(tmp_path: Path) -> None:
    """``steps`` are batches: with two optimizer steps a batch, a trial bounded by ``max_steps`` ran half of them.

    An LR trial of 4 batches gave the search 2 losses to tell LRs apart by.
    """
    model = _TwoOptimizers()

    class _Trial(L.Callback):
        def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            with TrialSession(trainer, steps=4) as session:
                self.result = session.run(AsIs())

    trial = _Trial()
    tiny_trainer(tmp_path, max_steps=6, callbacks=[trial], limit_val_batches=0).fit(model)
    assert len(trial.result.losses) == 4
    assert len(trial.result.step_s) == 4
    assert model.batches == 4 + 3  # the trial's 4 batches, then the run's own 6 optimizer steps: 3 batches


class _StatefulLoader(torch.utils.data.DataLoader[Any]):
    """A loader that saves its position (as torchdata's ``StatefulDataLoader`` and litdata's loader do)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.position = 0

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = state["position"]


class _StatefulData(_Dropout):
    @override
    def train_dataloader(self) -> Any:
        return _StatefulLoader(self._data(0), batch_size=self.batch_size, shuffle=True)


def test_trials_mid_fit_on_a_stateful_train_loader_leave_its_position_to_the_run(tmp_path: Path) -> None:
    """The loop's state holds a stateful loader's position: the run's, not the trials'.

    Put back on the trial's loop, Lightning queued it for the trial's own loader, which has none to take, and the fit
    crashed ("The CombinedLoader has 0 stateful loaders"): preset's cool-down trial on torchdata's or litdata's loader.
    """
    runs = {}
    for name, trials in (("with", True), ("without", False)):
        L.seed_everything(0, verbose=False)
        runner = _MidFitTrials(replay=True)  # as the cool-down and LR trials run
        callbacks = ([runner] if trials else []) + [_EpochOneRecorder(tmp_path, name)]
        model = _StatefulData()
        tiny_trainer(tmp_path, max_epochs=3, callbacks=callbacks).fit(model)
        runs[name] = runner
    assert rank_records(tmp_path, "with", 1)[0] == rank_records(tmp_path, "without", 1)[0]
    assert [len(r.step_s) for r in runs["with"].results] == [3, 3, 3]


def test_a_stop_the_run_asked_for_before_the_trials_is_the_runs_after_them(tmp_path: Path) -> None:
    """A stop asked before a session (at fit start, or by EarlyStopping held back by ``min_epochs``) outlives it.

    The trials still run their steps; the session used to leave ``trainer.should_stop`` False, and the run trained.
    """

    class _StopThenTrial(L.Callback):
        def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            trainer.should_stop = True
            with TrialSession(trainer, steps=2) as session:
                self.result = session.run(AsIs())

    trial = _StopThenTrial()
    trainer = tiny_trainer(tmp_path, max_epochs=2, callbacks=[trial], limit_val_batches=0)
    trainer.fit(TinyClassifier())
    assert len(trial.result.losses) == 2
    assert trainer.global_step == 0
