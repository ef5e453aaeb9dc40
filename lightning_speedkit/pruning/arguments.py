"""The checks of `StructuredPruning`'s arguments, one message per argument: "`name` must be ..., got ..."."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from lightning_speedkit.checks import check_choice, check_int, is_int, is_number
from lightning_speedkit.pruning.surgery import IMPORTANCES

__all__ = ["LATENCY_DEVICES", "check_pruning_args"]

LATENCY_DEVICES = ("auto", "cpu")
"""Where ``target_latency`` times the pruned copy: ``"auto"`` (the training device) or ``"cpu"``."""


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
    if amount is not None and not is_number(amount, 0, 1, open_low=True, open_high=True):
        raise ValueError(f"`amount` must be a float in (0, 1), got {amount!r}.")
    for name in ("target_speedup", "target_latency"):
        if given[name] is not None and not is_number(given[name], 1, open_low=True):
            raise ValueError(f"`{name}` must be a finite number > 1, got {given[name]!r}.")
    check_int("start_epoch", start_epoch, low=0)
    check_int("iterative_steps", iterative_steps)
    check_int("finetune_epochs", finetune_epochs, low=0)
    check_choice("importance", importance, IMPORTANCES)
    check_int("round_to", round_to, optional=True)
    if not is_int(rewarm, low=0) and not (isinstance(rewarm, float) and 0.0 < rewarm < 1.0):
        raise ValueError(f"`rewarm` must be an int >= 0 (steps) or a float in (0, 1), got {rewarm!r}.")
    if any(not is_int(b, low=1) for b in latency_batch_sizes):
        raise ValueError(f"`latency_batch_sizes` must hold positive ints, got {latency_batch_sizes!r}.")
    if monitor is not None and not isinstance(monitor, str):
        raise ValueError(f"`monitor` must be a metric name or None, got {monitor!r}.")
    if ignored_layers is not None and any(not isinstance(x, (str, nn.Module)) for x in ignored_layers):
        raise ValueError(f"`ignored_layers` must hold module names or modules, got {ignored_layers!r}.")
    check_choice("latency_device", latency_device, LATENCY_DEVICES)
