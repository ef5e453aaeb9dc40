"""The seeds of ``speedkit demo --seeds`` and the speed-up each one scores."""

from __future__ import annotations

from typing import Any

__all__ = ["MAX_SEED", "parse_seeds", "seed_speedup"]

MAX_SEED = 2**32 - 1
"""The largest seed (numpy's)."""


def parse_seeds(text: str, most: int | None = None) -> list[int]:
    """Seeds from ``"0-4"`` (a range, inclusive), ``"0,2,5"`` or ``"3"``: digits only, each in [0, `MAX_SEED`].

    Raises:
        ValueError: Naming ``seeds`` and ``text``, for anything else, a seed named twice, or more than ``most``
            seeds (checked before a range is built: ``0-4294967295`` is refused, not listed).

    Example:
        >>> parse_seeds("0-4"), parse_seeds("1,3"), parse_seeds("7")
        ([0, 1, 2, 3, 4], [1, 3], [7])
        >>> parse_seeds("1_0")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: `seeds` must be a range like 0-4 or a list like 0,2,5 of different seeds in [0, ...], got '1_0'.
    """
    ranged = "-" in text.strip("-")
    parts = [part.strip() for part in (text.split("-", 1) if ranged else text.split(","))]
    seeds: list[int] = []
    if all(part.isascii() and part.isdigit() for part in parts):
        numbers = [int(part) for part in parts]
        if ranged and numbers[0] <= numbers[1] <= MAX_SEED:
            count = numbers[1] - numbers[0] + 1
            if most is not None and count > most:
                raise ValueError(f"`seeds` names {count} seeds, at most {most} in one call, got {text!r}.")
            seeds = list(range(numbers[0], numbers[1] + 1))
        elif not ranged:
            seeds = numbers
    if not seeds or any(seed > MAX_SEED for seed in seeds) or len(set(seeds)) < len(seeds):
        shown = f"a range like 0-4 or a list like 0,2,5 of different seeds in [0, {MAX_SEED}]"
        raise ValueError(f"`seeds` must be {shown}, got {text!r}.")
    if most is not None and len(seeds) > most:
        raise ValueError(f"`seeds` names {len(seeds)} seeds, at most {most} in one call, got {text!r}.")
    return seeds


def seed_speedup(baseline: dict[str, Any], speedkit: dict[str, Any]) -> tuple[float, bool]:
    """The seed's speed-up, and whether it is a lower bound.

    Baseline time to target over speedkit's; 0.0 when speedkit missed it (a miss counts as a loss). When only the
    baseline missed, its whole run over speedkit's time to target: it would have needed longer, so that is at least
    the speed-up (True).

    Example:
        >>> seed_speedup({"time_to_target_s": 20.0, "total_s": 20.0}, {"time_to_target_s": 10.0})
        (2.0, False)
        >>> seed_speedup({"time_to_target_s": None, "total_s": 30.0}, {"time_to_target_s": 10.0})
        (3.0, True)
        >>> seed_speedup({"time_to_target_s": 20.0, "total_s": 20.0}, {"time_to_target_s": None})
        (0.0, False)
    """
    if not speedkit["time_to_target_s"]:
        return 0.0, False
    if not baseline["time_to_target_s"]:
        return float(baseline["total_s"] / speedkit["time_to_target_s"]), True
    return float(baseline["time_to_target_s"] / speedkit["time_to_target_s"]), False
