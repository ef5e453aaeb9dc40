"""The search maths of the batch-size finder: which size to try next, which to keep, and how the LR follows."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import NamedTuple

from lightning_speedkit.checks import check_choice, check_int

__all__ = [
    "LR_SCALINGS",
    "MODES",
    "OBJECTIVES",
    "Choice",
    "apply_margin",
    "choose_batch_size",
    "hold_global_batch",
    "lr_scale_factor",
    "next_trial_size",
    "run_cap",
]

MODES = ("binsearch", "power")
"""Search modes: ``"power"`` doubles until a size fails; ``"binsearch"`` then bisects between the two."""

OBJECTIVES = ("memory", "throughput")
"""What the finder maximises: the largest size that fits, or the smallest size within a tolerance of the best speed."""

LR_SCALINGS = ("linear", "none", "sqrt")
"""How the LR follows the global batch: in proportion, not at all, or with the square root of the ratio."""


def _bounds(results: Mapping[int, bool]) -> tuple[int, int | None]:
    """``(largest size that fit or 0, smallest failed size above it or None)``."""
    low = max((size for size, fits in results.items() if fits), default=0)
    high = min((size for size, fits in results.items() if not fits and size > low), default=None)
    return low, high


def next_trial_size(mode: str, results: Mapping[int, bool], init_val: int, cap: int) -> int | None:
    """The next batch size to try given the ``{size: fits}`` results so far, or None when the search is over.

    Starts at ``init_val``; doubles while sizes fit, trying ``cap`` itself rather than a size beyond it; halves
    while nothing has fit yet. After the first failure above a size that fit, ``"power"`` stops and
    ``"binsearch"`` bisects until the two are adjacent. Every size returned is in ``[1, cap]``.

    Example:
        >>> next_trial_size("binsearch", {}, init_val=32, cap=100)
        32
        >>> next_trial_size("binsearch", {32: True, 64: True}, init_val=32, cap=100)  # cap itself, not 128
        100
        >>> next_trial_size("binsearch", {32: True, 64: True, 100: False}, init_val=32, cap=100)
        82
        >>> next_trial_size("power", {32: True, 64: False}, init_val=32, cap=100) is None
        True
        >>> next_trial_size("power", {300: False}, init_val=300, cap=1000)  # nothing fit yet: halve
        150
    """
    if not results:
        return max(1, min(init_val, cap))
    low, high = _bounds(results)
    if high is None:
        return None if low >= cap else min(2 * low, cap)
    if low == 0:
        return None if high <= 1 else high // 2
    if mode == "power" or high - low <= 1:
        return None
    return (low + high) // 2


def apply_margin(size: int, margin: float) -> int:
    """``size`` reduced by the fraction ``margin``, rounded down, at least 1.

    Example:
        >>> apply_margin(100, 0.1), apply_margin(10, 0.1), apply_margin(1, 0.5)
        (90, 9, 1)
    """
    return max(1, int(size * (1.0 - margin) + 1e-9))


class Choice(NamedTuple):
    """The size `choose_batch_size` picked and the reason, in words."""

    size: int | None
    reason: str


def choose_batch_size(
    results: Mapping[int, bool],
    margin: float,
    throughputs: Mapping[int, float] | None = None,
    tolerance: float = 0.05,
) -> Choice:
    """Pick the batch size from the trial results: ``None`` when nothing fit.

    With ``throughputs`` (samples/s of the sizes that fit) it is the smallest size within ``tolerance`` of the
    fastest; otherwise the largest size that fit. Where a failed size bounds the sizes that fit (a memory limit was
    found), the result is also at most the largest that fit less ``margin``, in every mode; a cap that was reached
    without any failure (``max_val``, the dataset length) is not reduced.

    Example:
        >>> choose_batch_size({64: True, 128: True, 200: False, 164: True, 182: False}, margin=0.1)
        Choice(size=147, reason='largest that fit 164, out of memory at 182, less the 10% margin')
        >>> choose_batch_size({8: True, 16: True}, margin=0.1).size  # no failure: the cap, as tried
        16
        >>> choose_batch_size({8: True, 16: True, 32: True}, 0.1, {8: 100.0, 16: 140.0, 32: 143.0}).size
        16
    """
    low, high = _bounds(results)
    if low == 0:
        return Choice(None, "nothing fit")
    size, reason = low, f"largest that fit {low}"
    if throughputs:
        best = max(throughputs.values())
        size = min(s for s, speed in throughputs.items() if speed >= (1.0 - tolerance) * best and results.get(s))
        reason = f"smallest within {tolerance:.0%} of the best {best:.0f} samples/s"
    if high is not None:
        limit = apply_margin(low, margin)
        reason += f", out of memory at {high}"
        if size > limit:
            size = limit
            reason += f", less the {margin:.0%} margin" if throughputs is None else f", at most {low} less {margin:.0%}"
    return Choice(size, reason)


def lr_scale_factor(global_batch: int, reference_batch: int, rule: str) -> float:
    """LR multiplier for training at ``global_batch`` an LR that was tuned at ``reference_batch``.

    ``rule`` is one of `LR_SCALINGS` (the finder's ``lr_scaling``).

    Raises:
        ValueError: For an unknown ``rule`` or a batch that is not a positive int (the message names it).

    Example:
        >>> lr_scale_factor(256, 64, "linear"), lr_scale_factor(256, 64, "sqrt"), lr_scale_factor(256, 64, "none")
        (4.0, 2.0, 1.0)
    """
    check_choice("rule", rule, LR_SCALINGS)
    check_int("global_batch", global_batch)
    check_int("reference_batch", reference_batch)
    ratio = global_batch / reference_batch
    return ratio if rule == "linear" else math.sqrt(ratio) if rule == "sqrt" else 1.0


def hold_global_batch(global_batch: int, max_per_device: int, world_size: int) -> tuple[int, int]:
    """``(per_device, accumulate_grad_batches)`` that give ``global_batch`` with at most ``max_per_device`` per device.

    The fewest accumulation steps are used; among those within a factor of two of the fewest, one that divides the
    global batch exactly is preferred. When none does, the per-device size is rounded up (the global batch then
    exceeds the target by less than one per-device batch per accumulation step).

    Example:
        >>> hold_global_batch(256, max_per_device=100, world_size=1)  # 4 x 64, exact, rather than 3 x 86
        (64, 4)
        >>> hold_global_batch(64, max_per_device=1000, world_size=2)  # room to spare: no accumulation
        (32, 1)
        >>> hold_global_batch(250, max_per_device=40, world_size=1)
        (25, 10)
    """
    check_int("global_batch", global_batch)
    check_int("max_per_device", max_per_device)
    check_int("world_size", world_size)
    per_rank = math.ceil(global_batch / world_size)
    fewest = math.ceil(per_rank / max_per_device)
    if global_batch % world_size == 0:
        for accumulation in range(fewest, 2 * fewest + 1):
            if per_rank % accumulation == 0:
                return per_rank // accumulation, accumulation
    return math.ceil(per_rank / fewest), fewest


def run_cap(samples: int, limit_train_batches: float, val_check_interval: float, every_n_epoch: int | None) -> int:
    """The largest batch whose epoch of ``samples`` still holds the batches the Trainer's own settings need.

    Lightning refuses a fit whose epoch is shorter than an int ``val_check_interval`` (with epoch-based validation,
    ``every_n_epoch`` set), or whose fraction ``limit_train_batches`` of it is under one batch; the trials set their
    own batch limits, so only the fit after the search would fail.

    Example:
        >>> run_cap(256, 1.0, 10, 1)  # validation every 10 batches: an epoch of 10 at least
        25
        >>> run_cap(256, 0.5, 1.0, 1), run_cap(256, 1.0, 1.0, 1), run_cap(256, 8, 10, None)
        (128, 256, 256)
    """
    fraction = limit_train_batches if isinstance(limit_train_batches, float) and limit_train_batches > 0 else 1.0
    interval = val_check_interval if isinstance(val_check_interval, int) and every_n_epoch is not None else 1
    return max(1, samples // math.ceil(interval / fraction))
