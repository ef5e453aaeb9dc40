"""The one place that changes learning rates, and the maths of an LR range test.

Rescaling writes optimizers and their schedulers together and cooperates with a warmup callback; the range test's
schedule, smoothing and "valley" rule are pure functions here, used by `lightning_speedkit.LRFinder`.
"""

from __future__ import annotations

import itertools
import logging
import math
import statistics
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from torch import Tensor
from torch.optim import Optimizer

from lightning_speedkit.checks import check_number, is_int, is_number

if TYPE_CHECKING:
    import lightning.pytorch as pl

log = logging.getLogger(__name__)

__all__ = [
    "LR_GROUP_KEYS",
    "LR_SCHEDULER_ATTRS",
    "WarmupLike",
    "cyclic",
    "diverged",
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

    def set_warmup_steps(self, warmup_steps: int) -> None:
        """Make the warmup ``warmup_steps`` long."""

    def restart(self, warmup: int | float, total_steps: int | None = None) -> None:
        """Start a new warmup and decay at the next batch."""


def warmups(trainer: pl.Trainer) -> list[WarmupLike]:
    """The warmup callbacks on ``trainer``, in callback order."""
    return [c for c in trainer.callbacks if isinstance(c, WarmupLike)]  # type: ignore[attr-defined]


RAISED_RAMP = 0.05
"""The least share of the steps left a warmup callback ramps over when the LR is raised, a 0-step warmup included:
the user's own LR runs from the first step (it is what they ran), a raised one is reached over a ramp."""


def rescale_run_lrs(trainer: pl.Trainer, scale: float, lengthen_warmup: bool = True) -> None:
    """Scale every LR of the run once; warmup callbacks follow, and lengthen their warmup when the LR grows.

    With a warmup callback the rescale goes through its ``rescale_base_lrs`` (so its ramp reaches the new peak);
    with ``lengthen_warmup`` and ``scale > 1`` each warmup's length is multiplied by ``scale``, and made at least
    `RAISED_RAMP` of its total (capped at the total), since a higher peak needs a ramp. Without one,
    `scale_trainer_lrs` does it.
    """
    found = warmups(trainer)
    if not found:
        scale_trainer_lrs(trainer, scale)
        return
    found[0].rescale_base_lrs(trainer, scale)
    if scale <= 1.0 or not lengthen_warmup:
        return
    estimated = trainer.estimated_stepping_batches
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


# ---------------------------------------------------------------------------------------------------- LR range test
def range_test_factors(steps: int, start_factor: float = 0.01, end_factor: float = 100.0) -> list[float]:
    """Multipliers of the user's LR for an LR range test: ``steps`` values growing exponentially between the bounds.

    Example:
        >>> [round(f, 4) for f in range_test_factors(5)]
        [0.01, 0.1, 1.0, 10.0, 100.0]
    """
    if not is_int(steps, low=2):
        raise ValueError(f"`steps` must be an int >= 2, got {steps!r}.")
    for name, value in (("start_factor", start_factor), ("end_factor", end_factor)):
        if not is_number(value, 0, open_low=True):
            raise ValueError(f"`{name}` must be a positive finite number, got {value!r}.")
    if end_factor <= start_factor:
        raise ValueError(f"`end_factor` must be greater than `start_factor` ({start_factor}), got {end_factor!r}.")
    ratio = (end_factor / start_factor) ** (1.0 / (steps - 1))
    return [start_factor * ratio**k for k in range(steps)]


def smooth_losses(losses: Sequence[float], beta: float = 0.9) -> list[float]:
    """Exponentially smoothed losses, bias-corrected as in fastai's LR finder (the first value is the first loss).

    Example:
        >>> [round(v, 3) for v in smooth_losses([1.0, 0.0, 0.0], beta=0.5)]
        [1.0, 0.333, 0.143]
    """
    if not is_number(beta, 0, 1, open_high=True):
        raise ValueError(f"`beta` must be in [0, 1), got {beta!r}.")
    out, average = [], 0.0
    for k, loss in enumerate(losses, start=1):
        average = beta * average + (1.0 - beta) * loss
        out.append(average / (1.0 - beta**k))
    return out


def diverged(smoothed: Sequence[float], factor: float = 4.0) -> bool:
    """Whether the last smoothed loss is non-finite or above ``factor`` times the lowest so far (the test stops).

    Example:
        >>> diverged([2.0, 1.0, 3.9]), diverged([2.0, 1.0, 4.1]), diverged([2.0, float("nan")])
        (False, True, True)
    """
    if not smoothed:
        return False
    last = smoothed[-1]
    return not math.isfinite(last) or last > factor * min(smoothed)


def valley_index(losses: Sequence[float]) -> int | None:
    """Fastai's "valley" rule: the index a little past the middle of the longest stretch where the loss falls.

    The longest decreasing subsequence of the (smoothed) losses marks the valley; the suggestion sits in its middle
    third. Unlike the steepest slope (Lightning's rule, fooled by an early spike: Lightning issue #1767), one noisy
    step cannot move it far. None when the loss never falls.

    Example:
        >>> valley_index([3.0, 2.9, 2.5, 2.0, 1.5, 1.2, 1.1, 2.0, 9.0])
        2
        >>> valley_index([1.0, 2.0, 3.0]) is None
        True
    """
    n = len(losses)
    if n < 2:
        return None
    longest = [1] * n
    start = end = 0
    for i in range(1, n):
        for j in range(i):
            if losses[i] < losses[j] and longest[i] < longest[j] + 1:
                longest[i] = longest[j] + 1
        if longest[end] < longest[i]:
            end, start = i, i - longest[i]
    if end == 0:
        return None
    third = (end - start) / 3
    return max(0, min(n - 1, start + int(third) + int(third / 2)))


MIN_SIGNAL = 3.0
"""How many times its own noise the loss must fall during a range test before the test suggests an LR."""


def curve_signal(losses: Sequence[float], beta: float = 0.9) -> float:
    """How far a range test's loss falls, in units of its noise: ~0 to 2 on a plateau, well above 3 when it learns.

    The fall is from the mean of the first tenth-to-quarter of the steps (at most 10) to the lowest smoothed loss
    after them. The noise of one loss is estimated from the median step-to-step difference (robust to the trend and
    to one spike; ``0.954 s`` for Gaussian noise of sd ``s``), and the fall's own spread from that. A net that sits at
    its chance loss for hundreds of steps (the demo's ResNet does) gives a curve whose "valley" is noise: 0.3-2.0 on
    seeds 0-4 (``benchmarks/results/demo.json``); the small nets of ``tests/test_lr_finder.py``, which learn within the
    test, score well above `MIN_SIGNAL` and get their suggestion.

    Example:
        >>> curve_signal([2.3, 2.3, 2.2, 1.9, 1.4, 1.0, 0.9, 3.0, 20.0], beta=0.0) > MIN_SIGNAL
        True
        >>> round(curve_signal([2.35, 2.30, 2.38, 2.31, 2.36, 2.29, 2.37, 2.33, 2.34, 2.30], beta=0.0), 2)
        0.55
    """
    finite = [loss for loss in losses if math.isfinite(loss)]
    head = max(2, min(10, len(finite) // 4))
    if len(finite) <= head:
        return 0.0
    fall = statistics.fmean(finite[:head]) - min(smooth_losses(finite, beta)[head:])
    noise = statistics.median(abs(b - a) for a, b in itertools.pairwise(finite)) / 0.954
    spread = noise * math.sqrt(1 / head + (1 - beta) / (1 + beta))
    if fall <= 0:
        return 0.0
    return math.inf if spread == 0 else fall / spread


def suggest_lr(
    lrs: Sequence[float], losses: Sequence[float], beta: float = 0.9, min_signal: float = MIN_SIGNAL
) -> tuple[float | None, str]:
    """The LR an LR range test suggests (None if none), and why: the valley of the smoothed curve.

    No LR is suggested when the loss never falls, or falls by less than ``min_signal`` times its noise
    (`curve_signal`; default `MIN_SIGNAL`): the valley of a flat, noisy curve is noise, and following it moved the
    demo's LR by x0.17. ``min_signal=0`` follows any valley, as fastai's rule does.

    Example:
        >>> lrs = [1e-4 * 10 ** (k / 2) for k in range(9)]
        >>> lr, why = suggest_lr(lrs, [2.3, 2.3, 2.2, 1.9, 1.4, 1.0, 0.9, 3.0, 20.0], beta=0.0)
        >>> round(lr, 6), why
        (0.003162, 'valley of the smoothed loss (steps 1-6 of 9)')
    """
    if len(lrs) != len(losses):
        raise ValueError(f"`lrs` and `losses` must have the same length, got {len(lrs)} and {len(losses)}.")
    min_signal = check_number("min_signal", min_signal, 0)
    finite = [k for k, loss in enumerate(losses) if math.isfinite(loss)]
    usable = finite[-1] + 1 if finite and finite == list(range(len(finite))) else len(finite)
    smoothed = smooth_losses(list(losses[:usable]), beta)
    index = valley_index(smoothed)
    if index is None:
        return None, f"the loss never fell over {usable} steps"
    signal = curve_signal(losses[:usable], beta)
    if signal < min_signal:
        return None, (
            f"the loss fell only {signal:.1f}x its noise over {usable} steps ({min_signal:g}x needed): a plateau, no"
            " signal to follow"
        )
    drops = [k for k in range(1, len(smoothed)) if smoothed[k] < smoothed[k - 1]]
    first, last = (drops[0] - 1, drops[-1]) if drops else (0, 0)
    return float(lrs[index]), f"valley of the smoothed loss (steps {first}-{last} of {len(losses)})"
