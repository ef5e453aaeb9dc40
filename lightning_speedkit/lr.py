"""The one place that changes learning rates: optimizers and their schedulers together, with a warmup callback.

The maths of an LR range test is `lightning_speedkit.lr_range`'s, exported here too.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from torch import Tensor
from torch.optim import Optimizer

from lightning_speedkit.budget import budget_timer, estimated_budget
from lightning_speedkit.checks import is_number
from lightning_speedkit.lr_range import (
    MIN_SIGNAL,
    curve_signal,
    diverged,
    range_test_factors,
    smooth_losses,
    suggest_lr,
    valley_index,
)
from lightning_speedkit.report import log_rank_zero

if TYPE_CHECKING:
    import lightning.pytorch as pl

log = logging.getLogger(__name__)

__all__ = [
    "LR_GROUP_KEYS",
    "LR_SCHEDULER_ATTRS",
    "MIN_SIGNAL",
    "RAISED_RAMP",
    "WarmupLike",
    "curve_signal",
    "cyclic",
    "diverged",
    "log_step_lrs",
    "param_group_lrs",
    "range_test_factors",
    "rescale_run_lrs",
    "rises",
    "scale_lrs",
    "scale_trainer_lrs",
    "smooth_losses",
    "suggest_lr",
    "valley_index",
    "warmup_start",
    "warmups",
]

LR_GROUP_KEYS = ("lr", "initial_lr", "max_lr", "min_lr")
"""Param-group keys that hold an LR: ``lr``, the ``initial_lr`` schedulers start from, ``OneCycleLR``'s bounds."""

LR_SCHEDULER_ATTRS = ("base_lrs", "_last_lr", "max_lrs", "min_lrs", "eta_min")
"""Scheduler attributes that hold LRs (lists, or a number for ``eta_min``); missing ones are skipped."""


def _scaled(value: Any, factor: float, done: set[int]) -> Any:
    """``value * factor`` for a number; a tensor is scaled in place (once, even if shared) so compiled steps keep it."""
    if isinstance(value, Tensor):
        if id(value) not in done:
            done.add(id(value))
            value.mul_(factor)
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return value * factor
    return value


def param_group_lrs(optimizers: Iterable[Optimizer]) -> list[list[float]]:
    """The current ``lr`` of every param group of every optimizer, as floats.

    Example:
        >>> import torch
        >>> opt = torch.optim.SGD([{"params": [torch.zeros(1)]}, {"params": [torch.zeros(1)], "lr": 0.5}], lr=0.1)
        >>> param_group_lrs([opt])
        [[0.1, 0.5]]
    """
    return [[float(group["lr"]) for group in opt.param_groups] for opt in optimizers]


def warmup_start(optimizers: Iterable[Optimizer]) -> tuple[float, float] | None:
    """``(lr, initial_lr)`` of the first param group a scheduler holds below the LR it started from; else None.

    A torch scheduler records each group's ``initial_lr`` when it is made; at fit start a group's ``lr`` below it is
    a warmup's first step (``LinearLR``, ``ConstantLR``, a warming ``LambdaLR``, a ``SequentialLR`` that opens with
    one), whose LR rises to ``initial_lr`` later. Groups without ``initial_lr`` (no scheduler) never count.

    Example:
        >>> import torch
        >>> opt = torch.optim.SGD([torch.zeros(1)], lr=0.1)
        >>> warmup_start([opt]) is None
        True
        >>> _ = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.25, total_iters=10)
        >>> warmup_start([opt])
        (0.025, 0.1)
    """
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            lr, initial = _number(group.get("lr")), _number(group.get("initial_lr"))
            if lr is not None and initial is not None and lr < initial * (1 - 1e-9):
                return lr, initial
    return None


def cyclic(schedulers: Iterable[object]) -> str | None:
    """The class name of a scheduler that cycles the LR up to a maximum (``OneCycleLR``, ``CyclicLR``), else None.

    Such a schedule rises after fit start from the LR it starts at, which `warmup_start` cannot see; the LR trials
    see the rise under their steps (`rises`), a range test (which sets every step's LR itself) does not.

    Example:
        >>> import torch
        >>> opt = torch.optim.SGD([torch.zeros(1)], lr=0.1)
        >>> cyclic([torch.optim.lr_scheduler.StepLR(opt, 5)])
        >>> cyclic([torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=10)])
        'OneCycleLR'
    """
    for scheduler in schedulers:
        groups = getattr(getattr(scheduler, "optimizer", None), "param_groups", [])
        if hasattr(scheduler, "max_lrs") or any("max_lr" in group for group in groups):
            return type(scheduler).__name__
    return None


def _number(value: Any) -> float | None:
    """``value`` as a float: a finite number or a one-element tensor (a capturable optimizer's LR), else None."""
    if isinstance(value, Tensor) and value.numel() == 1:
        value = value.item()
    return float(value) if is_number(value) else None


def rises(lrs: Sequence[float]) -> bool:
    """Whether a run of step LRs goes above its first (by more than a billionth): a warmup or a cycle's rise.

    Example:
        >>> rises([0.1, 0.1, 0.09]), rises([0.01, 0.02, 0.03]), rises([])
        (False, True, False)
    """
    return bool(lrs) and max(lrs) > lrs[0] * (1 + 1e-9)


def scale_lrs(factor: float, optimizers: Iterable[Optimizer], schedulers: Iterable[object] = ()) -> None:
    """Multiply every LR held by ``optimizers`` and ``schedulers`` by ``factor``, so no scheduler undoes it.

    Writing only ``param_groups[i]["lr"]`` is undone by the next scheduler step (schedulers recompute from their
    ``base_lrs``; Lightning's ``LearningRateFinder`` has this bug). This writes the param groups' ``lr`` and
    ``initial_lr`` (and ``OneCycleLR``'s ``max_lr``/``min_lr``), the optimizers' default ``lr``, and each
    scheduler's ``base_lrs``, ``_last_lr``, ``max_lrs``, ``min_lrs`` and ``eta_min``, recursing into
    ``SequentialLR``/``ChainedScheduler``. Tensor LRs are scaled in place.

    Args:
        factor: Positive, finite multiplier.
        optimizers: Torch optimizers.
        schedulers: Torch schedulers, or Lightning ``LRSchedulerConfig`` objects (their ``.scheduler`` is used).

    Raises:
        ValueError: If ``factor`` is not a positive finite number.

    Example:
        >>> import torch
        >>> opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
        >>> sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        >>> scale_lrs(2.0, [opt], [sched])
        >>> opt.step(); sched.step()
        >>> param_group_lrs([opt])  # 0.1 * 2 * 0.5: the scheduler kept the rescale
        [[0.1]]
    """
    if not is_number(factor, 0, open_low=True):
        raise ValueError(f"`factor` must be a positive finite number, got {factor!r}.")
    done: set[int] = set()
    for opt in optimizers:
        for group in opt.param_groups:
            for key in LR_GROUP_KEYS:
                if key in group:
                    group[key] = _scaled(group[key], factor, done)
        if "lr" in opt.defaults:
            opt.defaults["lr"] = _scaled(opt.defaults["lr"], factor, done)
    seen: set[int] = set()
    pending = [getattr(s, "scheduler", s) for s in schedulers]
    while pending:
        sched = pending.pop()
        if id(sched) in seen:
            continue
        seen.add(id(sched))
        for attr in LR_SCHEDULER_ATTRS:
            value = getattr(sched, attr, None)
            if isinstance(value, list):
                setattr(sched, attr, [_scaled(v, factor, done) for v in value])
            elif value is not None:
                setattr(sched, attr, _scaled(value, factor, done))
        pending.extend(getattr(sched, "_schedulers", ()))


def scale_trainer_lrs(trainer: pl.Trainer, factor: float) -> None:
    """Multiply every LR of the Trainer's optimizers and LR scheduler configs by ``factor`` (see `scale_lrs`)."""
    scale_lrs(factor, trainer.optimizers, trainer.lr_scheduler_configs)
    log.debug("scaled all learning rates by %s", factor)


@runtime_checkable
class WarmupLike(Protocol):
    """How callbacks cooperate with a warmup callback (`lightning_speedkit.WarmupScheduler`), found by its methods.

    A callback that changes the LR (the batch-size finder, the LR finder, the training guard) asks the warmup to
    rescale its base LRs, so the warmup ramps to the new peak; one that rebuilds the optimizer (pruning) asks it to
    restart, then (when it is a ``Callback``) calls its ``on_train_batch_start`` so it resolves the new schedule and
    attaches to the new optimizers before the next step. Found with `warmups`, never by class name.
    """

    warmup: int | float
    total_steps: int | None

    def rescale_base_lrs(self, trainer: pl.Trainer, factor: float) -> None:
        """Multiply the base LRs by ``factor``; the warmup ramps to the new peak."""

    def set_warmup_steps(self, warmup_steps: int | float) -> None:
        """Make the warmup ``warmup_steps`` long (a float: that share of the budget, of the time without a step one)."""

    def restart(self, warmup: int | float, total_steps: int | None = None) -> None:
        """Start a new warmup and decay at the next batch."""


def warmups(trainer: pl.Trainer) -> list[WarmupLike]:
    """The warmup callbacks on ``trainer``, in callback order."""
    return [c for c in trainer.callbacks if isinstance(c, WarmupLike)]  # type: ignore[attr-defined]


def log_step_lrs(trainer: pl.Trainer, index: int, factor: float, lrs: Sequence[float], step: int) -> None:
    """Log a warmup's multiplier and optimizer ``index``'s LRs at ``step`` (rank zero, every ``log_every_n_steps``)."""
    every = max(1, int(getattr(trainer, "log_every_n_steps", 1)))
    if trainer.is_global_zero and trainer.loggers and step % every == 0:
        metrics = {"speedkit/lr/factor": factor}
        metrics.update({f"speedkit/lr/opt{index}_group{j}": float(lr) for j, lr in enumerate(lrs)})
        log_rank_zero(trainer, metrics, step=step)


RAISED_RAMP = 0.05
"""The least share of the steps left a warmup callback ramps over when the LR is raised, a 0-step warmup included:
the user's own LR runs from the first step (it is what they ran), a raised one is reached over a ramp."""


def rescale_run_lrs(trainer: pl.Trainer, scale: float, lengthen_warmup: bool = True) -> None:
    """Scale every LR of the run once; warmup callbacks follow, and lengthen their warmup when the LR grows.

    With a warmup callback the rescale goes through its ``rescale_base_lrs`` (so its ramp reaches the new peak);
    with ``lengthen_warmup`` and ``scale > 1`` each warmup's length is multiplied by ``scale``, and made at least
    `RAISED_RAMP` of its total (capped at the total), since a higher peak needs a ramp; a run with a time budget
    (``max_time``) and no step budget gets a ramp over a share of its time instead (at least `RAISED_RAMP`, a
    warmup share of yours multiplied by ``scale``, at most half). Without a warmup callback, `scale_trainer_lrs` does
    it.
    """
    found = warmups(trainer)
    if not found:
        scale_trainer_lrs(trainer, scale)
        return
    found[0].rescale_base_lrs(trainer, scale)
    if scale <= 1.0 or not lengthen_warmup:
        return
    estimated = estimated_budget(trainer)
    remaining = None if math.isinf(estimated) else max(1, int(estimated) - trainer.global_step)
    for warmup in found:
        total = warmup.total_steps or remaining
        steps = warmup.warmup if isinstance(warmup.warmup, int) else None
        if steps is None and total is not None:
            steps = math.ceil(warmup.warmup * total)
        longer = math.ceil((steps or 0) * scale)
        if total is not None:
            longer = min(max(longer, math.ceil(RAISED_RAMP * total)), total)
        if longer:
            warmup.set_warmup_steps(longer)
        elif budget_timer(trainer) is not None:  # a time budget alone: the ramp takes its share of the time
            share = warmup.warmup if isinstance(warmup.warmup, float) else 0.0
            warmup.set_warmup_steps(max(RAISED_RAMP, min(share * scale, 0.5)))  # half the time at most
