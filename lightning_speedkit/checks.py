"""Argument checks shared by every callback and function: one predicate per kind, one message form.

Every check refuses ``bool`` where a number is wanted (``True`` is an ``int`` to Python, never a count or a ratio to
us) and raises ``ValueError`` of the form "`name` must be ..., got <repr of the value>." naming the argument.
"""

from __future__ import annotations

import inspect
import math
import tempfile
from collections.abc import Collection
from pathlib import Path
from typing import Literal, TypeGuard, TypeVar, overload

__all__ = [
    "check_bool",
    "check_callable",
    "check_choice",
    "check_int",
    "check_margin",
    "check_number",
    "check_probe_steps",
    "is_int",
    "is_number",
    "unwritable",
]

T = TypeVar("T")


def is_int(value: object, low: int | None = None) -> TypeGuard[int]:
    """Whether ``value`` is an ``int`` (not a ``bool``), at least ``low`` when given.

    Example:
        >>> is_int(3), is_int(True), is_int(2.0), is_int(0, low=1), is_int(1, low=1)
        (True, False, False, False, True)
    """
    return isinstance(value, int) and not isinstance(value, bool) and (low is None or value >= low)


def is_number(
    value: object,
    low: float | None = None,
    high: float | None = None,
    *,
    open_low: bool = False,
    open_high: bool = False,
) -> TypeGuard[int | float]:
    """Whether ``value`` is a finite ``int`` or ``float`` (not a ``bool``) within the bounds given.

    ``low`` and ``high`` are included unless ``open_low`` / ``open_high``.

    Example:
        >>> is_number(0.5, 0, 1), is_number(True), is_number("0.5"), is_number(float("nan")), is_number(math.inf)
        (True, False, False, False, False)
        >>> is_number(0, 0, 1), is_number(0, 0, 1, open_low=True), is_number(1, 0, 1, open_high=True)
        (True, False, False)
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return False
    if low is not None and (value <= low if open_low else value < low):
        return False
    return high is None or (value < high if open_high else value <= high)


def _interval(low: float | None, high: float | None, open_low: bool, open_high: bool) -> str:
    """How `check_number` says the range in words: ``a number in [0, 1)``, ``a positive number``, ``a number >= 2``."""
    if low is not None and high is not None:
        return f"a number in {'(' if open_low else '['}{low}, {high}{')' if open_high else ']'}"
    if low is not None:
        return "a positive number" if low == 0 and open_low else f"a number {'>' if open_low else '>='} {low}"
    if high is not None:
        return f"a number {'<' if open_high else '<='} {high}"
    return "a finite number"


@overload
def check_int(name: str, value: object, low: int = 1, *, optional: Literal[False] = False) -> int: ...


@overload
def check_int(name: str, value: object, low: int = 1, *, optional: Literal[True]) -> int | None: ...


def check_int(name: str, value: object, low: int = 1, *, optional: bool = False) -> int | None:
    """Return ``value`` if it is an int >= ``low`` (or None with ``optional``); else raise a ``ValueError`` naming it.

    Example:
        >>> check_int("max_trials", 25)
        25
        >>> check_int("max_disk_bytes", "x", optional=True)
        Traceback (most recent call last):
        ...
        ValueError: `max_disk_bytes` must be a positive int or None, got 'x'.
        >>> check_int("num_workers", -1, low=0)
        Traceback (most recent call last):
        ...
        ValueError: `num_workers` must be an int >= 0, got -1.
    """
    if optional and value is None:
        return None
    if is_int(value, low):
        return value
    kind = "a positive int" if low == 1 else f"an int >= {low}"
    raise ValueError(f"`{name}` must be {kind}{' or None' if optional else ''}, got {value!r}.")


def check_number(
    name: str,
    value: object,
    low: float | None = None,
    high: float | None = None,
    *,
    open_low: bool = False,
    open_high: bool = False,
) -> float:
    """Return ``value`` as a float if `is_number` holds for it and the bounds; else raise a ``ValueError`` naming it.

    Example:
        >>> check_number("lr", 1e-3, 0, open_low=True)
        0.001
        >>> check_number("lr", "x", 0, open_low=True)
        Traceback (most recent call last):
        ...
        ValueError: `lr` must be a positive number, got 'x'.
        >>> check_number("target_acc", 1.5, 0, 1, open_low=True)
        Traceback (most recent call last):
        ...
        ValueError: `target_acc` must be a number in (0, 1], got 1.5.
    """
    if not is_number(value, low, high, open_low=open_low, open_high=open_high):
        raise ValueError(f"`{name}` must be {_interval(low, high, open_low, open_high)}, got {value!r}.")
    return float(value)


def check_choice(name: str, value: T, choices: Collection[T]) -> T:
    """Return ``value`` if it is one of ``choices``; else raise a ``ValueError`` that lists them.

    Example:
        >>> check_choice("decay", "cosine", ("constant", "cosine", "linear"))
        'cosine'
        >>> check_choice("decay", "step", ("constant", "cosine", "linear"))
        Traceback (most recent call last):
        ...
        ValueError: `decay` must be one of 'constant', 'cosine', 'linear', got 'step'.
    """
    try:
        known = not isinstance(value, bool) and value in choices  # True == 1 would pass for a choice of 1
    except TypeError:  # an unhashable value and a set of choices
        known = False
    if not known:
        raise ValueError(f"`{name}` must be one of {', '.join(map(repr, choices))}, got {value!r}.")
    return value


def check_bool(name: str, value: object) -> bool:
    """Return ``value`` if it is a ``bool``; else raise a ``ValueError`` naming it (``"yes"`` is not ``True``).

    Example:
        >>> check_bool("symmetric", "yes")
        Traceback (most recent call last):
        ...
        ValueError: `symmetric` must be True or False, got 'yes'.
    """
    if not isinstance(value, bool):
        raise ValueError(f"`{name}` must be True or False, got {value!r}.")
    return value


def check_callable(name: str, value: object, what: str, arguments: int = 1) -> None:
    """Raise a ``ValueError`` naming ``name`` unless ``value`` can be called with ``arguments`` positional arguments.

    Args:
        name: The argument's name.
        value: What was passed.
        what: What it must be, for the message (``"a function of a torch.device"``).
        arguments: How many positional arguments it is called with.

    Example:
        >>> check_callable("sampler", lambda device: None, "a function of a torch.device")
        >>> check_callable("sampler", lambda: None, "a function of a torch.device")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: `sampler` must be a function of a torch.device, got <function <lambda> at ...>, which takes ...
    """
    if not callable(value) or isinstance(value, (str, bytes, type(None))):
        raise ValueError(f"`{name}` must be {what}, got {value!r}.")
    try:
        inspect.signature(value).bind(*([None] * arguments))
    except TypeError as err:
        raise ValueError(f"`{name}` must be {what}, got {value!r}, which takes other arguments ({err}).") from None
    except ValueError:  # a builtin without a signature: it is called as given
        return


def check_margin(name: str, value: object) -> float:
    """Validate a relative margin in [0, 1) and return it as a float.

    Example:
        >>> check_margin("margin", 0.05)
        0.05
        >>> check_margin("margin", 1.0)
        Traceback (most recent call last):
        ...
        ValueError: `margin` must be a number in [0, 1), got 1.0.
    """
    return check_number(name, value, 0, 1, open_high=True)


def check_probe_steps(name: str, value: object, low: int = 1) -> int:
    """Validate a count of probe steps (an int >= ``low``) and return it.

    Example:
        >>> check_probe_steps("probe_steps", 4)
        4
        >>> check_probe_steps("probe_steps", 0)
        Traceback (most recent call last):
        ...
        ValueError: `probe_steps` must be an int >= 1, got 0.
    """
    if not is_int(value, low):
        raise ValueError(f"`{name}` must be an int >= {low}, got {value!r}.")
    return value


def unwritable(directory: Path) -> str | None:
    """Why files could not be written into ``directory`` (made if missing), or None if they could.

    Its nearest existing directory is asked by creating (and removing) a probe file there: permission bits do not
    say it for root, a read-only mount or a kernel file system (``/proc``, ``/sys``).

    Example:
        >>> unwritable(Path("/proc/exports"))
        '/proc is not writable (No such file or directory)'
    """
    existing = directory.absolute()
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return f"{existing} is not a directory"
    try:
        with tempfile.NamedTemporaryFile(dir=existing, prefix=".speedkit-probe-"):
            pass
    except OSError as error:
        return f"{existing} is not writable ({error.strerror or type(error).__name__})"
    return None
