"""The one place that changes learning rates: rescale optimizers and their schedulers together."""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from torch import Tensor
from torch.optim import Optimizer

if TYPE_CHECKING:
    import lightning.pytorch as pl

log = logging.getLogger(__name__)

__all__ = ["LR_GROUP_KEYS", "LR_SCHEDULER_ATTRS", "param_group_lrs", "scale_lrs", "scale_trainer_lrs"]

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
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not (math.isfinite(factor) and factor > 0):
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
