"""What one trial of the LR search changes: an LR scaled for its steps (`Scaled`), or a range test's sweep."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_speedkit import trials
from lightning_speedkit.lr import diverged, param_group_lrs, scale_trainer_lrs, smooth_losses
from lightning_speedkit.lr_search import REFERENCE

if TYPE_CHECKING:
    from torch.optim import Optimizer

__all__ = ["RangeTest", "Scaled", "broke_after", "lead_lr"]


def lead_lr(optimizers: Sequence[Optimizer]) -> float:
    """The run's LR as a report names it: the first param group's that is not 0 (0.0 when every one is).

    A group at LR 0 (a backbone frozen by its LR) scales to 0, so it cannot stand for the others.

    Example:
        >>> import torch
        >>> opt = torch.optim.SGD([{"params": [torch.zeros(1)], "lr": 0.0}, {"params": [torch.zeros(1)]}], lr=0.1)
        >>> lead_lr([opt])
        0.1
    """
    return next((lr for lrs in param_group_lrs(optimizers) for lr in lrs if lr != 0.0), 0.0)


def broke_after(ceiling: float) -> Callable[[Sequence[float]], bool]:
    """A trial's stop test: a loss after the first step above ``ceiling``, or not finite (`lr_search.broke`).

    Once a loss is over `lightning_speedkit.lr_search.broke_ceiling`, the trial has broken however it ends, so its
    last steps would change nothing but the search's cost. A NaN ``ceiling`` (a broken reference) stops on a
    non-finite loss only.

    Example:
        >>> test = broke_after(3.0)
        >>> test([9.0]), test([2.0, 2.9]), test([2.0, 3.1]), test([2.0, float("nan")])
        (False, False, True, True)
    """

    def test(losses: Sequence[float]) -> bool:
        return len(losses) > 1 and (not math.isfinite(losses[-1]) or losses[-1] > ceiling)

    return test


class _StopWhen(Callback):
    """Ends a trial after the first step whose losses so far pass ``test``; rank zero's losses decide for every rank.

    A step that returned no loss (a batch the ``training_step`` skipped) is not tested.
    """

    def __init__(self, test: Callable[[Sequence[float]], bool]) -> None:
        self.test = test
        self.losses: list[float] = []

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        loss = trials.loss_of(outputs)
        if loss is not None:  # a step that returned none (a skipped batch) is not tested, but still broadcast
            self.losses.append(loss)
        if trainer.strategy.broadcast(loss is not None and self.test(self.losses), src=0):  # every rank stops alike
            trainer.should_stop = True


class _RangeSteps(_StopWhen):
    """Sets each trial step's LR (the user's LR times the next factor) and stops once the smoothed loss blows up."""

    def __init__(self, factors: Sequence[float], beta: float, divergence: float) -> None:
        super().__init__(lambda losses: diverged(smooth_losses(losses, beta), divergence))
        self.factors = list(factors)
        self.base: list[list[float]] = []

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if not self.base:
            self.base = param_group_lrs(trainer.optimizers)
        factor = self.factors[min(len(self.losses), len(self.factors) - 1)]
        for optimizer, lrs in zip(trainer.optimizers, self.base, strict=True):
            for group, lr in zip(optimizer.param_groups, lrs, strict=True):
                group["lr"] = lr * factor


class RangeTest(trials.Setting):
    """The LR schedule of a range test, for one trial.

    Step by step ``factors`` times the user's LR, until the loss smoothed by ``beta`` passes ``divergence`` times its
    least (`lightning_speedkit.lr.diverged`).
    """

    name = "lr range test"

    def __init__(self, factors: Sequence[float], beta: float, divergence: float) -> None:
        self.steps = _RangeSteps(factors, beta, divergence)

    @override
    def callbacks(self) -> Sequence[Callback]:
        return (self.steps,)


class Scaled(trials.Setting):
    """Every param group's LR times ``scale`` for one trial; 0 is the reference trial (the weights do not move).

    At LR 0 no step moves a weight, so the reference trial's losses are the forward passes' alone: under automatic
    optimization its steps skip the backward pass, the optimizer step and the LR schedulers' steps (the module's
    ``backward``, ``optimizer_step`` and ``lr_scheduler_step`` hooks, for this trial only), a third of a step's cost
    instead of all of it. (A scheduler stepped with no optimizer step before it would make torch warn.) Under manual
    optimization its steps run in full, each at LR 0 (`_AtZero`). A trial at another scale ends at the first step
    whose loss is over ``ceiling`` (`broke_after`): it has broken already. It keeps the LR each of its steps trained
    at in ``lrs`` (`lead_lr`; the reference trial keeps none): the user's schedule steps inside it
    (`lightning_speedkit.lr.rises`).
    """

    def __init__(self, scale: float, ceiling: float = math.inf) -> None:
        self.scale, self.name = scale, "reference (LR 0)" if scale == REFERENCE else f"x{scale:.4g}"
        self.ceiling = ceiling
        self.lrs: list[float] = []
        self._was: list[list[Any]] = []
        self._hooks: dict[str, Any] = {}
        self._defaults: list[Any] = []

    @override
    def apply(self, trainer: pl.Trainer) -> None:
        self._was = [[group["lr"] for group in optimizer.param_groups] for optimizer in trainer.optimizers]
        self._defaults = [optimizer.defaults.get("lr") for optimizer in trainer.optimizers]
        if self.scale == REFERENCE:  # its schedulers do not step (`_FORWARD_ONLY`)
            for optimizer in trainer.optimizers:
                for group in optimizer.param_groups:
                    group["lr"] = 0.0 * group["lr"]
        else:  # the schedulers' base LRs too, or a LambdaLR's next step undoes the scale (put back after the trial)
            scale_trainer_lrs(trainer, self.scale)
        module = trainer.lightning_module
        if self.scale == REFERENCE and module.automatic_optimization:
            self._hooks = {name: module.__dict__[name] for name in _FORWARD_ONLY if name in module.__dict__}
            module.__dict__.update(_FORWARD_ONLY)

    @override
    def revert(self, trainer: pl.Trainer) -> None:
        for optimizer, lrs, default in zip(trainer.optimizers, self._was, self._defaults, strict=True):
            for group, lr in zip(optimizer.param_groups, lrs, strict=True):
                group["lr"] = lr
            if default is not None:
                optimizer.defaults["lr"] = default
        module = trainer.lightning_module
        if self.scale == REFERENCE and module.automatic_optimization:
            for name in _FORWARD_ONLY:
                module.__dict__.pop(name, None)
            module.__dict__.update(self._hooks)

    @override
    def callbacks(self) -> Sequence[Callback]:
        if self.scale == REFERENCE:
            return (_AtZero(),)
        trace = _Trace(self.lrs)
        return (trace,) if math.isinf(self.ceiling) else (trace, _StopWhen(broke_after(self.ceiling)))


class _Trace(Callback):
    """Keeps the run's LR (`lead_lr`) at each step's start: the LR the step trains at.

    The user's schedulers step after the update, so a trial at the user's LR shows whether their schedule rises under
    it (`lightning_speedkit.lr.rises`).
    """

    def __init__(self, lrs: list[float]) -> None:
        self.lrs = lrs

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if trainer.optimizers:
            self.lrs.append(lead_lr(trainer.optimizers))


class _AtZero(Callback):
    """Sets every LR to 0 before each optimizer step of the reference trial.

    Under manual optimization the user's ``training_step`` steps the optimizer and may step a schedule that computes
    the LR from its base LRs (``LambdaLR``), which would move the reference trial's LR off 0 after its first step.
    """

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        for group in optimizer.param_groups:
            group["lr"] = 0.0 * group["lr"]


def _closure_only(epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
    """An ``optimizer_step`` hook that runs the step's closure (its forward) and steps nothing."""
    if optimizer_closure is not None:
        optimizer_closure()


def _no_backward(loss: Any, *args: Any, **kwargs: Any) -> None:
    """A ``backward`` hook that computes no gradient."""


def _no_scheduler_step(scheduler: Any, metric: Any) -> None:
    """An ``lr_scheduler_step`` hook that leaves the LR where it is."""


_FORWARD_ONLY = {"optimizer_step": _closure_only, "backward": _no_backward, "lr_scheduler_step": _no_scheduler_step}
