"""What a resumed fit reads: a checkpoint that cannot be read, or a speedkit state that does not fit, said plainly.

Lightning restores a checkpoint in order: the module's weights, then each callback's ``load_state_dict``. A truncated
file fails inside ``torch.load`` with ``PytorchStreamReader`` or an ``EOFError`` with an empty message; a damaged
callback state fails inside the callback, after the weights were already put back. `check_checkpoints` wraps the
strategy's `CheckpointIO` (Lightning's plugin for reading checkpoints), so that every checkpoint a fit loads is
checked as it is read, before anything is restored:

- a file that cannot be read raises `CheckpointError` naming it;
- each speedkit callback's saved state is checked against the callback's ``state_spec`` (`state_problem`): a value of
  the wrong type raises `CheckpointError` naming the file, the callback and the key; keys this version does not know
  (a checkpoint from another version) make that callback's state ignored, with a warning. A state is never half
  applied.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback

__all__ = [
    "CheckpointError",
    "CheckpointsChecked",
    "ListOf",
    "StateSpec",
    "cached_state_key",
    "check_checkpoints",
    "state_problem",
]


@dataclass(frozen=True)
class ListOf:
    """A list (or tuple) whose every item is ``item`` (see `state_problem`)."""

    item: Expect


Expect = type | None | tuple[Any, ...] | ListOf | Mapping[str, Any]
"""What a saved value may be: a type (``float`` takes an int; ``int`` never takes a bool), ``None``, a tuple of
these, a `ListOf`, or a nested `StateSpec` for a dict."""

StateSpec = Mapping[str, Expect]
"""A callback's saved state: each key it writes, and what its value may be."""


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be read, or whose speedkit state is damaged; nothing was restored from it."""


def _describe(expect: Expect) -> str:
    if isinstance(expect, tuple):
        return " or ".join(_describe(e) for e in expect)
    if isinstance(expect, ListOf):
        return f"a list of {_describe(expect.item)}"
    if isinstance(expect, Mapping):
        return "a dict"
    if expect is None:
        return "None"
    return {int: "an int", float: "a number", bool: "a bool", str: "a string", dict: "a dict", list: "a list"}.get(
        expect, expect.__name__
    )


def _fits(value: Any, expect: Expect) -> tuple[str, Expect, Any] | None:
    """None when ``value`` is what ``expect`` allows; else the innermost wrong part: path, what it must be, value."""
    if isinstance(expect, tuple):
        failures = [_fits(value, e) for e in expect]
        if any(f is None for f in failures):
            return None
        inner = [f for e, f in zip(expect, failures, strict=True) if isinstance(e, Mapping) and f and f[0]]
        return inner[0] if inner and isinstance(value, Mapping) else ("", expect, value)
    if expect is None:
        return None if value is None else ("", expect, value)
    if isinstance(expect, ListOf):
        if not isinstance(value, (list, tuple)):
            return "", expect, value
        for index, item in enumerate(value):
            wrong = _fits(item, expect.item)
            if wrong is not None:
                return f"[{index}]{wrong[0]}", wrong[1], wrong[2]
        return None
    if isinstance(expect, Mapping):
        if not isinstance(value, Mapping):
            return "", expect, value
        for key, inner_expect in expect.items():
            if key in value:
                wrong = _fits(value[key], inner_expect)
                if wrong is not None:
                    return f".{key}{wrong[0]}", wrong[1], wrong[2]
        return None  # keys the spec does not name, inside a value: another version's extras, kept
    if expect is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif expect is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, expect)
    return None if ok else ("", expect, value)


def state_problem(state: Any, spec: StateSpec) -> tuple[str, str] | None:
    """What is wrong with a saved callback state, if anything: ``("unknown", keys)`` or ``("type", why)``.

    Keys missing from ``state`` are fine (a callback falls back to its defaults); keys ``spec`` does not name are
    ``"unknown"``; a value ``spec`` does not allow is a ``"type"`` problem, named by its key path.

    Example:
        >>> spec = {"rollbacks": int, "lr_scale": float, "losses": ListOf(float), "schedule": (None, {"step": int})}
        >>> state_problem({"rollbacks": 2, "lr_scale": 1, "losses": [0.5, 1]}, spec) is None
        True
        >>> state_problem({"rollbacks": "2"}, spec)
        ('type', "`rollbacks` must be an int, got '2'")
        >>> state_problem({"losses": [0.5, "x"]}, spec)
        ('type', "`losses[1]` must be a number, got 'x'")
        >>> state_problem({"schedule": {"step": None}}, spec)[1]
        '`schedule.step` must be an int, got None'
        >>> state_problem({"schedule": 3}, spec)[1]
        '`schedule` must be None or a dict, got 3'
        >>> state_problem({"rollbacks": 1, "extra": 0}, spec)
        ('unknown', 'extra')
        >>> state_problem([1], spec)
        ('type', 'the state must be a dict, got [1]')
    """
    if not isinstance(state, Mapping):
        return "type", f"the state must be a dict, got {_shown(state)}"
    unknown = [str(key) for key in state if key not in spec]
    for key, expect in spec.items():
        if key in state:
            wrong = _fits(state[key], expect)
            if wrong is not None:
                path, must, got = wrong
                return "type", f"`{key}{path}` must be {_describe(must)}, got {_shown(got)}"
    if unknown:
        return "unknown", ", ".join(unknown)
    return None


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


class CheckpointsChecked(CheckpointIO):
    """The strategy's `CheckpointIO`, with every loaded checkpoint checked before Lightning restores anything from it.

    Args:
        inner: The `CheckpointIO` that reads and writes the files.
        trainer: The Trainer whose speedkit callbacks (those with a ``state_spec``) the states are checked for.
    """

    def __init__(self, inner: CheckpointIO, trainer: pl.Trainer) -> None:
        self.inner = inner
        self._trainer = weakref.ref(trainer)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        self.inner.save_checkpoint(checkpoint, path, storage_options=storage_options)

    @override
    def load_checkpoint(self, path: Any, map_location: Any | None = None, weights_only: bool | None = None) -> Any:
        kwargs: dict[str, Any] = {"weights_only": weights_only}
        if map_location is not None:
            kwargs["map_location"] = map_location
        try:
            checkpoint = self.inner.load_checkpoint(path, **kwargs)
        except FileNotFoundError:
            raise
        except Exception as err:
            if "Unsupported global" in str(err):  # torch refusing a pickled object (weights_only): not a damaged file
                raise
            first = str(err).strip().splitlines()[0][:200] if str(err).strip() else "no message"
            raise CheckpointError(
                f"The checkpoint {path} cannot be read: it is truncated or corrupt ({type(err).__name__}: {first});"
                " nothing was restored. Resume from another checkpoint."
            ) from err
        trainer = self._trainer()
        if isinstance(checkpoint, dict) and trainer is not None:
            _check_states(checkpoint, trainer, path)
        return checkpoint

    @override
    def remove_checkpoint(self, path: Any) -> None:
        self.inner.remove_checkpoint(path)

    @override
    def teardown(self) -> None:
        self.inner.teardown()


def _check_states(checkpoint: dict[str, Any], trainer: pl.Trainer, path: Any) -> None:
    """Raise for a damaged speedkit state; drop (with a warning) a state with keys this version does not know."""
    states = checkpoint.get("callbacks")
    if not isinstance(states, dict):
        return
    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        spec = getattr(callback, "state_spec", None)
        key = callback.state_key
        if spec is None or key not in states:
            continue
        problem = state_problem(states[key], spec)
        if problem is None:
            continue
        name = type(callback).__name__
        kind, detail = problem
        if kind == "type":
            raise CheckpointError(
                f"The checkpoint {path} holds a damaged {name} state: {detail}; nothing was restored. Resume from"
                f" another checkpoint, or remove {key!r} from its 'callbacks' to start {name} afresh."
            )
        rank_zero_warn(
            f"{name}: the checkpoint {path} holds a state with keys this version does not know ({detail}), from"
            f" another version of lightning_speedkit; {name}'s state is ignored and it starts afresh."
        )
        del states[key]


def check_checkpoints(trainer: pl.Trainer) -> None:
    """Check every checkpoint this Trainer loads from now on (idempotent); call it from a callback's ``setup``.

    Lightning reads the checkpoint of ``fit(ckpt_path=...)`` after the callbacks' ``setup`` and before it restores
    anything, through ``trainer.strategy.checkpoint_io``: wrapping it there checks the file and every speedkit state
    first (`CheckpointsChecked`).
    """
    strategy = trainer.strategy
    if not isinstance(strategy.checkpoint_io, CheckpointsChecked):
        strategy.checkpoint_io = CheckpointsChecked(strategy.checkpoint_io, trainer)


def cached_state_key(callback: Callback, **settings: Any) -> str:
    """``callback``'s ``state_key`` for ``settings``, built once per distinct settings.

    Lightning reads ``state_key`` on every hook call (its profiler's action name), so a key built each time costs a
    short fit's steps measurable time; this keeps the last one, rebuilt only when a setting changes.
    """
    values = tuple(settings.values())
    cached = callback.__dict__.get("_speedkit_state_key")
    if cached is None or cached[0] != values:
        cached = (values, callback._generate_state_key(**settings))
        callback.__dict__["_speedkit_state_key"] = cached
    return str(cached[1])
