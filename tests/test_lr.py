from __future__ import annotations

import math
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from lightning.pytorch.utilities.types import LRSchedulerConfig
from torch.optim import lr_scheduler as sched

from lightning_speedkit.lr import (
    MIN_SIGNAL,
    curve_signal,
    param_group_lrs,
    range_test_factors,
    scale_lrs,
    scale_trainer_lrs,
    suggest_lr,
)

Factory = Callable[[torch.optim.Optimizer], Any]

SCHEDULERS: dict[str, Factory] = {
    "StepLR": lambda opt: sched.StepLR(opt, step_size=2, gamma=0.5),
    "ExponentialLR": lambda opt: sched.ExponentialLR(opt, gamma=0.9),
    "LambdaLR": lambda opt: sched.LambdaLR(opt, lambda e: 1.0 / (1 + e)),
    "CosineAnnealingLR": lambda opt: sched.CosineAnnealingLR(opt, T_max=6, eta_min=0.01),
    "OneCycleLR": lambda opt: sched.OneCycleLR(opt, max_lr=[0.5, 1.0], total_steps=10),
    "CyclicLR": lambda opt: sched.CyclicLR(opt, base_lr=0.01, max_lr=0.1, step_size_up=3, cycle_momentum=False),
    "SequentialLR": lambda opt: sched.SequentialLR(
        opt, [sched.LinearLR(opt, start_factor=0.25, total_iters=3), sched.CosineAnnealingLR(opt, T_max=6)], [3]
    ),
    "ReduceLROnPlateau": lambda opt: sched.ReduceLROnPlateau(opt, patience=0, factor=0.5, min_lr=0.02),
}


def _optimizer() -> torch.optim.Optimizer:
    params = [torch.zeros(2, requires_grad=True), torch.zeros(2, requires_grad=True)]
    return torch.optim.SGD([{"params": [params[0]]}, {"params": [params[1]], "lr": 0.2}], lr=0.1)


def _run(make: Factory, factor: float | None, steps: int = 10) -> list[list[float]]:
    opt = _optimizer()
    scheduler = make(opt)
    if factor is not None:
        scale_lrs(factor, [opt], [LRSchedulerConfig(scheduler)])
    history = []
    for _ in range(steps):
        history.append(param_group_lrs([opt])[0])
        opt.step()
        if isinstance(scheduler, sched.ReduceLROnPlateau):
            scheduler.step(1.0)  # never improves: reduces every step down to the (rescaled) floor
        else:
            scheduler.step()
    return history


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("name", sorted(SCHEDULERS))
def test_scale_lrs_rescales_the_whole_schedule(name: str) -> None:
    """After rescaling by 3, every later LR of every group is 3x the unscaled schedule's: no scheduler undoes it."""
    plain, scaled = _run(SCHEDULERS[name], None), _run(SCHEDULERS[name], 3.0)
    assert len({tuple(lrs) for lrs in plain}) > 1  # the schedule really moves
    for before, after in zip(plain, scaled, strict=True):
        assert after == pytest.approx([3.0 * lr for lr in before], rel=1e-9)


def test_scale_lrs_writes_initial_lr_and_defaults() -> None:
    """`initial_lr`, the optimizer's default `lr` and the scheduler's `base_lrs` are all rescaled."""
    opt = _optimizer()
    scheduler = sched.StepLR(opt, step_size=1)
    scale_lrs(2.0, [opt], [scheduler])
    assert [g["initial_lr"] for g in opt.param_groups] == pytest.approx([0.2, 0.4])
    assert scheduler.base_lrs == pytest.approx([0.2, 0.4])
    assert opt.defaults["lr"] == pytest.approx(0.2)


def test_scale_lrs_scales_tensor_lrs_in_place_once() -> None:
    """A tensor LR is multiplied in place (same object), exactly once."""
    lr = torch.tensor(0.01)
    opt = torch.optim.Adam([torch.zeros(1, requires_grad=True)], lr=lr)
    opt.defaults["lr"] = opt.param_groups[0]["lr"]  # the same tensor reachable twice
    scheduler = sched.ExponentialLR(opt, gamma=0.5)
    group_lr = opt.param_groups[0]["lr"]
    scale_lrs(4.0, [opt], [scheduler])
    assert opt.param_groups[0]["lr"] is group_lr
    assert float(group_lr) == pytest.approx(0.04)
    assert float(scheduler.base_lrs[0]) == pytest.approx(0.04)


def test_scale_trainer_lrs_uses_optimizers_and_scheduler_configs() -> None:
    """The Trainer variant rescales `trainer.optimizers` and the schedulers in `trainer.lr_scheduler_configs`."""
    opt = _optimizer()
    scheduler = sched.StepLR(opt, step_size=1)
    trainer = SimpleNamespace(optimizers=[opt], lr_scheduler_configs=[LRSchedulerConfig(scheduler)])
    scale_trainer_lrs(trainer, 0.5)  # type: ignore[arg-type]
    assert param_group_lrs([opt]) == [pytest.approx([0.05, 0.1])]
    assert scheduler.base_lrs == pytest.approx([0.05, 0.1])


@pytest.mark.parametrize("factor", [0.0, -1.0, math.nan, math.inf, True, "2"])
def test_scale_lrs_rejects_bad_factor(factor: Any) -> None:
    """A factor that is not a positive finite number raises ValueError naming `factor`."""
    with pytest.raises(ValueError, match="`factor` must be a positive finite number"):
        scale_lrs(factor, [_optimizer()])


@pytest.mark.parametrize("seed", range(5))
def test_a_plateau_curve_suggests_no_lr(seed: int) -> None:
    """A range test whose loss only wanders around its chance level (noise, no trend) suggests nothing."""
    g = torch.Generator().manual_seed(seed)
    losses = (2.35 + 0.07 * torch.randn(60, generator=g)).tolist()
    lrs = range_test_factors(60, 0.01, 100.0)
    lr, why = suggest_lr(lrs, losses)
    assert lr is None
    assert "no signal" in why


def test_min_signal_zero_follows_the_valley_of_a_plateau() -> None:
    """``min_signal=0`` (fastai's behaviour) suggests the plateau's noisy valley; a negative one is refused."""
    g = torch.Generator().manual_seed(0)
    losses = (2.35 + 0.07 * torch.randn(60, generator=g)).tolist()
    lrs = range_test_factors(60, 0.01, 100.0)
    lr, why = suggest_lr(lrs, losses, min_signal=0.0)
    assert lr is not None
    assert why.startswith("valley")
    with pytest.raises(ValueError, match=r"`min_signal` must be a number >= 0, got -0\.5"):
        suggest_lr(lrs, losses, min_signal=-0.5)


def test_a_falling_curve_suggests_an_lr_in_its_valley() -> None:
    """The same noise on a loss that falls as the LR grows, then blows up, gives a suggestion inside the fall."""
    g = torch.Generator().manual_seed(0)
    lrs = range_test_factors(60, 0.01, 100.0)
    trend = [2.3 - 1.5 * min(1.0, max(0.0, (k - 15) / 30)) + (0.0 if k < 50 else 0.8 * (k - 50)) for k in range(60)]
    losses = [t + 0.07 * float(e) for t, e in zip(trend, torch.randn(60, generator=g), strict=True)]
    assert curve_signal(losses) > MIN_SIGNAL
    lr, _ = suggest_lr(lrs, losses)
    assert lr is not None
    assert lrs[15] < lr < lrs[50]
