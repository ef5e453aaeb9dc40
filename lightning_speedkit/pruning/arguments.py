"""The checks of `StructuredPruning`'s arguments, one message per argument: "`name` must be ..., got ..."."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from torch import nn

from lightning_speedkit.pruning.surgery import IMPORTANCES

__all__ = ["LATENCY_DEVICES", "check_pruning_args"]

LATENCY_DEVICES = ("auto", "cpu")
"""Where ``target_latency`` times the pruned copy: ``"auto"`` (the training device) or ``"cpu"``."""


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_target(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 1


def check_pruning_args(
    amount: Any,
    target_speedup: Any,
    target_latency: Any,
    start_epoch: Any,
    iterative_steps: Any,
    finetune_epochs: Any,
    importance: Any,
    ignored_layers: Sequence[Any] | None,
    round_to: Any,
    rewarm: Any,
    monitor: Any,
    latency_batch_sizes: Sequence[Any],
    latency_device: Any,
) -> None:
    """Raise ``ValueError`` naming the first argument of `StructuredPruning` that is out of range.

    Example:
        >>> check_pruning_args(None, None, 1.0, 0, 1, 1, "magnitude", None, 8, 0.1, None, (1,), "cpu")
        Traceback (most recent call last):
        ...
        ValueError: `target_latency` must be a finite number > 1, got 1.0.
    """
    given = {"amount": amount, "target_speedup": target_speedup, "target_latency": target_latency}
    if sum(v is not None for v in given.values()) != 1:
        shown = ", ".join(f"{k}={v!r}" for k, v in given.items())
        raise ValueError(f"Exactly one of `amount`, `target_speedup` and `target_latency` must be given, got {shown}.")
    if amount is not None and not (isinstance(amount, (int, float)) and 0.0 < amount < 1.0):
        raise ValueError(f"`amount` must be a float in (0, 1), got {amount!r}.")
    for name in ("target_speedup", "target_latency"):
        if given[name] is not None and not _is_target(given[name]):
            raise ValueError(f"`{name}` must be a finite number > 1, got {given[name]!r}.")
    for name, value, low in (("start_epoch", start_epoch, 0), ("iterative_steps", iterative_steps, 1)):
        if not _is_int(value) or value < low:
            raise ValueError(f"`{name}` must be an int >= {low}, got {value!r}.")
    if not _is_int(finetune_epochs) or finetune_epochs < 0:
        raise ValueError(f"`finetune_epochs` must be an int >= 0, got {finetune_epochs!r}.")
    if importance not in IMPORTANCES:
        raise ValueError(f"`importance` must be one of {', '.join(map(repr, IMPORTANCES))}, got {importance!r}.")
    if round_to is not None and (not _is_int(round_to) or round_to < 1):
        raise ValueError(f"`round_to` must be a positive int or None, got {round_to!r}.")
    if not (_is_int(rewarm) and rewarm >= 0) and not (isinstance(rewarm, float) and 0.0 < rewarm < 1.0):
        raise ValueError(f"`rewarm` must be an int >= 0 (steps) or a float in (0, 1), got {rewarm!r}.")
    if any(not _is_int(b) or b < 1 for b in latency_batch_sizes):
        raise ValueError(f"`latency_batch_sizes` must hold positive ints, got {latency_batch_sizes!r}.")
    if monitor is not None and not isinstance(monitor, str):
        raise ValueError(f"`monitor` must be a metric name or None, got {monitor!r}.")
    if ignored_layers is not None and any(not isinstance(x, (str, nn.Module)) for x in ignored_layers):
        raise ValueError(f"`ignored_layers` must hold module names or modules, got {ignored_layers!r}.")
    if latency_device not in LATENCY_DEVICES:
        choices = ", ".join(map(repr, LATENCY_DEVICES))
        raise ValueError(f"`latency_device` must be one of {choices}, got {latency_device!r}.")
