"""LRFinder: LR trials (or a range test) through the trial mechanism raise a too-low LR, lower a too-high one."""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from conftest import RankWriter, TinyClassifier, callback_of, rank_records, tiny_trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy

from lightning_speedkit import LRFinder, WarmupScheduler
from lightning_speedkit.lr import param_group_lrs
from lightning_speedkit.lr_search import REFERENCE
from lightning_speedkit.lr_trial import Scaled
from lightning_speedkit.trials import Setting, TrialSession

FINDER = {"max_fraction": 1.0}  # the search may take the whole of these short fits
RANGE = {"method": "range", "max_fraction": 1.0}


def _model(lr: float) -> TinyClassifier:
    L.seed_everything(0, verbose=False)
    return TinyClassifier(lr=lr, optimizer="adam", num_samples=256, batch_size=16)


def _fit(tmp_path: Path, model: TinyClassifier, *callbacks: L.Callback, **kwargs: Any) -> L.Trainer:
    ckpt_path = kwargs.pop("ckpt_path", None)
    options: dict[str, Any] = {"max_epochs": 5, "limit_val_batches": 0, **kwargs}
    trainer = tiny_trainer(tmp_path, callbacks=list(callbacks), **options)
    trainer.fit(model, ckpt_path=ckpt_path)
    return trainer


class _FirstBatch(L.Callback):
    """Keeps the weights, optimizer state and LRs the first real training step starts from."""

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int) -> None:
        if not hasattr(self, "weights"):
            self.weights = [p.detach().clone() for p in pl_module.parameters()]
            self.state = dict(trainer.optimizers[0].state)
            self.lrs = param_group_lrs(trainer.optimizers)[0]
            self.batch = [t.clone() for t in batch]


@pytest.mark.parametrize(("lr", "direction"), [(1e-4, "raises"), (1.0, "lowers")])
def test_trials_correct_a_lr_100x_off(tmp_path: Path, lr: float, direction: str) -> None:
    """Adam at 1e-4 (100x too low for this task) is raised; at 1.0 (100x too high) it is lowered."""
    finder = LRFinder(**FINDER)
    trainer = _fit(tmp_path, _model(lr), finder)
    report = finder.report()
    assert report["probed"]
    assert report["method"] == "trials"
    assert (report["scale"] >= 10.0) if direction == "raises" else (report["scale"] <= 0.1), report["reason"]
    assert report["chosen_lr"] == pytest.approx(lr * report["scale"])
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(report["chosen_lr"])
    scales, losses = report["trials"]["scales"], report["trials"]["losses"]
    assert scales[0] == 0.0  # the reference trial
    assert report["scale"] in scales
    assert report["steps"] == sum(len(curve) for curve in losses)


def test_trials_keep_a_lr_that_is_about_right(tmp_path: Path) -> None:
    """Adam at 1e-2 on this task: no LR does three times its progress, so it is kept (a raise is not free)."""
    finder = LRFinder(**FINDER)
    trainer = _fit(tmp_path, _model(1e-2), finder)
    assert finder.report()["scale"] == 1.0, finder.report()["reason"]
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(1e-2)


def test_a_scale_found_for_one_lr_is_not_applied_to_another_in_a_later_run_or_fit(tmp_path: Path) -> None:
    """A remembered or carried-over scale holds only for the LR it was found from: another LR is searched again.

    A run at 1e-4 found x100; the next run at 1e-2 (the user fixed the LR) recalled x100 and trained at 1.0, and so
    did a second fit of the same finder.
    """
    _fit(tmp_path / "low", _model(1e-4), LRFinder(**FINDER))  # found and remembered: x100 or so
    later = LRFinder(**FINDER)
    trainer = _fit(tmp_path / "right", _model(1e-2), later)
    report = later.report()
    assert (report["source"], report["user_lr"], report["scale"]) == ("measured", 1e-2, 1.0), report["reason"]
    assert "does not hold" in report["memory_note"]
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(1e-2)
    again = _fit(tmp_path / "again", _model(1e-4), later)  # the same finder, a second fit at another LR
    assert later.report()["user_lr"] == 1e-4
    assert again.optimizers[0].param_groups[0]["lr"] == pytest.approx(1e-4 * later.report()["scale"])
    assert later.report()["scale"] >= 10.0


def test_short_sgd_job_at_a_lr_100x_too_low_gets_it_raised(tmp_path: Path) -> None:
    """SGD at 1e-5 for 10 epochs of 32 steps under preset(lr="auto"): the LR is raised at least 10x."""
    from lightning_speedkit import preset

    L.seed_everything(0, verbose=False)
    model = TinyClassifier(lr=1e-5, optimizer="sgd", num_samples=512, batch_size=16)
    trainer = preset(lr="auto", logger=False, verbose=False, default_root_dir=tmp_path, max_epochs=10,
                     enable_checkpointing=False, enable_progress_bar=False, limit_val_batches=0)  # fmt: skip
    trainer.fit(model)
    finder = callback_of(trainer, LRFinder)
    assert finder.report()["scale"] >= 10.0, finder.report()["reason"]
    assert trainer.optimizers[0].param_groups[0]["lr"] >= 1e-4


class _SkipsSome(TinyClassifier):
    """Skips one batch in five: its ``training_step`` returns None there (Lightning's way to skip a batch)."""

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        loss = super().training_step(batch, batch_idx)
        return None if batch_idx % 5 == 3 else loss


def test_batches_the_step_skips_are_left_out_of_every_trial(tmp_path: Path) -> None:
    """Adam at 1e-4 (100x too low) whose step skips a batch in five is raised, as without skips.

    The skipped steps are left out of every trial's losses, where they counted as a blow-up and sent the walk down.
    """
    L.seed_everything(0, verbose=False)
    finder = LRFinder(**FINDER)
    _fit(tmp_path, _SkipsSome(lr=1e-4, optimizer="adam", num_samples=256, batch_size=16), finder)
    report = finder.report()
    assert report["scale"] >= 10.0, report["reason"]
    curves = report["trials"]["losses"]
    assert all(math.isfinite(v) for curve in curves for v in curve)
    assert min(report["trials"]["scales"]) == 0.0  # the walk went up from the user's LR, not down
    assert report["steps"] > sum(len(curve) for curve in curves)  # the skipped steps ran, and were left out


class _ManualNoLoss(TinyClassifier):
    """Manual optimization whose ``training_step`` returns nothing (a GAN's usual form)."""

    def __init__(self) -> None:
        L.seed_everything(0, verbose=False)
        super().__init__(lr=1e-4, optimizer="adam", num_samples=256, batch_size=16)
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> None:
        optimizer: Any = self.optimizers()
        optimizer.zero_grad()
        self.manual_backward(super().training_step(batch, batch_idx))
        optimizer.step()


@pytest.mark.parametrize("options", [FINDER, RANGE], ids=["trials", "range"])
def test_a_step_that_returns_no_loss_keeps_the_lr_and_says_why(tmp_path: Path, options: dict[str, Any]) -> None:
    """No loss to compare LRs by: the user's LR is kept with that reason, after the reference trial alone."""
    finder = LRFinder(**options)
    with pytest.warns(UserWarning, match="returned no loss at any step of the search"):
        trainer = _fit(tmp_path, _ManualNoLoss(), finder)
    report = finder.report()
    assert report["scale"] == 1.0
    assert "returned no loss" in report["reason"]
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(1e-4)
    if options is FINDER:
        assert report["trials"]["scales"] == []
        assert 0 < report["steps"] <= 16  # one trial


class _NoLR(TinyClassifier):
    def configure_optimizers(self) -> torch.optim.Optimizer:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        for group in optimizer.param_groups:
            del group["lr"]
        return optimizer

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        optimizer_closure()  # the gradients only: an LR-free optimizer's step, as far as the finder is concerned


def test_an_optimizer_without_lr_is_left_as_it_is(tmp_path: Path) -> None:
    """No ``lr`` in the param groups (an LR-free optimizer): the finder says so and changes nothing."""
    finder = LRFinder(**FINDER)
    with pytest.warns(UserWarning, match="has no `lr` in its param groups"):
        _fit(tmp_path, _NoLR(num_samples=64, batch_size=16), finder, max_epochs=1)
    assert finder.report()["scale"] == 1.0
    assert finder.report()["source"] == "skipped"
    assert "no `lr`" in finder.report()["reason"]


@pytest.mark.parametrize(("lr", "direction"), [(1e-4, "raises"), (1.0, "lowers")])
def test_a_range_test_corrects_a_lr_100x_off(tmp_path: Path, lr: float, direction: str) -> None:
    """method="range": Adam at 1e-4 (100x too low) is raised; at 1.0 (100x too high) it is lowered."""
    finder = LRFinder(**RANGE)
    trainer = _fit(tmp_path, _model(lr), finder)
    report = finder.report()
    assert report["probed"]
    assert (report["scale"] > 2.0) if direction == "raises" else (report["scale"] < 0.5), report["reason"]
    assert report["chosen_lr"] == pytest.approx(lr * report["scale"])
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(report["chosen_lr"])
    assert len(report["curve"]["lrs"]) == report["steps"] == len(report["curve"]["losses"])
    if direction == "lowers":
        assert report["steps"] < finder.steps  # the loss blew up and the test stopped early


def test_after_the_search_only_the_lrs_differ(tmp_path: Path) -> None:
    """Weights, optimizer state and the first batch equal a run without the finder; the LRs are scaled."""
    plain, searched = _FirstBatch(), _FirstBatch()
    _fit(tmp_path / "plain", _model(1e-4), plain, max_epochs=1)
    finder = LRFinder(**FINDER)
    _fit(tmp_path / "searched", _model(1e-4), finder, searched)
    for a, b in zip(plain.weights, searched.weights, strict=True):
        assert torch.equal(a, b)
    assert plain.state == searched.state == {}
    for a, b in zip(plain.batch, searched.batch, strict=True):
        assert torch.equal(a, b)
    assert searched.lrs == pytest.approx([1e-4 * finder.report()["scale"]])


def test_the_warmup_ramps_to_the_found_peak(tmp_path: Path) -> None:
    """With a WarmupScheduler, the rescale goes through it: the base LR it warms up to is the found LR."""
    finder, warmup = LRFinder(**FINDER), WarmupScheduler(warmup=10, decay="constant")
    trainer = _fit(tmp_path, _model(1e-4), finder, warmup)
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(finder.report()["chosen_lr"])


def test_a_resume_does_not_search_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A resumed fit keeps the saved scale (its LRs come back with the optimizer) and runs no range test."""
    ckpt = ModelCheckpoint(tmp_path / "ckpt", save_top_k=-1, filename="{epoch}")
    first = LRFinder(**FINDER)
    _fit(tmp_path, _model(1e-4), first, ckpt, enable_checkpointing=True, max_epochs=4)
    monkeypatch.setattr(TrialSession, "run", lambda *a, **k: pytest.fail("searched again on resume"))
    resumed = LRFinder(**FINDER)
    trainer = _fit(tmp_path, _model(1e-4), resumed, ckpt_path=str(tmp_path / "ckpt" / "epoch=2.ckpt"))
    assert resumed.report() == {**first.report(), "source": "resumed"}
    assert first.report()["source"] == "measured"
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(first.report()["chosen_lr"])


def test_a_short_run_skips_the_search(tmp_path: Path) -> None:
    """A search longer than max_fraction of the run is skipped: the LR stays, and the report says why."""
    finder = LRFinder()
    trainer = _fit(tmp_path, _model(1e-4), finder, max_epochs=1)
    assert finder.report()["scale"] == 1.0
    assert finder.report()["reason"].startswith("skipped: three 6-step LR trials (a reference, your LR, ten times it)")
    assert finder.report()["reason"].endswith("is more than 25% of the 16 steps left")
    range_test = LRFinder(method="range", max_fraction=0.15)
    _fit(tmp_path, _model(1e-4), range_test, max_epochs=2)
    assert range_test.report()["reason"].startswith("skipped: a 60-step range test is more than 15% of the 32 steps")
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(1e-4)


class _CountsBackward(TinyClassifier):
    """Counts the backward passes its hook runs; ``manual`` steps its optimizer itself (manual optimization).

    Its LR schedule steps every step (automatic optimization), as a warmup or one-cycle schedule does.
    """

    def __init__(self, manual: bool = False) -> None:
        L.seed_everything(0, verbose=False)
        super().__init__(lr=0.05, optimizer="adam", num_samples=256, batch_size=16)
        self.automatic_optimization, self.backwards = not manual, 0

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        self.backwards += 1
        super().backward(loss, *args, **kwargs)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        if not self.automatic_optimization:
            optimizer: Any = self.optimizers()
            optimizer.zero_grad()
            self.manual_backward(loss)
            optimizer.step()
        return loss

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.Adam(self.parameters(), lr=self.lr)
        schedule = torch.optim.lr_scheduler.StepLR(optimizer, 2, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


class _LRZero(Setting):
    """LR 0 with full steps: what the reference trial computes the long way."""

    name = "LR 0, full steps"

    def apply(self, trainer: L.Trainer) -> None:
        for group in trainer.optimizers[0].param_groups:
            group["was"], group["lr"] = group["lr"], 0.0

    def revert(self, trainer: L.Trainer) -> None:
        for group in trainer.optimizers[0].param_groups:
            group["lr"] = group.pop("was")


class _References(L.Callback):
    def on_fit_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        self.backwards, self.losses = [], []
        with TrialSession(trainer, 5, warmup=0, replay=True) as session:
            for setting in (Scaled(REFERENCE), _LRZero()):
                before = pl_module.backwards
                self.losses.append(session.run(setting).losses)
                self.backwards.append(pl_module.backwards - before)
        self.hooks = {name for name in ("backward", "optimizer_step", "lr_scheduler_step") if name in vars(pl_module)}


@pytest.mark.parametrize("manual", [False, True])
def test_the_reference_trial_skips_backward_and_step_under_automatic_optimization(tmp_path: Path, manual: bool) -> None:
    """At LR 0 no weight moves, so the reference trial runs forward passes only.

    The same losses as LR 0 with full steps, no backward pass (the module's hooks put back afterwards), and no LR
    schedule stepped before any optimizer step (torch would warn). Under manual optimization, where the user's step
    runs its own backward, the reference trial runs full steps.
    """
    references = _References()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _fit(tmp_path, _CountsBackward(manual), references, max_epochs=1)
    assert not [w for w in caught if "lr_scheduler.step()" in str(w.message)]
    assert references.losses[0] == references.losses[1]
    assert references.backwards == ([5, 5] if manual else [0, 5])
    assert references.hooks == set()


class _LambdaSchedule(TinyClassifier):
    """A constant `LambdaLR` stepped every step: it computes each step's LR from its base LRs."""

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.Adam(self.parameters(), lr=self.lr)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def test_a_trial_keeps_its_scale_under_a_schedule_computed_from_base_lrs(tmp_path: Path) -> None:
    """Under a `LambdaLR` stepped every step, the x10 trial trains every step at ten times the LR, not only its first.

    Its schedule's base LRs are scaled with the param groups' (they were not, and the schedule's first step put the
    unscaled LR back: the trials then compared nearly the same LRs); afterwards the run's LRs are as they were.
    """

    class Trials(L.Callback):
        def on_fit_start(self, trainer: L.Trainer, pl_module: Any) -> None:
            self.trials = [Scaled(1.0), Scaled(10.0)]  # each keeps its steps' LRs
            with TrialSession(trainer, 4, warmup=0, replay=True) as session:
                for setting in self.trials:
                    session.run(setting)
            self.after = trainer.lr_scheduler_configs[0].scheduler.base_lrs + param_group_lrs(trainer.optimizers)[0]
            self.defaults = trainer.optimizers[0].defaults["lr"]

    trials = Trials()
    _fit(tmp_path, _LambdaSchedule(lr=0.01, optimizer="adam", num_samples=256, batch_size=16), trials, max_epochs=1)
    assert trials.trials[0].lrs == pytest.approx([0.01] * 4)
    assert trials.trials[1].lrs == pytest.approx([0.1] * 4)
    assert trials.after == [0.01, 0.01]
    assert trials.defaults == 0.01


class _Scheduled(TinyClassifier):
    """Adam with the user's own schedule, stepped every step.

    ``"warmup"`` (`LinearLR` from a tenth over 40 steps), ``"onecycle"`` (`OneCycleLR` peaking at ``lr``: its LR
    starts at ``lr / 25`` and rises), ``"cosine"`` or ``"none"`` (the optimizer alone).
    """

    def __init__(self, schedule: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.schedule = schedule

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.Adam(self.parameters(), lr=self.lr)
        total = int(self.trainer.estimated_stepping_batches)
        if self.schedule == "none":
            return optimizer
        if self.schedule == "warmup":
            schedule: Any = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.1, total_iters=40)
        elif self.schedule == "onecycle":
            schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=self.lr, total_steps=total)
        else:
            schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def _scheduled(schedule: str, lr: float = 1e-4) -> _Scheduled:
    L.seed_everything(0, verbose=False)
    return _Scheduled(schedule, lr=lr, optimizer="adam", num_samples=256, batch_size=16)


@pytest.mark.parametrize("method", ["trials", "range"])
def test_a_warmup_schedule_at_fit_start_skips_the_search(tmp_path: Path, method: str) -> None:
    """The user's scheduler starts the LR at a tenth of what it was given (a warmup): no search, and a warning.

    The run's LRs are the user's schedule's: a search would try the warmup's first LR and scale the whole schedule by
    it (x10 on an MLP under a linear warmup, before this check).
    """
    finder = LRFinder(method=method, max_fraction=1.0)
    with pytest.warns(UserWarning, match="a warmup"):
        trainer = _fit(tmp_path, _scheduled("warmup"), finder, max_epochs=3)
    report = finder.report()
    assert (report["source"], report["scale"], report["probed"]) == ("skipped", 1.0, False)
    assert "starts the LR at 1e-05, below the 0.0001 it was given" in report["reason"]
    assert trainer.lr_scheduler_configs[0].scheduler.base_lrs == [1e-4]
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(1e-4)  # 48 steps: past its 40-step warmup


def test_a_schedule_that_rises_under_the_trial_at_your_lr_keeps_it(tmp_path: Path) -> None:
    """`OneCycleLR` rises under the trial at the user's LR: the walk stops after it and the LR is kept.

    Its LR starts at the ``initial_lr`` it records, so only the trial shows the rise; before this check the trials
    measured the rise as the user's LR and raised it tenfold, peak and all.
    """
    finder = LRFinder(**FINDER)
    with pytest.warns(UserWarning, match="raised the LR from"):
        trainer = _fit(tmp_path, _scheduled("onecycle"), finder, max_epochs=3)
    report = finder.report()
    assert (report["scale"], report["probed"]) == (1.0, True)
    assert "a warmup or a cycle" in report["reason"]
    assert report["trials"]["scales"] == [0.0, 1.0]  # the reference and the user's LR, no higher one
    assert trainer.optimizers[0].param_groups[0]["max_lr"] == pytest.approx(1e-4)


class _FrozenFirst(_Scheduled):
    """`_Scheduled`, but the first layer is its own first param group at LR 0 (a backbone frozen by its LR)."""

    def __init__(self, schedule: str, head_lr: float | None = None, **kwargs: Any) -> None:
        super().__init__(schedule, **kwargs)
        self.head_lr = self.lr if head_lr is None else head_lr

    def configure_optimizers(self) -> Any:
        groups = [{"params": self.net[0].parameters(), "lr": 0.0}, {"params": self.net[2].parameters()}]
        optimizer = torch.optim.Adam(groups, lr=self.head_lr)
        if self.schedule == "none":
            return optimizer
        total = int(self.trainer.estimated_stepping_batches)
        cycle = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=[0.0, self.head_lr], total_steps=total)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": cycle, "interval": "step"}}


def _frozen_first(schedule: str, head_lr: float = 1e-4) -> _FrozenFirst:
    L.seed_everything(0, verbose=False)
    return _FrozenFirst(schedule, head_lr=head_lr, lr=head_lr, optimizer="adam", num_samples=256, batch_size=16)


@pytest.mark.parametrize("method", ["trials", "range"])
def test_a_first_param_group_at_lr_zero_does_not_stand_for_the_run(tmp_path: Path, method: str) -> None:
    """The run's LR is the first non-zero group's, the frozen group stays at 0 and the head's LR is scaled.

    A range test divided by the frozen group's 0 and crashed; both methods reported 0 as the user's and chosen LR.
    """
    finder = LRFinder(method=method, max_fraction=1.0)
    trainer = _fit(tmp_path, _frozen_first("none"), finder)
    report = finder.report()
    assert report["user_lr"] == pytest.approx(1e-4)
    scales = report["trials"]["scales"] if method == "trials" else [lr / 1e-4 for lr in report["curve"]["lrs"]]
    assert max(scales) >= 10.0  # the head's LR was tried higher: the curve is not a row of zeros
    assert report["chosen_lr"] == pytest.approx(1e-4 * report["scale"])
    assert param_group_lrs(trainer.optimizers)[0] == [0.0, pytest.approx(report["chosen_lr"])]


def test_a_cycle_rising_in_a_group_after_a_frozen_one_is_seen(tmp_path: Path) -> None:
    """`OneCycleLR` over a frozen first group and the head: the trial at the user's LR sees the head's rise.

    It read the frozen group's flat 0, saw no rise and raised the whole cycle x100; the LR is kept now.
    """
    finder = LRFinder(**FINDER)
    with pytest.warns(UserWarning, match="raised the LR from"):
        trainer = _fit(tmp_path, _frozen_first("onecycle"), finder, max_epochs=3)
    assert (finder.report()["scale"], finder.report()["probed"]) == (1.0, True)
    assert [g["max_lr"] for g in trainer.optimizers[0].param_groups] == [0.0, pytest.approx(1e-4)]


def test_every_param_group_at_lr_zero_is_left_as_it_is(tmp_path: Path) -> None:
    """No LR to scale (every group at 0): the finder says so, with a warning, and runs nothing."""
    finder = LRFinder(**FINDER)
    with pytest.warns(UserWarning, match="every param group's LR is 0"):
        _fit(tmp_path, _frozen_first("none", head_lr=0.0), finder, max_epochs=1)
    assert (finder.report()["source"], finder.report()["scale"], finder.report()["probed"]) == ("skipped", 1.0, False)


def test_a_range_test_skips_a_cycle_it_cannot_see(tmp_path: Path) -> None:
    """A range test sets every step's LR, so it cannot see `OneCycleLR` rise: it skips the search, with a warning."""
    finder = LRFinder(**RANGE)
    with pytest.warns(UserWarning, match="OneCycleLR raises the LR after fit start"):
        trainer = _fit(tmp_path, _scheduled("onecycle"), finder, max_epochs=3)
    assert (finder.report()["source"], finder.report()["scale"]) == ("skipped", 1.0)
    assert trainer.optimizers[0].param_groups[0]["max_lr"] == pytest.approx(1e-4)


def test_a_decision_remembered_without_a_schedule_is_not_applied_under_one(tmp_path: Path) -> None:
    """The LR scale found for a job with no scheduler is remembered, and not applied under a cosine schedule.

    The same model under a schedule is another job (the fingerprint holds the schedulers' classes): it searches afresh.
    """
    first = LRFinder(**FINDER)
    _fit(tmp_path / "a", _scheduled("none"), first)
    assert first.report()["source"] == "measured"
    again = LRFinder(**FINDER)
    _fit(tmp_path / "b", _scheduled("none"), again)
    assert again.report()["source"] == "remembered"
    scheduled = LRFinder(**FINDER)
    _fit(tmp_path / "c", _scheduled("cosine"), scheduled)
    assert scheduled.report()["source"] == "measured"


def test_a_decaying_schedule_is_searched_and_scaled_whole(tmp_path: Path) -> None:
    """A cosine schedule starts at the user's LR, so the trials try it: Adam at 1e-4 (100x too low) is raised.

    The schedule's base LRs are scaled with it.
    """
    finder = LRFinder(**FINDER)
    trainer = _fit(tmp_path, _scheduled("cosine"), finder)
    report = finder.report()
    assert report["scale"] >= 10.0, report["reason"]
    assert trainer.lr_scheduler_configs[0].scheduler.base_lrs == [pytest.approx(1e-4 * report["scale"])]


class _Plateau(L.LightningModule):
    """Loss ``(1 - w)^2`` from ``w = 0``, reported to three decimals, at SGD 5e-6: a loss on a plateau.

    Each step lowers the loss by about 2e-5 at the user's LR, 2e-4 at ten times it, 2e-3 at a hundred times: over
    3 steps no trial moves the reported loss; over 12, ten and a hundred times the LR do.
    """

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(()))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        raw = (1 - self.w) ** 2
        return raw + ((raw * 1000).round() / 1000 - raw).detach()  # the value rounded, the gradient the raw loss's

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=5e-6)

    def train_dataloader(self) -> torch.utils.data.DataLoader[Any]:
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(100, 1)), batch_size=1)


@pytest.mark.parametrize("max_scale", [100.0, 1000.0])
def test_on_a_plateau_the_longer_trials_walk_on_and_raise_the_lr(tmp_path: Path, max_scale: float) -> None:
    """No LR moves the loss in 3 steps; the longer trials go on up past ten times the LR and raise it.

    The longer trials used to rerun only the reference, the user's LR and ten times it, so the edge was always ten
    times and the LR always kept: a probe that could not change the decision. A tenth of the 500 steps holds four
    12-step trials, so the walk stops at x100, before x1000, which it would try under either bound (a decade over
    ``max_scale=100`` tells whether x100 is the edge).
    """
    finder = LRFinder(trial_steps=3, max_scale=max_scale)
    trainer = tiny_trainer(tmp_path, callbacks=[finder], max_epochs=5, limit_val_batches=0)
    trainer.fit(_Plateau())
    report = finder.report()
    cut = " (x1000 not tried: the search's share of the run was spent)"
    assert report["reason"].endswith(f"(tried again over 12 steps: no LR moved the loss in 3){cut}")
    assert report["trials"]["scales"] == [0.0, 1.0, 10.0, 100.0]
    assert report["scale"] == 10.0, report["reason"]
    assert report["steps"] == 3 * 3 + 4 * 12
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(5e-5)


class _StopAfter(L.Callback):
    def __init__(self, steps: int) -> None:
        self.steps = steps

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        trainer.should_stop = trainer.global_step >= self.steps


def test_a_run_with_no_step_limit_searches_as_far_as_the_scales_go(tmp_path: Path) -> None:
    """``max_epochs=-1``: the search's share of infinite steps left is infinite; it walks a decade over ``max_scale``.

    That is x1000 for the default 100; x1000 still helps there, so x100, a decade below that edge, is chosen.
    """
    finder = LRFinder(trial_steps=3)
    trainer = tiny_trainer(tmp_path, callbacks=[finder, _StopAfter(5)], max_epochs=-1, limit_val_batches=0)
    trainer.fit(_Plateau())
    report = finder.report()
    assert report["trials"]["scales"] == [0.0, 1.0, 10.0, 100.0, 1000.0], report["reason"]
    assert report["scale"] == 100.0
    assert report["steps"] == 3 * 3 + 4 * 12 + 12


def test_a_max_scale_under_a_decade_tries_no_lr_above_the_users(tmp_path: Path) -> None:
    """``max_scale=5``: only x1 can be chosen up there, so no trial runs at x10 (it could not change the choice).

    The search costs the reference and the user's LR, and its price (the skip rule's) counts two trials, not three.
    """
    finder = LRFinder(trial_steps=3, max_scale=5.0)
    trainer = tiny_trainer(tmp_path, callbacks=[finder, _StopAfter(5)], max_epochs=-1, limit_val_batches=0)
    trainer.fit(_Plateau())
    report = finder.report()
    assert report["trials"]["scales"] == [0.0, 1.0], report["reason"]
    assert (report["scale"], report["steps"]) == (1.0, 2 * 3)
    assert finder._price(100.0) == (6, "two 3-step LR trials (a reference, your LR)")
    assert LRFinder(trial_steps=3, max_scale=10.0)._price(100.0)[0] == 9


def _rank_lr(trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
    """Each rank's LRFinder scale, LR and weights (written by `RankWriter`)."""
    report = callback_of(trainer, LRFinder).report()
    record = {"scale": report["scale"], "lengths": [len(losses) for losses in report["trials"]["losses"]]}
    record["lr"] = trainer.optimizers[0].param_groups[0]["lr"]
    record["weights"] = [x for p in pl_module.parameters() for x in p.detach().flatten().tolist()]
    return record


@pytest.mark.slow
@pytest.mark.ddp
@pytest.mark.parametrize("lr", [1e-4, 1.0])
def test_ddp_ranks_apply_the_same_scale(tmp_path: Path, lr: float) -> None:
    """2-process DDP: rank zero's curve decides, both ranks apply the same LR and end with the same weights.

    At 1.0 (100x too high) the trials that break stop at the step rank zero's loss broke, on both ranks alike.
    """
    strategy = DDPStrategy(start_method="spawn", process_group_backend="gloo")
    _fit(
        tmp_path,
        _model(lr),
        LRFinder(**FINDER),
        RankWriter(tmp_path, _rank_lr),
        strategy=strategy,
        devices=2,
        max_epochs=8,
    )
    ranks = rank_records(tmp_path)
    assert ranks[0]["scale"] == ranks[1]["scale"]
    assert (ranks[0]["scale"] > 1.0) if lr < 1.0 else (ranks[0]["scale"] < 1.0)
    assert ranks[0]["lengths"] == ranks[1]["lengths"]
    assert (min(ranks[0]["lengths"]) < max(ranks[0]["lengths"])) == (lr == 1.0)  # a broken trial stopped early
    assert ranks[0]["lr"] == ranks[1]["lr"]
    assert ranks[0]["weights"] == pytest.approx(ranks[1]["weights"], abs=1e-6)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"steps": 2}, "`steps`"),
        ({"method": "grid"}, "`method` must be one of 'trials', 'range', got 'grid'"),
        ({"trial_steps": 2}, "`trial_steps` must be an int >= 3, got 2"),
        ({"trial_steps": 10**6}, "`trial_steps` must be at most 100000"),
        ({"start_factor": 0}, "`start_factor`"),
        ({"end_factor": -1.0}, "`end_factor`"),
        ({"start_factor": 10.0, "end_factor": 1.0}, "`end_factor`"),
        ({"min_scale": 0.0}, "`min_scale`"),
        ({"min_scale": 2.0, "max_scale": 1.0}, "`max_scale`"),
        ({"divergence": 1.0}, "`divergence`"),
        ({"smoothing": 1.0}, "`smoothing`"),
        ({"max_fraction": 0.0}, "`max_fraction`"),
        ({"min_signal": -1.0}, "`min_signal`"),
    ],
)
def test_bad_arguments_are_refused(kwargs: dict[str, Any], match: str) -> None:
    """Non-positive factors and the other bad arguments get a ValueError naming the argument."""
    with pytest.raises(ValueError, match=match):
        LRFinder(**kwargs)
