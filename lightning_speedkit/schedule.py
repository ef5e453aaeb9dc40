"""The maths of an LR schedule: linear warmup, then warmup-stable-decay (the default), cosine, linear or constant.

Pure functions, used by `lightning_speedkit.WarmupScheduler` (the run's budget it follows, in steps and in time, is
read by `lightning_speedkit.budget`, whose readers this module also exports). The default, ``"wsd"``
(warmup-stable-decay: MiniCPM, DeepSeek; Hägele et al. 2024, "Scaling Laws and Compute-Optimal Training Beyond Fixed
Training Durations"), holds the user's LR after the warmup and cools down only over the last ``cooldown`` fraction
of the budget, with the ``1 - sqrt`` shape that paper found best. Until the cool-down the run is the constant-LR run;
cosine instead lowers the LR from the first step after warmup, so its mean LR over the run is half the user's.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from lightning_speedkit.budget import (
    TIME_EVERY,
    budget_pending,
    budget_steps,
    budget_timer,
    budget_total,
    rebudgeted,
    schedule_step,
    time_fraction,
)
from lightning_speedkit.checks import check_choice, is_int, is_number

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = [
    "AUTO",
    "DECAYS",
    "TIME_EVERY",
    "budget_pending",
    "budget_steps",
    "budget_timer",
    "budget_total",
    "check_cooldown",
    "check_schedule",
    "check_warmup",
    "cooldown_start",
    "decay_progress",
    "factor_at",
    "fall",
    "rebudgeted",
    "resolve_decay",
    "schedule_step",
    "scheduler_names",
    "still_falling",
    "time_fraction",
    "warmup_factor",
    "warmup_steps_of",
]

DECAYS = ("wsd", "constant", "cosine", "linear")
"""The decays after warmup that `warmup_factor` and `lightning_speedkit.WarmupScheduler` accept (the callback takes
`AUTO` too, resolved to one of these); the first is the default."""
AUTO = "auto"
"""``decay="auto"`` (`lightning_speedkit.preset`'s): ``"wsd"``, or ``"constant"`` under an LR scheduler of the user's
own (`resolve_decay`)."""
_BUDGETED = ("wsd", "cosine", "linear")
FALLING_Z = 3.0
"""`still_falling`: standard errors by which the second half's mean loss must lie below the first half's."""
FALLING_DROP = 0.02
"""`still_falling`: the relative drop of the mean loss below which the loss counts as flat, whatever its noise."""


def check_warmup(warmup: int | float) -> None:
    """Raise ``ValueError`` unless ``warmup`` is an int >= 0 (steps) or a float in (0, 1) (fraction)."""
    if not is_int(warmup, low=0) and not (isinstance(warmup, float) and 0.0 < warmup < 1.0):
        raise ValueError(f"`warmup` must be an int >= 0 (steps) or a float in (0, 1) (fraction), got {warmup!r}.")


def warmup_steps_of(warmup: int | float, total: int | None) -> int:
    """A warmup in steps: ``warmup`` itself (steps), or that share of ``total`` steps rounded up (0 with no total).

    Example:
        >>> warmup_steps_of(5, 100), warmup_steps_of(0.05, 90), warmup_steps_of(0.05, None)
        (5, 5, 0)
    """
    if is_int(warmup):
        return int(warmup)
    return 0 if total is None else math.ceil(warmup * total)


def check_cooldown(cooldown: float) -> float:
    """``cooldown`` as a float, or ``ValueError`` naming it unless it is a number in [0, 1).

    Example:
        >>> check_cooldown(0.2)
        0.2
        >>> check_cooldown(1.0)
        Traceback (most recent call last):
        ...
        ValueError: `cooldown` must be a fraction of the budget in [0, 1), got 1.0.
    """
    if not is_number(cooldown, 0, 1, open_high=True):
        raise ValueError(f"`cooldown` must be a fraction of the budget in [0, 1), got {cooldown!r}.")
    return float(cooldown)


def check_schedule(
    warmup_steps: int,
    total_steps: int | None,
    decay: str,
    min_lr_ratio: float,
    start_factor: float,
    warmup_name: str = "warmup_steps",
    cooldown: float = 0.2,
    decays: Sequence[str] = DECAYS,
) -> None:
    """Raise ``ValueError`` naming the argument and its value if the schedule is not valid (``decay`` of ``decays``)."""
    if not is_int(warmup_steps, low=0):
        raise ValueError(f"`{warmup_name}` must be a non-negative int, got {warmup_steps!r}.")
    if total_steps is not None and not is_int(total_steps, low=1):
        raise ValueError(f"`total_steps` must be a positive int or None, got {total_steps!r}.")
    if total_steps is not None and warmup_steps > total_steps:
        raise ValueError(f"`{warmup_name}` must not exceed `total_steps` ({total_steps}), got {warmup_steps}.")
    check_choice("decay", decay, decays)
    if not is_number(min_lr_ratio, 0, 1):
        raise ValueError(f"`min_lr_ratio` must be in [0, 1], got {min_lr_ratio!r}.")
    if not is_number(start_factor, 0, 1):
        raise ValueError(f"`start_factor` must be in [0, 1], got {start_factor!r}.")
    check_cooldown(cooldown)


def scheduler_names(trainer: pl.Trainer) -> list[str]:
    """The class names of the trainer's LR schedulers, in order (what `resolve_decay` and a decision's key read).

    Example:
        >>> from types import SimpleNamespace
        >>> import torch
        >>> optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
        >>> config = SimpleNamespace(scheduler=torch.optim.lr_scheduler.StepLR(optimizer, step_size=10))
        >>> scheduler_names(SimpleNamespace(lr_scheduler_configs=[config]))
        ['StepLR']
    """
    return [type(config.scheduler).__name__ for config in trainer.lr_scheduler_configs]


def resolve_decay(decay: str, schedulers: Sequence[str]) -> tuple[str, str]:
    """The decay to run on top of the user's own LR ``schedulers`` (their class names), and a warning ("" for none).

    ``"auto"`` runs ``"wsd"``, or ``"constant"`` when the user has a scheduler: theirs sets the LR after the warmup,
    and a cool-down multiplied on top would take it below the LR they scheduled (on ``benchmarks/lr_tasks.py
    --schedule linear`` the transformer's trajectory at its right LR under `lightning_speedkit.preset`, seed 2, was
    the plain loop's until the cool-down began, and then crossed the target an epoch later). Another decay is run as
    asked; on top of a scheduler, unless ``"constant"``, the two multiply and the warning says so.

    Example:
        >>> resolve_decay("auto", []), resolve_decay("auto", ["LambdaLR"]), resolve_decay("cosine", [])
        (('wsd', ''), ('constant', ''), ('cosine', ''))
        >>> resolve_decay("wsd", ["StepLR"])[1].split(";")[0]
        'the wsd decay multiplies on top of your scheduler(s) StepLR'
    """
    if decay == AUTO:
        return ("constant" if schedulers else "wsd"), ""
    if schedulers and decay != "constant":
        names = ", ".join(schedulers)
        return decay, (
            f"the {decay} decay multiplies on top of your scheduler(s) {names}; pass decay='auto' to keep only yours"
            " after the warmup"
        )
    return decay, ""


def cooldown_start(warmup_steps: int, total_steps: int, cooldown: float) -> int:
    """The first step of a ``"wsd"`` cool-down over the last ``cooldown`` of ``total_steps``, never inside the warmup.

    Example:
        >>> cooldown_start(0, 900, 0.2), cooldown_start(850, 900, 0.2)
        (720, 850)
    """
    return max(warmup_steps, total_steps - round(cooldown * total_steps))


def still_falling(losses: Sequence[float], z: float = FALLING_Z, min_drop: float = FALLING_DROP) -> tuple[bool, float]:
    """Whether the loss still falls over ``losses`` (training losses in step order) at a constant LR.

    The mean of the second half is compared with the first half's: the loss still falls when it is lower by more
    than ``z`` standard errors of that difference and by more than ``min_drop`` of the first half's mean. A run
    whose loss still falls at its peak LR is limited by that LR, not by the noise a cool-down takes out: cooling
    down would slow it. A non-finite loss, or fewer than 8 values, says no.

    Returns:
        ``(falling, drop)``: the verdict and the relative drop of the mean, ``(first - second) / first``.

    Example:
        >>> import random
        >>> rng = random.Random(0)
        >>> falling = [1.0 - 0.002 * k + rng.gauss(0, 0.05) for k in range(200)]
        >>> flat = [0.6 + rng.gauss(0, 0.05) for k in range(200)]
        >>> still_falling(falling)[0], still_falling(flat)[0]
        (True, False)
    """
    half = len(losses) // 2
    if half < 4 or not all(math.isfinite(v) for v in losses):
        return False, 0.0
    z_fall, relative = fall(losses)
    return z_fall > z and relative > min_drop, round(relative, 4)


def fall(losses: Sequence[float]) -> tuple[float, float]:
    """How far the mean of ``losses`` fell from their first half to their second (at least 4 values a half).

    Returns:
        ``(z, relative)``: the fall in standard errors of the difference of the two means (pooled variance;
        infinite for a fall with no spread at all), and relative to the first half's mean.

    Example:
        >>> [round(v, 3) for v in fall([1.0, 1.2, 1.0, 1.2, 0.8, 1.0, 0.8, 1.0])]
        [2.449, 0.182]
    """
    half = len(losses) // 2
    first, second = losses[:half], losses[-half:]
    mean_first, mean_second = math.fsum(first) / half, math.fsum(second) / half
    spread = sum((v - mean_first) ** 2 for v in first) + sum((v - mean_second) ** 2 for v in second)
    error = math.sqrt(spread / (2 * half - 2) * 2 / half)
    drop = mean_first - mean_second
    z = drop / error if error else (math.copysign(math.inf, drop) if drop else 0.0)  # no spread: any fall is certain
    return z, (drop / abs(mean_first) if mean_first else 0.0)


def decay_progress(
    step: int,
    warmup_steps: int,
    total_steps: int | None,
    decay: str,
    cooldown: float = 0.2,
    time_fraction: float | None = None,
) -> float:
    """How far the decay has gone at ``step``, in [0, 1]: 0 before it starts, 1 at the end of the budget.

    For ``"cosine"`` and ``"linear"`` the decay spans every step after the warmup; for ``"wsd"`` only the last
    ``cooldown`` fraction of ``total_steps`` (never before the warmup ends). ``time_fraction`` is the share of a
    time budget already spent (a Trainer's ``max_time``): the decay is then as far along as the further of the two
    budgets says, so a run that will run out of time cools down before it does. ``"constant"`` never decays.

    Example:
        >>> [decay_progress(k, 0, 10, "wsd", cooldown=0.5) for k in (0, 5, 6, 10)]
        [0.0, 0.0, 0.2, 1.0]
        >>> decay_progress(2, 0, 100, "wsd", cooldown=0.5, time_fraction=0.75)
        0.5
    """
    if decay == "constant":
        return 0.0
    span_start = warmup_steps
    if decay == "wsd" and total_steps is not None:
        span_start = cooldown_start(warmup_steps, total_steps, cooldown)
    by_steps = 0.0
    if total_steps is not None and step >= span_start:
        by_steps = 1.0 if total_steps <= span_start else (step - span_start) / (total_steps - span_start)
    by_time = 0.0
    if time_fraction is not None:  # a warmup the clock ended counts as ended (`factor_at`)
        window = cooldown if decay == "wsd" else 1.0
        by_time = 1.0 if window == 0 else (time_fraction - (1.0 - window)) / window
    return min(1.0, max(0.0, by_steps, by_time))


def warmup_factor(
    step: int,
    warmup_steps: int,
    total_steps: int | None = None,
    decay: str = "wsd",
    min_lr_ratio: float = 0.0,
    start_factor: float = 0.0,
    cooldown: float = 0.2,
    time_fraction: float | None = None,
    warmup_share: float = 0.0,
    time_start: float = 0.0,
) -> float:
    """LR multiplier at optimizer step ``step`` of a linear warmup followed by a decay.

    For ``step < warmup_steps`` it is ``start_factor + (1 - start_factor) * step / warmup_steps`` (torch's
    ``LinearLR``). After that it is ``min_lr_ratio + (1 - min_lr_ratio) * d`` with ``p`` = `decay_progress`:
    ``d = 1 - sqrt(p)`` for ``"wsd"`` (1 until the cool-down, the last ``cooldown`` fraction of the budget),
    ``d = (1 + cos(pi * p)) / 2`` for ``"cosine"`` (torch's ``CosineAnnealingLR``), ``d = 1 - p`` for ``"linear"``;
    ``"constant"`` gives 1.

    Args:
        step: Optimizer steps since the schedule started (0 for the first step).
        warmup_steps: Steps of linear warmup; 0 for none.
        total_steps: Steps of warmup plus decay; None only for ``decay="constant"`` or with ``time_fraction``.
        decay: One of `DECAYS`.
        min_lr_ratio: Floor of the decay, as a fraction of the base LR.
        start_factor: Multiplier at step 0 of the warmup.
        cooldown: For ``"wsd"``: the fraction of the budget the cool-down takes, in [0, 1).
        time_fraction: The share of a time budget already spent, or None when the run has none.
        warmup_share: With a time budget and no step budget (``total_steps`` None): the share of the time left at the
            schedule's start the warmup takes, in [0, 1) (0: ``warmup_steps`` alone); the ramp follows the clock.
        time_start: The share of the time budget spent when the schedule started (``time_fraction`` at step 0): the
            warmup and the decay by time span the time left then.

    Raises:
        ValueError: If an argument is out of range (the message names it and its value).

    Example:
        >>> [round(warmup_factor(k, warmup_steps=2, total_steps=10), 3) for k in range(11)]
        [0.0, 0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.293, 0.0]
        >>> [round(warmup_factor(k, warmup_steps=2, total_steps=6, decay="cosine"), 3) for k in range(7)]
        [0.0, 0.5, 1.0, 0.854, 0.5, 0.146, 0.0]
        >>> warmup_factor(1, warmup_steps=4, decay="constant", start_factor=0.2)
        0.4
        >>> warmup_factor(5, warmup_steps=4, total_steps=6, decay="linear", min_lr_ratio=0.5)
        0.75
        >>> warmup_factor(30, warmup_steps=0, time_fraction=0.625, warmup_share=0.5, time_start=0.5)
        0.5
    """
    check_schedule(warmup_steps, total_steps, decay, min_lr_ratio, start_factor, cooldown=cooldown)
    if total_steps is None and time_fraction is None and decay in _BUDGETED:
        raise ValueError(f"`total_steps` is needed for decay={decay!r}, got None.")
    if not is_int(step, low=0):
        raise ValueError(f"`step` must be a non-negative int, got {step!r}.")
    if time_fraction is not None and not is_number(time_fraction, 0):
        raise ValueError(f"`time_fraction` must be a number >= 0 or None, got {time_fraction!r}.")
    for name, share in (("warmup_share", warmup_share), ("time_start", time_start)):
        if not is_number(share, 0, 1, open_high=True):
            raise ValueError(f"`{name}` must be a share of the time in [0, 1), got {share!r}.")
    floor, start, spent = min_lr_ratio, start_factor, time_fraction
    return factor_at(step, warmup_steps, total_steps, decay, floor, start, cooldown, spent, warmup_share, time_start)


def factor_at(
    step: int,
    warmup_steps: int,
    total_steps: int | None,
    decay: str,
    min_lr_ratio: float,
    start_factor: float,
    cooldown: float,
    time_fraction: float | None,
    warmup_share: float = 0.0,
    time_start: float = 0.0,
) -> float:
    """`warmup_factor` of arguments already checked (a callback's, once per optimizer step: no checks here).

    The time the schedule has had is the share of the time left at its start (``time_start``: a restarted schedule's
    warmup and decay span the time left then, as its steps span the steps left).
    """
    spent = None if time_fraction is None else max(0.0, time_fraction - time_start) / max(1e-9, 1.0 - time_start)
    done = step / warmup_steps if step < warmup_steps else 1.0
    if spent is not None and total_steps is None and warmup_share:  # no step budget: a ramp over time
        done = min(1.0, spent / warmup_share)
    elif done < 1.0 and spent is not None and total_steps:  # the warmup's share of the time: whichever first
        done = min(1.0, max(done, spent * total_steps / warmup_steps))
    if done < 1.0:
        return start_factor + (1.0 - start_factor) * done
    if decay == "constant":
        return 1.0
    progress = decay_progress(step, warmup_steps, total_steps, decay, cooldown, spent)
    if decay == "wsd":
        remaining = 1.0 - math.sqrt(progress)
    elif decay == "cosine":
        remaining = (1.0 + math.cos(math.pi * progress)) / 2.0
    else:
        remaining = 1.0 - progress
    return min_lr_ratio + (1.0 - min_lr_ratio) * remaining
