from __future__ import annotations

import csv
import itertools
import json
import math
import pickle
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from conftest import FixedStep, RankWriter, TinyClassifier, callback_of, rank_records, tiny_trainer
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch.optim import lr_scheduler as sched
from typing_extensions import override

from lightning_speedkit import preset
from lightning_speedkit.cooldown import TRIAL_Z
from lightning_speedkit.warmup import WarmupScheduler, warmup_factor

BASE_LR = 0.1  # TinyClassifier's default
STEPS_PER_EPOCH = 8  # 64 samples, batch 8


class LRRecorder(Callback):
    """Records (global_step, optimizer index, LR of every group) inside every optimizer step."""

    def __init__(self, out: Path | None = None) -> None:
        self.out = out
        self.steps: list[tuple[int, int, list[float]]] = []

    @override
    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        """Record the LRs the step is about to use."""
        index = next(i for i, opt in enumerate(trainer.optimizers) if opt is optimizer)
        self.steps.append((trainer.global_step, index, [float(g["lr"]) for g in optimizer.param_groups]))

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Write the record to `out` (one file per rank)."""
        if self.out is not None:
            (self.out / f"lrs_rank{trainer.global_rank}.json").write_text(json.dumps(self.steps))

    def lrs(self) -> list[float]:
        """The first group's LR at each step."""
        return [lrs[0] for _, _, lrs in self.steps]


class ScheduledClassifier(TinyClassifier):
    """TinyClassifier whose `configure_optimizers` also returns a user scheduler."""

    def __init__(self, scheduler: str = "step", interval: str = "step") -> None:
        super().__init__()
        self.scheduler, self.interval = scheduler, interval

    @override
    def configure_optimizers(self) -> Any:
        """SGD plus StepLR(3, 0.5) or ExponentialLR(0.8) at the given interval."""
        opt = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        s = sched.StepLR(opt, step_size=3, gamma=0.5) if self.scheduler == "step" else sched.ExponentialLR(opt, 0.8)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": s, "interval": self.interval}}


def user_lr(step: int, scheduler: str = "step", interval: str = "step") -> float:
    """The LR the user's own schedule gives at optimizer step `step`."""
    t = step if interval == "step" else step // STEPS_PER_EPOCH
    return BASE_LR * 0.5 ** (t // 3) if scheduler == "step" else BASE_LR * 0.8**t


def fit(
    tmp_path: Path, model: L.LightningModule, *callbacks: Callback, ckpt_path: str | None = None, **kwargs: Any
) -> L.Trainer:
    """Fit `model` on a quiet CPU Trainer without validation."""
    trainer = tiny_trainer(tmp_path, callbacks=list(callbacks), limit_val_batches=0, **kwargs)
    trainer.fit(model, ckpt_path=ckpt_path)
    return trainer


# ---------------------------------------------------------------- the pure function


@pytest.mark.parametrize(
    ("step", "warmup_steps", "total_steps", "decay", "min_lr_ratio", "start_factor", "expected"),
    [
        (0, 4, 10, "cosine", 0.0, 0.0, 0.0),
        (2, 4, 10, "cosine", 0.0, 0.0, 0.5),
        (0, 4, 10, "cosine", 0.0, 0.2, 0.2),
        (4, 4, 10, "cosine", 0.0, 0.0, 1.0),
        (7, 4, 10, "cosine", 0.0, 0.0, 0.5),
        (7, 4, 10, "cosine", 0.2, 0.0, 0.6),
        (10, 4, 10, "cosine", 0.1, 0.0, 0.1),
        (50, 4, 10, "cosine", 0.1, 0.0, 0.1),
        (7, 4, 10, "linear", 0.0, 0.0, 0.5),
        (10, 4, 10, "linear", 0.3, 0.0, 0.3),
        (9, 4, 10, "constant", 0.5, 0.0, 1.0),
        (10**6, 4, None, "constant", 0.0, 0.0, 1.0),
        (0, 0, 10, "cosine", 0.0, 0.0, 1.0),
        (3, 10, 10, "linear", 0.0, 0.5, 0.65),
    ],
)
def test_warmup_factor_table(
    step: int,
    warmup_steps: int,
    total_steps: int | None,
    decay: str,
    min_lr_ratio: float,
    start_factor: float,
    expected: float,
) -> None:
    """Linear warmup from `start_factor`, then the decay to `min_lr_ratio`, held past `total_steps`."""
    got = warmup_factor(step, warmup_steps, total_steps, decay, min_lr_ratio, start_factor)
    assert got == pytest.approx(expected)


def _torch_curve(scheduler: str, warmup_steps: int, total_steps: int, min_lr_ratio: float, start: float) -> list[float]:
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=BASE_LR)
    warm = sched.LinearLR(opt, start_factor=start, total_iters=warmup_steps)
    if scheduler == "cosine":
        decay: Any = sched.CosineAnnealingLR(opt, T_max=total_steps - warmup_steps, eta_min=BASE_LR * min_lr_ratio)
    else:
        decay = sched.LinearLR(opt, start_factor=1.0, end_factor=min_lr_ratio, total_iters=total_steps - warmup_steps)
    s = sched.SequentialLR(opt, [warm, decay], milestones=[warmup_steps])
    lrs = []
    for _ in range(total_steps + 1):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        s.step()
    return lrs


@pytest.mark.filterwarnings("ignore::UserWarning")  # SequentialLR passes an epoch to step(): deprecated in torch
@pytest.mark.parametrize("decay", ["cosine", "linear"])
@pytest.mark.parametrize(
    ("warmup_steps", "total_steps", "min_lr_ratio", "start"), [(5, 20, 0.0, 0.1), (3, 40, 0.2, 0.5)]
)
def test_warmup_factor_matches_torch_sequential_lr(
    decay: str, warmup_steps: int, total_steps: int, min_lr_ratio: float, start: float
) -> None:
    """The curve equals torch's SequentialLR(LinearLR, CosineAnnealingLR or LinearLR) step for step."""
    expected = _torch_curve(decay, warmup_steps, total_steps, min_lr_ratio, start)
    ours = [
        BASE_LR * warmup_factor(k, warmup_steps, total_steps, decay, min_lr_ratio, start) for k in range(len(expected))
    ]
    assert ours == pytest.approx(expected, rel=1e-6, abs=1e-12)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"warmup_steps": -1}, "`warmup_steps` must be a non-negative int, got -1"),
        ({"warmup_steps": 11}, "`warmup_steps` must not exceed `total_steps` \\(10\\), got 11"),
        ({"total_steps": 0}, "`total_steps` must be a positive int or None, got 0"),
        ({"total_steps": None}, "`total_steps` is needed for decay='wsd', got None"),
        ({"decay": "exp"}, "`decay` must be one of 'wsd', 'constant', 'cosine', 'linear', got 'exp'"),
        ({"cooldown": 1.0}, "`cooldown` must be a fraction of the budget in \\[0, 1\\), got 1.0"),
        ({"cooldown": -0.1}, "`cooldown` must be a fraction of the budget in \\[0, 1\\), got -0.1"),
        ({"time_fraction": -1.0}, "`time_fraction` must be a number >= 0 or None, got -1.0"),
        ({"min_lr_ratio": 1.5}, "`min_lr_ratio` must be in \\[0, 1\\], got 1.5"),
        ({"start_factor": -0.1}, "`start_factor` must be in \\[0, 1\\], got -0.1"),
        ({"step": -2}, "`step` must be a non-negative int, got -2"),
    ],
)
def test_warmup_factor_rejects_bad_arguments(kwargs: dict[str, Any], match: str) -> None:
    """Each out-of-range argument raises ValueError naming the argument and its value."""
    arguments: dict[str, Any] = {"step": 0, "warmup_steps": 2, "total_steps": 10, **kwargs}
    with pytest.raises(ValueError, match=match):
        warmup_factor(**arguments)


# ---------------------------------------------------------------- the callback: arguments and state


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"warmup": -3}, "`warmup` must be an int >= 0 .* got -3"),
        ({"warmup": 1.0}, "`warmup` must be .* a float in \\(0, 1\\) .* got 1.0"),
        ({"warmup": 0.0}, "`warmup` must be .* got 0.0"),
        ({"warmup": True}, "`warmup` must be .* got True"),
        ({"warmup": 20, "total_steps": 10}, "`warmup` must not exceed `total_steps` \\(10\\), got 20"),
        ({"total_steps": -5}, "`total_steps` must be a positive int or None, got -5"),
        ({"min_lr_ratio": -0.5}, "`min_lr_ratio` must be in \\[0, 1\\], got -0.5"),
        ({"min_lr_ratio": 2}, "`min_lr_ratio` must be in \\[0, 1\\], got 2"),
        ({"min_lr_ratio": True}, "`min_lr_ratio` must be in \\[0, 1\\], got True"),
        ({"decay": "step"}, "`decay` must be one of 'wsd', 'constant', 'cosine', 'linear', 'auto', got 'step'"),
        ({"cooldown": 1.5}, "`cooldown` must be a fraction of the budget in \\[0, 1\\), got 1.5"),
        ({"cooldown": "0.2"}, "`cooldown` must be a fraction of the budget in \\[0, 1\\), got '0.2'"),
        ({"start_factor": 1.5}, "`start_factor` must be in \\[0, 1\\], got 1.5"),
        ({"cooldown_check": "yes"}, "`cooldown_check` must be False, True, 'loss' or 'trial', got 'yes'"),
        ({"cooldown_check": 1}, "`cooldown_check` must be False, True, 'loss' or 'trial', got 1"),
    ],
)
def test_constructor_rejects_bad_arguments(kwargs: dict[str, Any], match: str) -> None:
    """Bad constructor input raises ValueError naming the argument and its value."""
    with pytest.raises(ValueError, match=match):
        WarmupScheduler(**kwargs)


def test_warmup_longer_than_estimated_total_raises_at_first_batch(tmp_path: Path, tiny_model: TinyClassifier) -> None:
    """A warmup longer than the Trainer's estimated steps raises ValueError naming `warmup` and both values."""
    with pytest.raises(ValueError, match="`warmup` must not exceed `total_steps` \\(8\\), got 100"):
        fit(tmp_path, tiny_model, WarmupScheduler(warmup=100))


def test_state_key_and_state_round_trip() -> None:
    """Two differently configured instances have different state keys; state survives pickle and load."""
    a, b = WarmupScheduler(warmup=10), WarmupScheduler(warmup=0.1)
    assert a.state_key != b.state_key
    # the cool-down check is left out of the key: a checkpoint saved before the check existed resumes the schedule
    assert a.state_key == WarmupScheduler(warmup=10, cooldown_check=False).state_key
    assert "cooldown_check" not in a.state_key
    a.load_state_dict(
        {"warmup": 3, "total_steps": 9, "schedule": {"warmup_steps": 3, "total_steps": 9, "start_step": 2}}
    )
    clone = pickle.loads(pickle.dumps(a))
    assert clone.state_dict() == a.state_dict()
    assert clone.schedule == (3, 9, 2)
    assert clone.factor(3) == pytest.approx(warmup_factor(1, 3, 9))


# ---------------------------------------------------------------- the callback in a Trainer


def test_default_holds_the_lr_then_cools_down_over_the_last_fifth(tmp_path: Path, tiny_model: TinyClassifier) -> None:
    """The default schedule (wsd): warmup, the user's own LR held, then a 1-sqrt cool-down over the last 20%."""
    recorder, warmup = LRRecorder(), WarmupScheduler(warmup=2)
    fit(tmp_path, tiny_model, warmup, recorder, max_epochs=5)  # 40 steps: cool-down over the last 8
    lrs = recorder.lrs()
    assert warmup.decay == "wsd"
    assert lrs[:2] == pytest.approx([0.0, BASE_LR / 2])
    assert lrs[2:33] == pytest.approx([BASE_LR] * 31)  # the stable phase is exactly the constant-LR run
    assert lrs[33:] == pytest.approx([BASE_LR * (1 - ((k - 32) / 8) ** 0.5) for k in range(33, 40)])
    assert sum(lrs) / len(lrs) > 0.8 * BASE_LR  # cosine's mean would be about half


def test_the_default_runs_the_users_lr_from_the_first_step(tmp_path: Path, tiny_model: TinyClassifier) -> None:
    """No warmup by default: every step before the cool-down is the constant-LR run (a ramp only lowers the mean)."""
    recorder, warmup = LRRecorder(), WarmupScheduler()
    fit(tmp_path, tiny_model, warmup, recorder, max_epochs=5)
    assert warmup.schedule == (0, 40, 0)
    assert recorder.lrs()[:33] == pytest.approx([BASE_LR] * 33)


def test_a_raised_lr_gets_a_ramp_even_without_a_warmup(tmp_path: Path, tiny_model: TinyClassifier) -> None:
    """A callback that raises the LR x4 through `rescale_run_lrs` gives a 0-step warmup a ramp of 5% of the steps."""
    from lightning_speedkit.lr import RAISED_RAMP, rescale_run_lrs

    class Raise(Callback):
        def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            rescale_run_lrs(trainer, 4.0)

    recorder, warmup = LRRecorder(), WarmupScheduler(decay="constant")
    fit(tmp_path, tiny_model, warmup, Raise(), recorder, max_epochs=5)
    ramp = math.ceil(RAISED_RAMP * 40)
    assert warmup.schedule == (ramp, 40, 0)
    assert recorder.lrs() == pytest.approx([4 * BASE_LR * min(1.0, k / ramp) for k in range(40)])


def _fit_on_a_fake_clock(tmp_path: Path, model: L.LightningModule, *callbacks: Callback, **kwargs: Any) -> None:
    """Fit with ``max_time`` and no step budget (unless given), on a clock that each reading moves 1% of the time on."""
    from lightning.pytorch.callbacks import Timer

    from lightning_speedkit import budget

    kwargs = {"max_epochs": -1, "max_time": {"seconds": 2}, **kwargs}
    trainer = tiny_trainer(tmp_path, callbacks=list(callbacks), limit_val_batches=0, **kwargs)
    clock = iter(range(10_000))

    class FakeTimer(Timer):
        def time_elapsed(self, stage: str = "train") -> float:
            return 0.02 * next(clock)

    timer = callback_of(trainer, Timer)
    timer.__class__ = FakeTimer
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(budget, "TIME_EVERY", 1)
        trainer.fit(model)


def test_a_time_budget_cools_down_before_the_time_runs_out(tmp_path: Path, tiny_model: TinyClassifier) -> None:
    """With ``max_time`` and no step budget the cool-down follows the share of the time spent."""
    recorder, warmup = LRRecorder(), WarmupScheduler(warmup=0, cooldown=0.5)
    _fit_on_a_fake_clock(tmp_path, tiny_model, warmup, recorder)
    lrs = recorder.lrs()
    assert warmup.schedule is not None
    assert warmup.schedule[1] is None  # no step budget: the time one decides
    assert lrs[0] == pytest.approx(BASE_LR)  # the first half of the time: the user's LR
    assert lrs[-1] < 0.5 * BASE_LR  # and it cools down as the time runs out
    assert all(b <= a for a, b in itertools.pairwise(lrs))


def test_a_raised_lr_under_a_time_budget_alone_gets_a_ramp_over_its_share_of_the_time(
    tmp_path: Path, tiny_model: TinyClassifier
) -> None:
    """With ``max_time`` and no step budget, an LR raised x4 ramps up over 5% of the time, read every step.

    The ramp had no steps to be sized from: the raised LR ran from the first step.
    """
    from lightning_speedkit.lr import RAISED_RAMP, rescale_run_lrs

    class Raise(Callback):
        def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            rescale_run_lrs(trainer, 4.0)

    recorder, warmup = LRRecorder(), WarmupScheduler(decay="constant")
    _fit_on_a_fake_clock(tmp_path, tiny_model, warmup, Raise(), recorder)
    assert warmup.report()["warmup"] == RAISED_RAMP
    resolved = warmup.report()["resolved"]
    assert (resolved["warmup_steps"], resolved["total_steps"]) == (0, None)
    lrs, peak = recorder.lrs(), 4 * BASE_LR  # the clock is 1% further on at each reading (several a step)
    assert lrs[0] < 0.5 * peak
    assert all(b >= a for a, b in itertools.pairwise(lrs))
    ramp = sum(lr < peak * (1 - 1e-9) for lr in lrs)
    assert 1 < ramp < len(lrs) // 4  # a few steps: 5% of the time, not the run
    assert lrs[-1] == pytest.approx(peak)


def test_a_warmup_share_under_a_time_budget_alone_is_a_share_of_the_time(
    tmp_path: Path, tiny_model: TinyClassifier
) -> None:
    """``warmup=0.1`` with ``max_time`` and no step budget ramps over a tenth of the time (it was an error)."""
    recorder, warmup = LRRecorder(), WarmupScheduler(warmup=0.1, decay="constant")
    _fit_on_a_fake_clock(tmp_path, tiny_model, warmup, recorder)
    lrs = recorder.lrs()
    assert warmup.schedule is not None
    assert warmup.schedule[:2] == (0, None)
    assert lrs[0] < 0.5 * BASE_LR
    assert all(b >= a for a, b in itertools.pairwise(lrs))
    assert 1 < sum(lr < BASE_LR * (1 - 1e-9) for lr in lrs) < len(lrs) // 4
    assert lrs[-1] == pytest.approx(BASE_LR)


def test_a_restart_under_a_time_budget_ramps_over_its_own_steps_and_time(
    tmp_path: Path, tiny_model: TinyClassifier
) -> None:
    """`restart` with a step and a time budget: the new warmup starts at 0 and ramps over its own steps.

    The time side of "whichever ends first" read the share of the time spent since the fit began, not since the
    restart: a third of the time gone made the new warmup start near its peak (under a shorter budget, no ramp at all).
    """

    class Restart(Callback):
        def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
            if trainer.global_step == 16 and warmup.schedule is not None and warmup.schedule[2] == 0:
                warmup.restart(warmup=8)

    recorder, warmup = LRRecorder(), WarmupScheduler(warmup=4, decay="constant")
    _fit_on_a_fake_clock(tmp_path, tiny_model, warmup, Restart(), recorder, max_steps=40)
    assert warmup.schedule == (8, 23, 17)  # from the next batch
    assert warmup.report()["resolved"]["time_start"] > 0.2  # the clock: a third of the time gone at the restart
    steps = [lr for step, _, (lr, *_) in recorder.steps if step >= 17]
    assert steps[0] < 0.1 * BASE_LR  # the fake clock moves 1% between the restart's reading and its first step's
    assert all(b > a for a, b in itertools.pairwise(steps[:9]))
    assert steps[4] < 0.75 * BASE_LR  # a ramp over its 8 steps (the time side, on the time left, ends later)
    assert steps[8:] == pytest.approx([BASE_LR] * len(steps[8:]))
    assert warmup_factor(0, 20, 150, "constant", time_fraction=0.6, time_start=0.6) == 0.0
    half = warmup_factor(10, 20, 150, "cosine", time_fraction=0.6 + 0.4 * 10 / 150, time_start=0.6)
    assert half == pytest.approx(0.5)  # the steps and the time left agree: half the warmup


class _CrashInsideStep(Callback):
    """Raises inside the optimizer step of global step ``step`` (backward runs in ``optimizer.step(closure)``).

    Its own ``on_exception`` writes a checkpoint: listed before the warmup, it runs before the warmup's.
    """

    def __init__(self, step: int, path: Path) -> None:
        self.step, self.path = step, path

    @override
    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor) -> None:
        if trainer.global_step == self.step:
            raise RuntimeError("crash inside the step")

    @override
    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        trainer.save_checkpoint(self.path)


def test_an_exception_inside_a_step_leaves_no_multiplier_in_the_optimizer_or_its_checkpoint(
    tmp_path: Path, tiny_model: TinyClassifier
) -> None:
    """A step an exception ends never runs its post hook: the user's LR is put back, in the optimizer and checkpoint.

    A resume from the checkpoint written on the exception trains at the uninterrupted run's LRs (it had half).
    """
    path = tmp_path / "crash.ckpt"
    trainer = tiny_trainer(
        tmp_path, callbacks=[_CrashInsideStep(4, path), WarmupScheduler(warmup=8)], limit_val_batches=0, max_epochs=3
    )
    with pytest.raises(RuntimeError, match="crash inside the step"):
        trainer.fit(tiny_model)
    assert trainer.optimizers[0].param_groups[0]["lr"] == BASE_LR
    assert torch.load(path, weights_only=False)["optimizer_states"][0]["param_groups"][0]["lr"] == BASE_LR
    whole, resumed = LRRecorder(), LRRecorder()
    fit(tmp_path / "whole", TinyClassifier(), WarmupScheduler(warmup=8), whole, max_epochs=3)
    fit(tmp_path / "resumed", TinyClassifier(), WarmupScheduler(warmup=8), resumed, max_epochs=3, ckpt_path=str(path))
    assert resumed.lrs() == pytest.approx(whole.lrs()[4:])


class _LRFree(TinyClassifier):
    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return FixedStep(self.parameters())


@pytest.mark.parametrize("use_preset", [False, True])
def test_an_optimizer_without_lr_trains_as_without_the_schedule(tmp_path: Path, use_preset: bool) -> None:
    """No ``lr`` in the param groups (an LR-free optimizer): its steps run as they are, said once, no trial is run.

    Under `preset()` too (which adds the schedule by default): the first step used to fail with ``KeyError: 'lr'``.
    """
    weights = []
    for callbacks in ([], [WarmupScheduler()]):
        L.seed_everything(0, verbose=False)
        model = _LRFree()
        if use_preset:  # preset's fit, without its schedule (taken out) and with it
            trainer = preset(max_epochs=5, accelerator="cpu", devices=1, logger=False, default_root_dir=tmp_path)
            callbacks = [callback_of(trainer, WarmupScheduler)] if callbacks else []
            trainer.callbacks = [c for c in trainer.callbacks if callbacks or not isinstance(c, WarmupScheduler)]
            trainer.fit(model)
        else:
            fit(tmp_path, model, *callbacks, max_epochs=5)
        weights.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
        if callbacks:
            report = callbacks[0].report()
            assert report["left_alone"] == ["optimizer 0 (FixedStep)"]
            assert report["cooldown_check"]["held"] is None  # nothing to cool down: no trial, no verdict
            assert report["probe_s"] == 0.0
    assert torch.equal(weights[0], weights[1])


def test_a_checkpoint_from_before_the_timed_warmup_resumes_its_schedule() -> None:
    """A saved schedule without ``time_start`` (older checkpoints) loads as it was, the time counted from 0."""
    warmup = WarmupScheduler()
    warmup.load_state_dict(
        {"warmup": 2, "total_steps": None, "schedule": {"warmup_steps": 2, "total_steps": 40, "start_step": 8}}
    )
    assert warmup.schedule == (2, 40, 8)
    assert warmup.report()["resolved"]["time_start"] == 0.0


def test_warmup_then_cosine_over_optimizer_steps(tmp_path: Path, tiny_model: TinyClassifier) -> None:
    """Each optimizer step uses base LR x factor(global_step); outside the step the group keeps the base LR."""
    recorder, warmup = LRRecorder(), WarmupScheduler(warmup=0.25, decay="cosine", min_lr_ratio=0.1)
    fit(tmp_path, tiny_model, warmup, recorder, max_epochs=2)
    assert warmup.schedule == (4, 16, 0)  # 25% of 2 x 8 estimated steps, rounded up
    assert [step for step, _, _ in recorder.steps] == list(range(16))
    assert recorder.lrs() == pytest.approx([BASE_LR * warmup_factor(k, 4, 16, "cosine", 0.1) for k in range(16)])
    assert tiny_model.optimizers().optimizer.param_groups[0]["lr"] == BASE_LR  # type: ignore[union-attr]


def test_gradient_accumulation_counts_optimizer_steps(tmp_path: Path, tiny_model: TinyClassifier) -> None:
    """With accumulate_grad_batches=2 the warmup lasts 4 optimizer steps (8 batches), total 8 steps."""
    recorder, warmup = LRRecorder(), WarmupScheduler(warmup=4, decay="linear")
    fit(tmp_path, tiny_model, warmup, recorder, max_epochs=2, accumulate_grad_batches=2)
    assert warmup.schedule == (4, 8, 0)
    assert [step for step, _, _ in recorder.steps] == list(range(8))
    assert recorder.lrs() == pytest.approx([BASE_LR * warmup_factor(k, 4, 8, "linear") for k in range(8)])


@pytest.mark.parametrize(("scheduler", "interval"), [("step", "step"), ("exp", "epoch")])
def test_multiplies_on_top_of_user_scheduler(tmp_path: Path, scheduler: str, interval: str) -> None:
    """With a user StepLR/ExponentialLR the effective LR is user_lr x factor, and the user's schedule is untouched."""
    L.seed_everything(0, verbose=False)
    model, recorder = ScheduledClassifier(scheduler, interval), LRRecorder()
    fit(tmp_path, model, WarmupScheduler(warmup=5, decay="constant", start_factor=0.1), recorder, max_epochs=2)
    expected = [user_lr(k, scheduler, interval) * warmup_factor(k, 5, None, "constant", 0.0, 0.1) for k in range(16)]
    assert recorder.lrs() == pytest.approx(expected)
    user_scheduler = model.lr_schedulers()
    assert user_scheduler.get_last_lr() == pytest.approx([user_lr(16, scheduler, interval)])  # type: ignore[union-attr]
    optimizer = model.optimizers().optimizer  # type: ignore[union-attr]
    assert optimizer.param_groups[0]["lr"] == pytest.approx(user_lr(16, scheduler, interval))


def test_warns_when_two_decays_multiply(tmp_path: Path) -> None:
    """A decay on top of a user scheduler is not silent: a warning names the scheduler and the fix."""
    L.seed_everything(0, verbose=False)
    recorder = LRRecorder()
    with pytest.warns(UserWarning, match="WarmupScheduler: the wsd decay multiplies on top of .*StepLR"):
        fit(tmp_path, ScheduledClassifier(), WarmupScheduler(warmup=2), recorder)
    expected = [user_lr(k) * warmup_factor(k, 2, 8) for k in range(8)]
    assert recorder.lrs() == pytest.approx(expected)


@pytest.mark.filterwarnings("error:WarmupScheduler")
def test_auto_leaves_a_users_scheduler_alone_and_cools_down_without_one(
    tmp_path: Path, tiny_model: TinyClassifier
) -> None:
    """``decay="auto"`` (preset's): no decay on top of the user's own scheduler; without one, warmup-stable-decay.

    Under the scheduler the LRs are the user's curve step for step, with no warning.
    """
    recorder, warmup = LRRecorder(), WarmupScheduler(decay="auto")
    assert warmup.report()["decay_used"] is None  # resolved at fit start
    fit(tmp_path, ScheduledClassifier(), warmup, recorder)
    assert warmup.report()["decay"] == "auto"
    assert warmup.report()["decay_used"] == "constant"
    assert recorder.lrs() == pytest.approx([user_lr(k) for k in range(8)])
    recorder, warmup = LRRecorder(), WarmupScheduler(decay="auto")
    fit(tmp_path, tiny_model, warmup, recorder, max_epochs=5)
    assert warmup.report()["decay_used"] == "wsd"
    assert recorder.lrs()[:32] == pytest.approx([BASE_LR] * 32)
    assert recorder.lrs()[-1] < BASE_LR / 2  # cooled down over the last fifth


@pytest.mark.filterwarnings("ignore:You're resuming from a checkpoint that ended before the epoch ended")
@pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`, callbacks used to create the checkpoint")
def test_auto_resolves_the_same_way_on_a_resume(tmp_path: Path) -> None:
    """A fit resumed from a checkpoint resolves ``"auto"`` again from the same scheduler: the uninterrupted LRs."""

    def model() -> L.LightningModule:
        L.seed_everything(0, verbose=False)
        return ScheduledClassifier()

    full = [WarmupScheduler(warmup=2, decay="auto"), LRRecorder()]
    checkpoint = ModelCheckpoint(tmp_path / "ckpt", every_n_train_steps=3, save_top_k=-1, filename="{step}")
    fit(tmp_path, model(), *full, checkpoint, max_epochs=2, enable_checkpointing=True)
    resumed = [WarmupScheduler(warmup=2, decay="auto"), LRRecorder()]
    fit(tmp_path, model(), *resumed, max_epochs=2, ckpt_path=str(tmp_path / "ckpt" / "step=3.ckpt"))
    assert resumed[1].steps == full[1].steps[3:]  # type: ignore[attr-defined]
    assert resumed[0].report()["decay_used"] == "constant"  # type: ignore[attr-defined]


class TwoOptimizerManual(TinyClassifier):
    """Manual optimization: two optimizers (the first with two param groups), ExponentialLR stepped in the step."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    @override
    def configure_optimizers(self) -> Any:
        """Two SGD optimizers and two ExponentialLRs."""
        first, last = self.net[0], self.net[2]
        opt0 = torch.optim.SGD([{"params": [first.weight]}, {"params": [first.bias], "lr": 0.02}], lr=0.1)
        opt1 = torch.optim.SGD(last.parameters(), lr=0.3)
        return [opt0, opt1], [sched.ExponentialLR(opt0, 0.9), sched.ExponentialLR(opt1, 0.5)]

    @override
    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        """Step each optimizer, then its scheduler."""
        x, y = batch
        for opt, scheduler in zip(self.optimizers(), self.lr_schedulers(), strict=True):  # type: ignore[arg-type]
            loss = torch.nn.functional.cross_entropy(self(x), y)
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()
            scheduler.step()
        return loss


@pytest.mark.filterwarnings("ignore:WarmupScheduler. the cosine decay multiplies")
@pytest.mark.parametrize(
    ("budget", "batches"),
    [({"max_epochs": 2}, 16), ({"max_steps": 32, "max_epochs": -1}, 16), ({"max_steps": 24, "max_epochs": 2}, 12)],
)
def test_manual_optimization_every_group_of_every_optimizer(
    tmp_path: Path, budget: dict[str, int], batches: int
) -> None:
    """Manual optimization: every group of every optimizer gets the factor of the batches trained, over the whole run.

    ``global_step`` counts each optimizer's step (two a batch here) while the budget counts batches: the schedule ran
    on ``global_step`` and ended half-way, leaving the second half of a GAN's run at LR 0 under preset's defaults.
    A ``max_steps`` budget counts optimizer steps, so it is read in batches once the first batch shows two a batch:
    it sized the schedule twice too long, and the run ended half-way through it, never cooled down. In-step
    schedulers keep their own curve.
    """
    L.seed_everything(0, verbose=False)
    recorder, warmup = LRRecorder(), WarmupScheduler(warmup=6)
    fit(tmp_path, TwoOptimizerManual(), warmup, recorder, **budget)
    assert warmup.schedule == (6, batches, 0)  # two optimizer steps a batch
    assert [(step, index) for step, index, _ in recorder.steps] == [(k, k % 2) for k in range(2 * batches)]
    for step, index, lrs in recorder.steps:
        bases, gamma = ([0.1, 0.02], 0.9) if index == 0 else ([0.3], 0.5)
        expected = [base * gamma ** (step // 2) * warmup_factor(step // 2, 6, batches) for base in bases]
        assert lrs == pytest.approx(expected), (step, index)
    assert recorder.steps[-1][2][0] > 0  # the last batch is in the cool-down, not past it


def test_lr_changed_inside_the_step_is_kept_with_a_warning(tmp_path: Path) -> None:
    """If something writes a group's LR during optimizer.step(), that value is kept and a warning says so."""

    class SetsLR(TinyClassifier):
        @override
        def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
            self.optimizers().optimizer.param_groups[0]["lr"] = 0.05  # type: ignore[union-attr]
            return super().training_step(batch, batch_idx)

    L.seed_everything(0, verbose=False)
    model = SetsLR()
    with pytest.warns(UserWarning, match="WarmupScheduler: optimizer 0's LR was changed during optimizer.step"):
        fit(tmp_path, model, WarmupScheduler(warmup=2), max_steps=3)
    assert model.optimizers().optimizer.param_groups[0]["lr"] == 0.05  # type: ignore[union-attr]


def test_logs_factor_and_lr_to_the_trainer_loggers(tmp_path: Path, tiny_model: TinyClassifier) -> None:
    """`speedkit/lr/factor` and `speedkit/lr/opt0_group0` arrive in a CSVLogger at every logged global step."""
    logger = CSVLogger(tmp_path, name="csv")
    fit(tmp_path, tiny_model, WarmupScheduler(warmup=4), logger=logger, log_every_n_steps=1)
    with open(Path(logger.log_dir) / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("speedkit/lr/opt0_group0")]
    assert [int(r["step"]) for r in rows] == list(range(8))
    assert [float(r["speedkit/lr/opt0_group0"]) for r in rows] == pytest.approx(
        [BASE_LR * warmup_factor(k, 4, 8) for k in range(8)]
    )
    assert [float(r["speedkit/lr/factor"]) for r in rows] == pytest.approx([warmup_factor(k, 4, 8) for k in range(8)])


class Cooperator(Callback):
    """Stands in for the batch-size finder (rescale + longer warmup at fit start) and pruning (re-warm)."""

    def __init__(self, rescale: float | None = None, warmup_steps: int | None = None, rewarm_at_epoch: int = -1):
        self.rescale, self.warmup_steps, self.rewarm_at_epoch = rescale, warmup_steps, rewarm_at_epoch

    def _warmup(self, trainer: L.Trainer) -> WarmupScheduler:
        return next(cb for cb in trainer.callbacks if isinstance(cb, WarmupScheduler))  # type: ignore[attr-defined]

    @override
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Rescale and set the warmup, as the batch-size finder would."""
        if self.rescale is not None:
            self._warmup(trainer).rescale_base_lrs(trainer, self.rescale)
        if self.warmup_steps is not None:
            self._warmup(trainer).set_warmup_steps(self.warmup_steps)

    @override
    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Re-warm after an epoch, as pruning would."""
        if trainer.current_epoch == self.rewarm_at_epoch:
            self._warmup(trainer).restart(warmup=2)


@pytest.mark.parametrize("cooperator_first", [True, False])
def test_rescale_and_longer_warmup_from_another_callback(tmp_path: Path, cooperator_first: bool) -> None:
    """Doubling base LRs and a 6-step warmup set at fit start give 2 x user_lr x factor, in either callback order."""
    L.seed_everything(0, verbose=False)
    recorder, warmup, cooperator = LRRecorder(), WarmupScheduler(warmup=2, decay="constant"), Cooperator(2.0, 6)
    callbacks = [cooperator, warmup] if cooperator_first else [warmup, cooperator]
    fit(tmp_path, ScheduledClassifier(), *callbacks, recorder)
    assert warmup.schedule == (6, 8, 0)
    assert recorder.lrs() == pytest.approx([2 * user_lr(k) * warmup_factor(k, 6, 8, "constant") for k in range(8)])


def test_restart_rewarms_from_the_next_batch(tmp_path: Path, tiny_model: TinyClassifier) -> None:
    """`restart(warmup=2)` at the end of epoch 0 starts a new 2-step warmup and decay over the remaining 8 steps."""
    recorder, warmup = LRRecorder(), WarmupScheduler(warmup=4)
    fit(tmp_path, tiny_model, warmup, Cooperator(rewarm_at_epoch=0), recorder, max_epochs=2)
    assert warmup.schedule == (2, 8, 8)
    expected = [warmup_factor(k, 4, 16) for k in range(8)] + [warmup_factor(k, 2, 8) for k in range(8)]
    assert recorder.lrs() == pytest.approx([BASE_LR * f for f in expected])


@pytest.mark.filterwarnings("ignore:WarmupScheduler. the cosine decay multiplies")
@pytest.mark.filterwarnings("ignore:You're resuming from a checkpoint that ended before the epoch ended")
@pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`, callbacks used to create the checkpoint")
@pytest.mark.parametrize("scheduler", [None, "step"])
def test_resume_mid_warmup_gives_the_uninterrupted_lr_sequence(tmp_path: Path, scheduler: str | None) -> None:
    """Resuming from a checkpoint taken at step 3 of a 6-step warmup replays exactly the uninterrupted LRs."""

    def model() -> L.LightningModule:
        L.seed_everything(0, verbose=False)
        return TinyClassifier() if scheduler is None else ScheduledClassifier(scheduler)

    def callbacks() -> list[Callback]:
        return [WarmupScheduler(warmup=6, min_lr_ratio=0.05, start_factor=0.1), LRRecorder()]

    full = callbacks()
    checkpoint = ModelCheckpoint(tmp_path / "ckpt", every_n_train_steps=3, save_top_k=-1, filename="{step}")
    fit(tmp_path, model(), *full, checkpoint, max_epochs=2, enable_checkpointing=True)
    resumed = callbacks()
    fit(tmp_path, model(), *resumed, max_epochs=2, ckpt_path=str(tmp_path / "ckpt" / "step=3.ckpt"))
    full_steps, resumed_steps = full[1].steps, resumed[1].steps  # type: ignore[attr-defined]
    assert [step for step, _, _ in resumed_steps] == list(range(3, 16))
    assert resumed_steps == full_steps[3:]  # exactly equal, not approximately
    assert resumed[0].schedule == full[0].schedule == (6, 16, 0)  # type: ignore[attr-defined]


@pytest.mark.parametrize(("warmup", "schedule"), [(2, (2, 32, 0)), (0.1, (4, 32, 0))], ids=["steps", "share"])
def test_a_resumed_run_given_more_epochs_ends_its_schedule_at_the_new_budget(
    tmp_path: Path, warmup: float, schedule: tuple[int, int, int]
) -> None:
    """Resumed from the end of a 2-epoch run with ``max_epochs=4``: the schedule is sized as a 4-epoch run's.

    The checkpoint's schedule ended at the old budget, so every step given after it ran at the floor (LR 0) without a
    word; ``total_steps`` left to the Trainer follows its budget on a resume, with one line saying so. A warmup given
    as a share of the budget is that share of the new one (it kept the old one's: 2 steps where the run has 4).
    """

    def callbacks() -> list[Callback]:
        return [WarmupScheduler(warmup=warmup, decay="cosine"), LRRecorder()]

    full = callbacks()
    fit(tmp_path / "full", TinyClassifier(), *full, max_epochs=4)
    short = ModelCheckpoint(tmp_path / "ckpt", save_last=True)
    fit(tmp_path / "short", TinyClassifier(), *callbacks(), short, max_epochs=2, enable_checkpointing=True)
    resumed = callbacks()
    fit(tmp_path / "resumed", TinyClassifier(), *resumed, max_epochs=4, ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))
    assert resumed[0].schedule == full[0].schedule == schedule  # type: ignore[attr-defined]
    assert resumed[1].steps == full[1].steps[16:]  # type: ignore[attr-defined]
    assert resumed[1].lrs() == pytest.approx(full[1].lrs()[16:])  # type: ignore[attr-defined]
    assert min(resumed[1].lrs()) > 0  # type: ignore[attr-defined]


# ---------------------------------------------------------------- the cool-down check


class FlatLoss(TinyClassifier):
    """A loss learning cannot move: its batch's mean label (noise around a level), with zero gradients."""

    @override
    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return (self(x) * 0).sum() + y.float().mean()


def full_batch(lr: float) -> TinyClassifier:
    """TinyClassifier at ``lr`` on one batch of all 64 samples a step: its loss falls smoothly, step after step."""
    L.seed_everything(0, verbose=False)
    return TinyClassifier(lr=lr, batch_size=64)


def test_the_lr_is_held_to_the_end_while_the_loss_still_falls(tmp_path: Path) -> None:
    """While gradient descent at a low LR still lowers the loss before the cool-down, the LR is held to the end.

    The fit is then exactly the fit without the scheduler: the same LRs, the same weights.
    """
    recorder, warmup = LRRecorder(), WarmupScheduler(cooldown=0.5, cooldown_check=True)
    checked = full_batch(0.05)  # seeded, like `plain`: the same weights and the same shuffles
    fit(tmp_path, checked, warmup, recorder, max_epochs=40)  # 40 steps: watches steps 0-19, decides at step 20
    plain = full_batch(0.05)
    fit(tmp_path, plain, max_epochs=40)
    check = warmup.report()["cooldown_check"]
    assert check["held"] is True
    assert check["steps"] == 20
    assert check["drop"] > 0.02
    assert recorder.lrs() == [0.05] * 40
    assert all(torch.equal(a, b) for a, b in zip(checked.parameters(), plain.parameters(), strict=True))


def test_the_cool_down_runs_when_the_loss_has_flattened(tmp_path: Path) -> None:
    """A loss that only wanders around its level before the cool-down: the 1-sqrt cool-down runs as planned."""
    L.seed_everything(0, verbose=False)
    recorder, warmup = LRRecorder(), WarmupScheduler(cooldown=0.5, cooldown_check=True)
    fit(tmp_path, FlatLoss(), warmup, recorder, max_epochs=10)  # 80 steps: watches 0-39, decides at step 40
    check = warmup.report()["cooldown_check"]
    assert check["method"] == "loss"
    assert check["held"] is False
    assert check["drop"] == pytest.approx(0, abs=0.1)
    assert check["steps"] == 40
    assert recorder.lrs()[:40] == [BASE_LR] * 40
    assert recorder.lrs()[40:] == pytest.approx([BASE_LR * (1 - ((k - 40) / 40) ** 0.5) for k in range(40, 80)])


def test_without_the_check_the_cool_down_runs_even_while_the_loss_falls(tmp_path: Path) -> None:
    """Without the check (the default) the cool-down runs on schedule whatever the loss does; nothing is watched."""
    recorder, warmup = LRRecorder(), WarmupScheduler(cooldown=0.5)
    fit(tmp_path, full_batch(0.05), warmup, recorder, max_epochs=40)
    assert recorder.lrs()[20:] == pytest.approx([0.05 * (1 - ((k - 20) / 20) ** 0.5) for k in range(20, 40)])
    check = warmup.report()["cooldown_check"]
    assert (check["enabled"], check["method"], check["held"], check["steps"], check["probe_s"]) == (
        False,
        None,
        None,
        0,
        0,
    )


@pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`, callbacks used to create the checkpoint")
def test_a_resume_while_the_check_watches_keeps_the_losses_watched(tmp_path: Path) -> None:
    """A checkpoint taken while the check watches carries the losses it saw.

    The resumed fit decides on all 40 steps, as the uninterrupted fit does, and applies the same LRs from the
    checkpoint on.
    """

    def run(*callbacks: Callback, ckpt_path: str | None = None) -> None:
        L.seed_everything(0, verbose=False)
        fit(tmp_path, FlatLoss(), *callbacks, max_epochs=10, ckpt_path=ckpt_path, enable_checkpointing=True)

    full = [WarmupScheduler(cooldown=0.5, cooldown_check=True), LRRecorder()]
    run(*full, ModelCheckpoint(tmp_path / "ckpt", every_n_train_steps=16, save_top_k=-1, filename="{step}"))
    resumed = [WarmupScheduler(cooldown=0.5, cooldown_check=True), LRRecorder()]
    run(*resumed, ckpt_path=str(tmp_path / "ckpt" / "step=16.ckpt"))
    reports = [r[0].report()["cooldown_check"] for r in (full, resumed)]  # type: ignore[attr-defined]
    assert [r["steps"] for r in reports] == [40, 40]
    assert [r["held"] for r in reports] == [False, False]
    assert resumed[1].steps == full[1].steps[16:]  # type: ignore[attr-defined]


# ---------------------------------------------------------------- the cool-down trial
def test_a_cool_down_trial_holds_the_lr_of_a_run_still_limited_by_it(tmp_path: Path) -> None:
    """A run whose loss still falls fast at its LR: the trial's peak side ends clearly lower, so the LR is held.

    It runs at the start of the epoch in which the cool-down begins (one step an epoch: step 150 of 300), and the
    run is then exactly the plain fit at the constant LR: the trial's 2 x 32 steps left nothing behind.
    """
    recorder, warmup = LRRecorder(), WarmupScheduler(cooldown=0.5, cooldown_check="trial")
    checked = full_batch(0.05)
    fit(tmp_path, checked, warmup, recorder, max_epochs=300)
    plain = full_batch(0.05)
    fit(tmp_path, plain, max_epochs=300)
    check = warmup.report()["cooldown_check"]
    assert (check["method"], check["held"], check["step"], check["reason"]) == ("trial", True, 150, "")
    assert check["z"] < -TRIAL_Z
    assert check["gap"] < 0
    assert check["probe_s"] > 0
    assert recorder.lrs() == [0.05] * 300
    assert all(torch.equal(a, b) for a, b in zip(checked.parameters(), plain.parameters(), strict=True))


def test_a_cool_down_trial_that_cools_leaves_the_run_as_without_it(tmp_path: Path) -> None:
    """An LR whose loss the peak does not lower (it climbs at this LR): the trial cools down as planned.

    The LRs and the final weights are those of the run without the check: the trial, at step 160 (the cool-down's
    first step, an epoch's start), is put back whole (weights, SGD's state, the loader's order).
    """

    def run(check: bool | str) -> tuple[LRRecorder, WarmupScheduler, TinyClassifier]:
        L.seed_everything(0, verbose=False)
        model, recorder, warmup = (
            TinyClassifier(lr=0.2),
            LRRecorder(),
            WarmupScheduler(cooldown=0.5, cooldown_check=check),
        )
        fit(tmp_path, model, warmup, recorder, max_epochs=40)  # 8 steps an epoch, 320 steps: cools down from 160
        return recorder, warmup, model

    (recorder, warmup, model), (plain_lrs, _, plain) = run("trial"), run(False)
    check = warmup.report()["cooldown_check"]
    assert (check["method"], check["held"], check["step"]) == ("trial", False, 160)
    assert check["z"] >= -TRIAL_Z
    assert recorder.lrs() == plain_lrs.lrs()
    assert recorder.lrs()[160] == pytest.approx(0.2)
    assert recorder.lrs()[-1] < 0.02
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), plain.parameters(), strict=True))


def test_no_cool_down_trial_when_it_would_cost_more_than_half_the_cool_down(tmp_path: Path) -> None:
    """A cool-down of 40 steps is shorter than twice the trial's 2 x 32 steps: no trial, the cool-down runs."""
    recorder, warmup = LRRecorder(), WarmupScheduler(cooldown=0.5, cooldown_check="trial")
    fit(tmp_path, full_batch(0.05), warmup, recorder, max_epochs=80)
    check = warmup.report()["cooldown_check"]
    assert (check["held"], check["step"], check["probe_s"]) == (False, None, 0)
    assert "more than half of the 40 cool-down steps" in check["reason"]
    assert recorder.lrs()[40:] == pytest.approx([0.05 * (1 - ((k - 40) / 40) ** 0.5) for k in range(40, 80)])


@pytest.mark.parametrize("max_epochs", [20, 1])
def test_a_cool_down_too_short_for_the_loss_check_still_says_why_no_trial_ran(tmp_path: Path, max_epochs: int) -> None:
    """A 10-step cool-down (shorter than the loss check's 16-step window): the trial's report still gives a reason.

    Over 20 one-step epochs, its price; in one epoch of 20 steps (8 samples each), that no epoch started before
    the cool-down.
    """
    L.seed_everything(0, verbose=False)
    warmup = WarmupScheduler(cooldown=0.5, cooldown_check="trial")
    model = full_batch(0.05) if max_epochs > 1 else TinyClassifier(num_samples=160)
    fit(tmp_path, model, warmup, max_epochs=max_epochs)
    check = warmup.report()["cooldown_check"]
    assert (check["held"], check["step"]) == (False, None)
    assert "of the 10 cool-down steps" in check["reason"] if max_epochs > 1 else "no epoch started" in check["reason"]


def test_no_cool_down_no_trial_and_nothing_to_explain(tmp_path: Path) -> None:
    """``cooldown=0``: there is nothing for a trial to decide, so none runs and no reason is given; the LR is held."""
    recorder, warmup = LRRecorder(), WarmupScheduler(cooldown=0.0, cooldown_check="trial")
    fit(tmp_path, full_batch(0.05), warmup, recorder, max_epochs=20)
    check = warmup.report()["cooldown_check"]
    assert (check["held"], check["step"], check["reason"]) == (None, None, "")
    assert recorder.lrs() == pytest.approx([0.05] * 20)


def test_no_cool_down_trial_without_an_epoch_start_before_the_cool_down(tmp_path: Path) -> None:
    """One epoch of 256 steps: no epoch starts after the schedule's start, so the cool-down runs as planned."""
    L.seed_everything(0, verbose=False)
    recorder, warmup = LRRecorder(), WarmupScheduler(cooldown=0.5, cooldown_check="trial")
    fit(tmp_path, TinyClassifier(num_samples=2048), warmup, recorder, max_epochs=1)
    check = warmup.report()["cooldown_check"]
    assert (check["held"], check["step"]) == (False, None)
    assert "no epoch started" in check["reason"]
    assert recorder.lrs()[-1] < 0.01 * BASE_LR


@pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`, callbacks used to create the checkpoint")
def test_a_resume_after_the_cool_down_trial_keeps_its_verdict(tmp_path: Path) -> None:
    """A checkpoint taken after the trial carries its verdict: the resumed fit runs no second trial, same LRs."""

    def run(*callbacks: Callback, ckpt_path: str | None = None) -> None:
        fit(tmp_path, full_batch(0.05), *callbacks, max_epochs=300, ckpt_path=ckpt_path, enable_checkpointing=True)

    full = [WarmupScheduler(cooldown=0.5, cooldown_check="trial"), LRRecorder()]
    run(*full, ModelCheckpoint(tmp_path / "ckpt", every_n_train_steps=200, save_top_k=-1, filename="{step}"))
    resumed = [WarmupScheduler(cooldown=0.5, cooldown_check="trial"), LRRecorder()]
    run(*resumed, ckpt_path=str(tmp_path / "ckpt" / "step=200.ckpt"))
    reports = [r[0].report()["cooldown_check"] for r in (full, resumed)]  # type: ignore[attr-defined]
    assert reports[0] == reports[1]
    assert reports[1]["held"] is True
    assert resumed[1].steps == full[1].steps[200:]  # type: ignore[attr-defined]


@pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`, callbacks used to create the checkpoint")
@pytest.mark.parametrize("written", ["at the epoch's end", "at its last batch, by steps", "at a validation's end"])
def test_a_cool_down_trial_in_the_first_epoch_of_a_resumed_fit_reaches_the_uninterrupted_verdict(
    tmp_path: Path, written: str
) -> None:
    """A fit resumed at the epoch the trial runs at trains its two sides at their two LRs, as the uninterrupted did.

    The trial pins the LR through the optimizer step hooks, attached at the first batch: in a resumed fit's first
    epoch none was attached yet, so both sides trained at the same LR, the gap was 0 and the verdict flipped. A
    checkpoint written by steps at an epoch's last batch resumes into the next epoch without its
    ``on_train_epoch_start`` (Lightning 2.6): the trial was skipped ("no epoch started") and the run cooled down; run
    from ``on_train_start`` instead, it reset Lightning's restart stage, and a checkpoint written at a validation's
    end (whose next epoch Lightning starts with its hooks) trained that epoch twice, one step more than uninterrupted.
    """
    validates = written == "at a validation's end"

    def run(*callbacks: Callback, ckpt_path: str | None = None) -> None:
        trainer = tiny_trainer(
            tmp_path,
            callbacks=list(callbacks),
            max_epochs=300,
            enable_checkpointing=True,
            limit_val_batches=1 if validates else 0,
            num_sanity_val_steps=0,
        )
        trainer.fit(full_batch(0.05), ckpt_path=ckpt_path)

    first = WarmupScheduler(cooldown=0.5, cooldown_check="trial")
    run(first)
    step = first.report()["cooldown_check"]["step"]  # one step an epoch: the trial ran at the start of epoch `step`
    full = [WarmupScheduler(cooldown=0.5, cooldown_check="trial"), LRRecorder()]
    every = {
        "at the epoch's end": {"every_n_epochs": step},
        "at its last batch, by steps": {"every_n_train_steps": step},
        "at a validation's end": {"every_n_epochs": step, "save_on_train_epoch_end": False},
    }[written]
    run(*full, ModelCheckpoint(tmp_path / "at", **every, save_top_k=-1, filename="{epoch}"))  # type: ignore[arg-type]
    resumed = [WarmupScheduler(cooldown=0.5, cooldown_check="trial"), LRRecorder()]
    run(*resumed, ckpt_path=str(tmp_path / "at" / f"epoch={step - 1}.ckpt"))  # the epoch before the trial's
    reports = [r[0].report()["cooldown_check"] for r in (full, resumed)]  # type: ignore[attr-defined]
    assert reports[1]["step"] == reports[0]["step"] == step
    assert reports[1]["gap"] == reports[0]["gap"] != 0.0
    assert reports[1]["held"] == reports[0]["held"]
    assert resumed[1].steps == full[1].steps[step:]  # type: ignore[attr-defined]


@pytest.mark.slow
@pytest.mark.ddp
def test_ddp_spawn_two_processes_same_schedule(tmp_path: Path) -> None:
    """Under 2-process DDP on CPU both ranks apply the same LR at every optimizer step, per the global step."""
    L.seed_everything(0, verbose=False)
    fit(
        tmp_path,
        TinyClassifier(),
        WarmupScheduler(warmup=3, decay="linear"),
        LRRecorder(out=tmp_path),
        max_epochs=2,
        strategy="ddp_spawn",
        devices=2,
        accumulate_grad_batches=2,
    )
    steps_per_epoch = math.ceil(64 / 2 / 8 / 2)  # per-rank batches / accumulation
    total = 2 * steps_per_epoch
    expected = [[k, 0, [pytest.approx(BASE_LR * warmup_factor(k, 3, total, "linear"))]] for k in range(total)]
    for rank in (0, 1):
        assert json.loads((tmp_path / f"lrs_rank{rank}.json").read_text()) == expected


class RankLoss(TinyClassifier):
    """Rank 0's loss falls by 0.02 a step, rank 1's stays at 1 (with a little noise): only their mean still falls.

    The gradients are zero, so the weights never move and every rank's loss is exactly what this step says.
    """

    @override
    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        zero = (self(x) * 0).sum()
        if self.global_rank == 0:
            return zero + 2.0 - 0.02 * self.trainer.global_step
        return zero + 1.0 + 0.01 * y.float().mean()


def cooldown_check_report(trainer: L.Trainer, pl_module: L.LightningModule) -> Any:
    """The WarmupScheduler's cool-down check report (what each rank writes in the DDP test)."""
    return callback_of(trainer, WarmupScheduler).report()["cooldown_check"]


@pytest.mark.slow
@pytest.mark.ddp
def test_ddp_spawn_ranks_decide_the_cool_down_on_the_mean_loss(tmp_path: Path) -> None:
    """Under 2-process DDP every rank decides the cool-down on the loss averaged over the ranks.

    Rank 0's own loss still falls and rank 1's is flat, so on its own loss each rank would decide differently; on
    their mean (still falling) both hold the LR to the end: the same verdict and the same LRs on both ranks.
    """
    fit(
        tmp_path,
        RankLoss(),
        WarmupScheduler(cooldown=0.5, cooldown_check=True),
        LRRecorder(out=tmp_path),
        RankWriter(tmp_path, cooldown_check_report, prefix="check_rank"),
        max_epochs=10,  # 64 samples, 2 ranks, batches of 8: 4 steps an epoch, 40 steps; watches 0-19, decides at 20
        strategy="ddp_spawn",
        devices=2,
    )
    checks = rank_records(tmp_path, "check_rank")
    assert checks[0] == checks[1]
    assert checks[0]["held"] is True
    assert checks[0]["steps"] == 20
    lrs = rank_records(tmp_path, "lrs_rank")
    assert lrs[0] == lrs[1]
    assert [step[2] for step in lrs[0]] == [[BASE_LR]] * 40


@pytest.mark.slow
@pytest.mark.ddp
def test_ddp_spawn_ranks_reach_one_cool_down_trial_verdict(tmp_path: Path) -> None:
    """Under 2-process DDP the trial runs on both ranks at the same step and both keep rank zero's verdict.

    Full batches (32 samples a rank, one step an epoch) at a low LR: the loss still falls, both ranks hold the LR and
    apply the same LR at every step.
    """
    L.seed_everything(0, verbose=False)
    fit(
        tmp_path,
        TinyClassifier(lr=0.05, batch_size=32),
        WarmupScheduler(cooldown=0.5, cooldown_check="trial"),
        LRRecorder(out=tmp_path),
        RankWriter(tmp_path, cooldown_check_report, prefix="check_rank"),
        max_epochs=300,
        strategy="ddp_spawn",
        devices=2,
    )
    checks = rank_records(tmp_path, "check_rank")
    assert {k: v for k, v in checks[0].items() if k != "probe_s"} == {
        k: v for k, v in checks[1].items() if k != "probe_s"
    }
    assert (checks[0]["method"], checks[0]["held"], checks[0]["step"]) == ("trial", True, 150)
    lrs = rank_records(tmp_path, "lrs_rank")
    assert lrs[0] == lrs[1]
    assert [step[2] for step in lrs[0]] == [[0.05]] * 300


class _OwnSGD(torch.optim.SGD):
    """A user's optimizer whose ``step`` adds to torch's and calls ``super().step()``: torch hooks both steps."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.seen: list[float] = []

    @override
    def step(self, closure: Any = None) -> Any:
        self.seen.append(float(self.param_groups[0]["lr"]))  # the LR this update uses
        return super().step(closure)


class _OwnOptimizer(TinyClassifier):
    """TinyClassifier trained by `_OwnSGD`."""

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return _OwnSGD(self.parameters(), lr=self.lr)


def test_an_optimizer_subclass_calling_super_step_gets_the_factor_once(tmp_path: Path) -> None:
    """Torch's step hooks run for the subclass's step and again for SGD's inside it: the factor is applied once.

    The nested hooks multiplied the LR twice and restored it once, so every step's factor stayed in the param
    groups and compounded: a warmup's first factor of 0 held the LR at 0 for the rest of the run.
    """
    torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)  # SGD's own step hooked, as any SGD makes it
    L.seed_everything(0, verbose=False)
    model, warmup = _OwnOptimizer(), WarmupScheduler(warmup=4, decay="linear")
    trainer = fit(tmp_path, model, warmup, max_epochs=2)
    optimizer = trainer.optimizers[0]
    assert isinstance(optimizer, _OwnSGD)
    assert optimizer.seen == pytest.approx([BASE_LR * warmup.factor(k) for k in range(2 * STEPS_PER_EPOCH)])
    assert optimizer.param_groups[0]["lr"] == BASE_LR  # the user's own LR, untouched outside the step


def test_under_a_time_budget_the_warmup_ends_by_the_clock_too() -> None:
    """A warmup sized from a step budget the time budget cuts short ends at its share of the time, then the decay runs.

    With ``max_epochs=1000, max_time=6s`` the warmup was 1000 of an estimated 20,000 steps: the run spent its whole
    time ramping, ended at half the peak and never cooled down.
    """
    kwargs = {"warmup_steps": 1000, "total_steps": 20000, "decay": "wsd"}
    assert warmup_factor(10, time_fraction=0.025, **kwargs) == pytest.approx(0.5)  # half its 5% of the time
    assert warmup_factor(10, time_fraction=0.05, **kwargs) == 1.0
    assert warmup_factor(10, time_fraction=0.9, **kwargs) < 0.5  # in the time budget's cool-down
    assert warmup_factor(500, time_fraction=None, **kwargs) == pytest.approx(0.5)  # no clock: the steps alone
