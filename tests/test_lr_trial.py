"""The LR search's trial settings: a scaled LR for one trial, and a trial that broke stops at the step it broke."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from conftest import TinyClassifier, tiny_trainer

import lightning_speedkit.lr_finder as lr_finder
from lightning_speedkit import LRFinder
from lightning_speedkit.lr_search import REFERENCE, broke, broke_ceiling
from lightning_speedkit.lr_trial import Scaled, _StopWhen
from lightning_speedkit.trials import TrialSession

STEPS = 8


def _model(lr: float) -> TinyClassifier:
    L.seed_everything(0, verbose=False)
    return TinyClassifier(lr=lr, optimizer="adam", num_samples=256, batch_size=16)


class _Trials(L.Callback):
    """At fit start: the reference trial, then the user's LR with the ceiling the reference gives and without one."""

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        with TrialSession(trainer, STEPS, warmup=0, replay=True) as session:
            self.reference = session.run(Scaled(REFERENCE)).losses
            self.ceiling = broke_ceiling(self.reference)
            self.stopped = session.run(Scaled(1.0, self.ceiling)).losses
            self.full = session.run(Scaled(1.0)).losses


def test_a_trial_that_breaks_stops_at_the_step_its_loss_goes_over_the_ceiling(tmp_path: Path) -> None:
    """Adam at LR 5 blows the loss up: the trial ends at the first step over the reference's ceiling.

    Its losses up to there are the full trial's (the same batches from the same weights), and it is judged broken
    as the full trial is; a trial with no ceiling runs all its steps.
    """
    trials = _Trials()
    tiny_trainer(tmp_path, callbacks=[trials], max_epochs=1, limit_val_batches=0).fit(_model(5.0))
    stopped, full = trials.stopped, trials.full
    assert len(full) == STEPS
    assert 1 < len(stopped) < STEPS
    assert stopped == full[: len(stopped)]
    assert stopped[-1] > trials.ceiling
    assert all(loss <= trials.ceiling for loss in stopped[1:-1])
    assert broke({REFERENCE: trials.reference, 1.0: stopped}, 1.0)
    assert broke({REFERENCE: trials.reference, 1.0: full}, 1.0)


def test_a_trial_that_does_not_break_runs_all_its_steps(tmp_path: Path) -> None:
    """Adam at 1e-3 never goes over the ceiling: the trial with one is the trial without."""
    trials = _Trials()
    tiny_trainer(tmp_path, callbacks=[trials], max_epochs=1, limit_val_batches=0).fit(_model(1e-3))
    assert len(trials.stopped) == STEPS
    assert trials.stopped == trials.full


def test_the_search_decides_as_it_did_when_broken_trials_ran_to_their_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At Adam 1.0 (100x too high) the search lowers the LR to the same scale in fewer steps: broken trials stop."""
    decisions = []
    for stop in (True, False):
        if not stop:
            monkeypatch.setattr(lr_finder, "broke_ceiling", lambda reference: math.inf)
        finder = LRFinder(max_fraction=1.0, remember=False)
        tiny_trainer(tmp_path, callbacks=[finder], max_epochs=5, limit_val_batches=0).fit(_model(1.0))
        report = finder.report()
        decisions.append((report["scale"], report["steps"], report["trials"]))
    (scale, steps, tried), (full_scale, full_steps, full_tried) = decisions
    assert scale == full_scale <= 0.1
    assert tried["scales"] == full_tried["scales"]
    assert steps < full_steps
    assert steps == sum(len(losses) for losses in tried["losses"])
    for losses, full in zip(tried["losses"], full_tried["losses"], strict=True):
        assert losses == full[: len(losses)]


def test_stop_when_asks_its_test_after_every_step_with_a_loss() -> None:
    """A trial's stop callback hands every loss so far to its test after each step that gave one.

    A step without a loss (a skipped batch) is not tested, yet its verdict is still broadcast: every rank takes part
    in each step's broadcast, whichever rank skipped its batch.
    """
    seen: list[list[float]] = []
    stop = _StopWhen(lambda losses: bool(seen.append(list(losses))))
    broadcasts: list[Any] = []

    class _Strategy:
        def broadcast(self, value: Any, src: int = 0) -> Any:
            broadcasts.append(value)
            return value

    class _Trainer:
        strategy = _Strategy()
        should_stop = False

    for outputs in ({"loss": torch.tensor(1.5)}, None, {"loss": torch.tensor(2.0)}):
        stop.on_train_batch_end(_Trainer(), None, outputs, None, 0)  # type: ignore[arg-type]
    assert seen == [[1.5], [1.5, 2.0]]
    assert broadcasts == [False, False, False]


class _ManualLambda(TinyClassifier):
    """Manual optimization that steps a per-step ``LambdaLR`` itself (the schedule computes the LR from base LRs)."""

    def __init__(self) -> None:
        super().__init__(lr=0.05, optimizer="adam", num_samples=256, batch_size=16)
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        optimizer: Any = self.optimizers()
        optimizer.zero_grad()
        self.manual_backward(loss)
        optimizer.step()
        schedule: Any = self.lr_schedulers()
        schedule.step()
        return loss

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.Adam(self.parameters(), lr=self.lr)
        return [optimizer], [torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)]


class _Weights(L.Callback):
    def __init__(self) -> None:
        self.after: list[list[torch.Tensor]] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self.after.append([p.detach().clone() for p in pl_module.parameters()])


class _ReferenceSeen(Scaled):
    def __init__(self) -> None:
        super().__init__(REFERENCE)
        self.seen = _Weights()

    def callbacks(self) -> list[L.Callback]:
        return [*super().callbacks(), self.seen]


class _Reference(L.Callback):
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.weights = [p.detach().clone() for p in pl_module.parameters()]
        self.setting = _ReferenceSeen()
        with TrialSession(trainer, 4, warmup=0) as session:
            session.run(self.setting)


def test_under_manual_optimization_the_reference_trial_stays_at_lr_0(tmp_path: Path) -> None:
    """Under manual optimization with a per-step ``LambdaLR``, the reference trial moves no weight.

    The user's step steps the schedule, which puts the base LR back after every step; every LR is set to 0 right
    before each optimizer step.
    """
    reference = _Reference()
    L.seed_everything(0, verbose=False)
    tiny_trainer(tmp_path, callbacks=[reference], max_epochs=1, limit_val_batches=0).fit(_ManualLambda())
    assert len(reference.setting.seen.after) == 4
    for weights in reference.setting.seen.after:
        assert all(torch.equal(a, b) for a, b in zip(reference.weights, weights, strict=True))
