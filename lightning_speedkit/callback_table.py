"""The one table of speedkit's callbacks, in acting order, and `default_callbacks`, which builds from it.

Every slot takes one argument form: ``False`` (leave it out), ``True`` (the callback with its defaults), a dict (its
arguments) or an instance (yours, used as it is). `preset` and `default_callbacks` both build from `SLOTS`; a lever
added to the pack is one row here.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import Callback

from lightning_speedkit.average import WeightAverage
from lightning_speedkit.batch_size import BatchSizeFinder
from lightning_speedkit.channels_last import ChannelsLast
from lightning_speedkit.checks import check_bool
from lightning_speedkit.compile import Compile
from lightning_speedkit.dataloader import DataLoaderTuner
from lightning_speedkit.fused import FusedOptimizer
from lightning_speedkit.guard import TrainingGuard
from lightning_speedkit.lr_finder import LRFinder
from lightning_speedkit.monitor import UtilizationMonitor
from lightning_speedkit.precision import PrecisionTuner
from lightning_speedkit.pruning import StructuredPruning
from lightning_speedkit.warmup import WarmupScheduler

__all__ = ["FORMS", "SLOTS", "Slot", "build_slot", "default_callbacks"]

FORMS = "False (leave it out), True (its defaults), a dict of its arguments or an instance"
"""The argument form every slot takes, as error messages name it."""


def _int8_export() -> type[Callback]:
    from lightning_speedkit.int8 import Int8Export  # needs the `export` extra only when used

    return Int8Export


@dataclass(frozen=True)
class Slot:
    """One row of the table: the argument that fills it, the callback class, and whether it is in by default.

    Args:
        argument: The keyword of `preset` and `default_callbacks`.
        load: Returns the callback class (imported when first needed).
        default: The argument's default.
        lever: Whether the callback decides a speed setting by measurement (a `lightning_speedkit.trials.Lever`).
        shorthand: A value form of its own beside the common ones (pruning's amount, the export's directory), as
            ``(what it is, value -> dict of arguments or None when it is not that form)``.
        options: Arguments preset gives the callback where the user's value does not (``True`` or a dict without
            them): the warmup's cool-down decided by a trial.
    """

    argument: str
    load: Callable[[], type[Callback]]
    default: Any
    lever: bool = False
    shorthand: tuple[str, Callable[[Any], dict[str, Any] | None]] | None = None
    options: tuple[tuple[str, Any], ...] = ()


def _amount(value: Any) -> dict[str, Any] | None:
    return {"amount": value} if isinstance(value, float) and 0.0 < value < 1.0 else None


def _auto(value: Any) -> dict[str, Any] | None:
    return {} if isinstance(value, str) and value == "auto" else None


def _directory(value: Any) -> dict[str, Any] | None:
    if isinstance(value, (str, os.PathLike)) and os.fspath(value):
        return {"dirpath": Path(value)}
    return None


SLOTS: tuple[Slot, ...] = (
    Slot("tune_precision", lambda: PrecisionTuner, True, lever=True),
    Slot("channels_last", lambda: ChannelsLast, True, lever=True),
    Slot("fused_optimizer", lambda: FusedOptimizer, True, lever=True),
    Slot("batch_size", lambda: BatchSizeFinder, False, lever=True, shorthand=('"auto" (its defaults)', _auto)),
    Slot("tune_data", lambda: DataLoaderTuner, True, lever=True),
    Slot("lr", lambda: LRFinder, False, lever=True, shorthand=('"auto" (its defaults)', _auto)),
    Slot("compile", lambda: Compile, False, lever=True),
    Slot("warmup", lambda: WarmupScheduler, True, options=(("decay", "auto"), ("cooldown_check", "trial"))),
    Slot("guard", lambda: TrainingGuard, True),
    Slot("average", lambda: WeightAverage, False),
    Slot("monitor", lambda: UtilizationMonitor, True),
    Slot("prune", lambda: StructuredPruning, False, shorthand=("a channel amount in (0, 1)", _amount)),
    Slot("export", _int8_export, False, shorthand=("a directory for the INT8 model", _directory)),
)
"""speedkit's callbacks in acting order. The compute levers are decided first (the precision before the layout, whose
gain depends on it; counted probes run one after another in this order), and the batch size, so the loader is tuned
against the step the run will really take (workers compete with it for cores; the batch-size search replaces the
loader, which a tuner that planned before it could no longer serve); the LR is found for the batch size the run will
use; the warmup ramps to the LR found; the weight average follows the guard (a rolled-back step is not averaged);
pruning and the export act last (the export takes the averaged weights the fit ends with)."""


def build_slot(slot: Slot, value: Any, remember: bool = True) -> Callback | None:
    """The callback ``value`` asks for in ``slot`` (None for ``False``), or a ValueError naming the argument.

    A lever built here (from ``True`` or a dict without its own ``remember``) gets ``remember``, and a callback the
    slot's ``options`` the dict does not set; an instance is used as it is.

    Example:
        >>> guard = next(s for s in SLOTS if s.argument == "guard")
        >>> build_slot(guard, {"backoff": 0.25}).backoff, build_slot(guard, False)
        (0.25, None)
        >>> build_slot(guard, "on")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: `guard` must be False (leave it out), True (its defaults), ... of TrainingGuard, got 'on'.
    """
    if value is False or (value is None and slot.shorthand is not None):
        return None
    cls = slot.load()
    defaults = {"remember": remember} if slot.lever else {}
    defaults |= dict(slot.options)
    if isinstance(value, cls):
        return value
    arguments: Mapping[str, Any] | None = {} if value is True else None
    if isinstance(value, Mapping) and all(isinstance(key, str) for key in value):
        arguments = value
    elif arguments is None and slot.shorthand is not None:
        arguments = slot.shorthand[1](value)
    if arguments is not None:
        try:
            return cls(**{**defaults, **arguments})
        except (TypeError, ValueError) as error:  # named by the argument the user gave, not only the callback's
            raise type(error)(f"`{slot.argument}` got {value!r}, which {cls.__name__} refuses: {error}") from error
    forms = FORMS + f" of {cls.__name__}"
    if slot.shorthand is not None:
        forms = f"{forms}, or {slot.shorthand[0]}"
    raise ValueError(f"`{slot.argument}` must be {forms}, got {value!r}.")


def default_callbacks(
    callbacks: Callback | Sequence[Callback] | None = None, remember: bool = True, **slots: Any
) -> list[Callback]:
    """The callbacks of `SLOTS` in acting order, with the user's own merged in.

    Every slot takes ``False``, ``True``, a dict of the callback's arguments or an instance; ``prune`` also takes a
    channel amount in (0, 1) and ``export`` a directory. Defaults: ChannelsLast, PrecisionTuner, FusedOptimizer,
    DataLoaderTuner, WarmupScheduler, TrainingGuard and UtilizationMonitor in; BatchSizeFinder (``batch_size``),
    LRFinder (``lr``), Compile (``compile``), WeightAverage (``average``), StructuredPruning (``prune``) and
    Int8Export (``export``) out. A callback in ``callbacks`` of the same type as one of ours *replaces* ours in its
    slot (never a duplicate); the user's other callbacks follow ours.

    Args:
        callbacks: The user's callbacks (a list, or one, as the Trainer takes them).
        remember: Whether the levers built here remember their decisions across runs (their ``remember``;
            `lightning_speedkit.trials.memory`).
        **slots: One value per slot argument: ``channels_last``, ``tune_precision``, ``fused_optimizer``,
            ``tune_data``, ``batch_size``,
            ``lr``, ``compile``, ``warmup``, ``guard``, ``average``, ``monitor``, ``prune``, ``export``.

    Raises:
        ValueError: For an unknown slot, or a value in a form the slot does not take (naming the argument and the
            forms), or a ``callbacks`` that is not a list of Callbacks.

    Example:
        >>> [type(c).__name__ for c in default_callbacks()]  # doctest: +NORMALIZE_WHITESPACE
        ['PrecisionTuner', 'ChannelsLast', 'FusedOptimizer', 'DataLoaderTuner', 'WarmupScheduler',
         'TrainingGuard', 'UtilizationMonitor']
        >>> mine = WarmupScheduler(warmup=10)
        >>> default_callbacks(callbacks=[mine], tune_precision=False)[3] is mine
        True
    """
    check_bool("remember", remember)
    known = {slot.argument for slot in SLOTS}
    unknown = sorted(set(slots) - known)
    if unknown:
        raise ValueError(f"`{unknown[0]}` is not a speedkit callback slot; the slots are {', '.join(sorted(known))}.")
    if isinstance(callbacks, Callback):  # one, as `Trainer(callbacks=...)` takes it
        callbacks = [callbacks]
    if callbacks is not None and (
        not isinstance(callbacks, (list, tuple)) or any(not isinstance(c, Callback) for c in callbacks)
    ):
        raise ValueError(f"`callbacks` must be a Callback or a list of them, got {callbacks!r}.")
    ours = [build_slot(slot, slots.get(slot.argument, slot.default), remember) for slot in SLOTS]
    user = list(callbacks or ())
    merged = []
    for callback in (c for c in ours if c is not None):
        replacement = next((c for c in user if isinstance(c, type(callback))), None)
        merged.append(replacement if replacement is not None else callback)
    return merged + [c for c in user if not any(c is m for m in merged)]
