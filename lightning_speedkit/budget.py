"""A run's budget as the Trainer holds it: the steps a schedule counts and has, and the share of a ``max_time`` spent.

Read by `lightning_speedkit.WarmupScheduler` (and the cool-down check, the guard) from the running Trainer; the maths
of the schedule itself is `lightning_speedkit.schedule`'s.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from lightning.pytorch.callbacks import Timer

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = [
    "TIME_EVERY",
    "budget_pending",
    "budget_steps",
    "budget_timer",
    "budget_total",
    "estimated_budget",
    "rebudgeted",
    "schedule_step",
    "time_fraction",
]

TIME_EVERY = 20
"""Optimizer steps between readings of a time budget's clock: rank zero reads it and every rank gets its value, so
every rank applies the same LR."""


def schedule_step(trainer: pl.Trainer) -> int:
    """The steps a schedule has counted, in the unit of ``trainer.estimated_stepping_batches``.

    ``trainer.global_step`` (optimizer steps, so accumulation counts right) under automatic optimization; under
    manual optimization, where ``global_step`` counts every ``optimizer.step()`` of every optimizer (two a batch in a
    GAN), the batches trained. Both count the current batch once its step is done (from ``on_train_batch_end``), and
    both are restored on a resume.
    """
    module = trainer.lightning_module
    if module is None or module.automatic_optimization:
        return trainer.global_step
    return int(trainer.fit_loop.epoch_loop.batch_progress.total.processed)  # type: ignore[attr-defined]


def estimated_budget(trainer: pl.Trainer) -> float:
    """``trainer.estimated_stepping_batches``, with ``inf`` for a budget the Trainer cannot tell.

    Lightning answers ``max_steps`` for a train loader without a length (an ``IterableDataset``), which is ``-1`` when
    only ``max_epochs`` bounds the fit: read as a budget, -1 made a schedule of one step (LR 0 from the second on)
    and left the levers 0 steps to repay a probe.
    """
    estimated = float(trainer.estimated_stepping_batches)
    return math.inf if estimated < 0 else estimated


def budget_steps(trainer: pl.Trainer) -> float:
    """The Trainer's budget (``trainer.estimated_stepping_batches``) in the unit of `schedule_step`.

    Under manual optimization the schedule counts batches, while ``max_steps`` counts every ``optimizer.step()`` (two
    a batch in a GAN): ``max_steps`` over the optimizer steps a batch has taken so far (one, before a batch has
    ended), or the epochs' batches when fewer (`budget_pending`: whether that is still a guess).
    """
    if not _manual_max_steps(trainer):  # the Trainer's own unit
        return estimated_budget(trainer)
    per_batch = trainer.global_step / done if (done := schedule_step(trainer)) and trainer.global_step else 1.0
    epochs, per_epoch = trainer.max_epochs, float(trainer.num_training_batches)
    by_epochs = math.inf if epochs in (None, -1) or math.isinf(per_epoch) else math.ceil(per_epoch) * max(epochs, 1)
    return float(min(math.ceil(trainer.max_steps / per_batch), by_epochs))


def budget_pending(trainer: pl.Trainer, start: int) -> bool:
    """Whether `budget_steps` guesses a batch's optimizer steps: no batch of a schedule from ``start`` ended yet."""
    return _manual_max_steps(trainer) and schedule_step(trainer) == start


def _manual_max_steps(trainer: pl.Trainer) -> bool:
    module = trainer.lightning_module
    return module is not None and not module.automatic_optimization and trainer.max_steps != -1


def budget_total(estimated: float, start: int) -> int | None:
    """The steps a schedule started at step ``start`` has in a budget of ``estimated`` steps (None: no end).

    Example:
        >>> budget_total(100, 10), budget_total(5, 10), budget_total(math.inf, 0)
        (90, 1, None)
    """
    return None if math.isinf(estimated) else max(1, int(estimated) - start)


def rebudgeted(total: int | None, start: int, estimated: float) -> int | None:
    """A schedule's new total when the Trainer's budget changed (a resumed fit given more epochs), else None.

    ``total`` was sized from the budget (``estimated`` steps then, less the ``start`` step); a resume reads it again.

    Example:
        >>> rebudgeted(50, 0, 100), rebudgeted(40, 10, 50), rebudgeted(None, 0, 100), rebudgeted(50, 0, math.inf)
        (100, None, None, None)
    """
    new = None if total is None else budget_total(estimated, start)
    return new if new != total else None


def budget_timer(trainer: pl.Trainer) -> Timer | None:
    """The Trainer's ``max_time`` timer, when it has a time budget."""
    return next((c for c in trainer.callbacks if isinstance(c, Timer) and c._duration), None)  # type: ignore[attr-defined]


def time_fraction(trainer: pl.Trainer, last: float | None, every: int | None = None) -> float | None:
    """The share of the Trainer's time budget spent (None without one), read every ``every`` steps on rank zero.

    ``every`` None: every `TIME_EVERY` steps (read at the call: a test may change it).
    """
    timer = budget_timer(trainer)
    if timer is None:
        return None
    if last is not None and schedule_step(trainer) % (every or TIME_EVERY):
        return last
    spent = timer.time_elapsed("train") / float(timer._duration or 1.0)
    return float(trainer.strategy.broadcast(spent, src=0))
