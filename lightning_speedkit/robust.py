"""Robust statistics of a window of losses: how far one loss lies above the others, unmoved by an outlier among them."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["robust_z"]


def robust_z(value: float, window: Sequence[float]) -> float:
    """How many robust standard deviations ``value`` lies above the window's median (median absolute deviation).

    One outlier in the window barely moves the median or the MAD, so a spike cannot hide the next one. 0 when the
    window has fewer than two values or no spread.

    Example:
        >>> robust_z(10.0, [1.0, 1.1, 0.9, 1.0, 1.2])
        60.7
        >>> robust_z(1.05, [1.0, 1.1, 0.9, 1.0, 1.2])
        0.34
    """
    if len(window) < 2:
        return 0.0
    ordered = sorted(window)  # checked after every step: one sort, no `statistics` call overhead
    median = _middle(ordered)
    mad = _middle(sorted([abs(v - median) for v in ordered]))
    if mad <= 0:
        return 0.0
    return round((value - median) / (1.4826 * mad), 2)


def _middle(ordered: Sequence[float]) -> float:
    """The median of an already sorted sequence."""
    half = len(ordered) // 2
    return ordered[half] if len(ordered) % 2 else (ordered[half - 1] + ordered[half]) / 2
