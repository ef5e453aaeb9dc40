"""The maths of an LR range test: its schedule, smoothing, "valley" rule and signal.

Pure functions, used by `lightning_speedkit.LRFinder`; `lightning_speedkit.lr` exports them too.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Sequence

from lightning_speedkit.checks import check_number, is_int, is_number

__all__ = [
    "MIN_SIGNAL",
    "curve_signal",
    "diverged",
    "range_test_factors",
    "smooth_losses",
    "suggest_lr",
    "valley_index",
]


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
