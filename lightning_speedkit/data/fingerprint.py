"""Fingerprints of a data set and of a transform: what names a packed cache, so a change builds a new one."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset

from lightning_speedkit.data.rows import short_repr

__all__ = ["callable_fingerprint", "check_source", "dataset_fingerprint"]

_PROBES = 8


def check_source(name: str, source: object) -> int:
    """Return the length of ``source`` if it is a non-empty map-style dataset; else raise a ``ValueError`` naming it.

    A map-style dataset has ``__len__`` and ``__getitem__`` and is not a ``str``/``bytes`` (whose characters would
    be cached), a class (``MyDataset`` instead of ``MyDataset()``) or an ``IterableDataset``.

    Example:
        >>> check_source("source", [(1, 2), (3, 4)])
        2
        >>> check_source("source", "not a dataset")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: `source` must be a map-style dataset (...), got 'not a dataset'.
    """
    wrong_kind = isinstance(source, (str, bytes, bytearray, memoryview, type, IterableDataset))
    if wrong_kind or not hasattr(source, "__len__") or not hasattr(source, "__getitem__"):
        raise ValueError(
            f"`{name}` must be a map-style dataset (an object with `__len__` and `__getitem__`, not a str, bytes,"
            f" a class or an IterableDataset), got {short_repr(source)}."
        )
    length = len(source)  # type: ignore[arg-type]
    if length == 0:
        raise ValueError(f"`{name}` must hold at least one sample, got an empty dataset.")
    return length


def callable_fingerprint(fn: Callable[..., Any] | None) -> str:
    """A stable identity for a transform: its qualified name plus a hash of its code and of the values it holds.

    The values count as much as the code: a ``functools.partial``'s function, arguments and keywords; a closure's
    captured values and a function's defaults (``make_resize(64)`` against ``make_resize(128)``); a bound method's
    object; a callable object's attributes (a ``Compose`` of transforms, each by its own code and attributes). Values
    are hashed as `_feed` hashes samples (an object that is neither by its type alone); a global read by the code is
    not seen: name the data's version in ``fingerprint`` then.

    Raises:
        ValueError: If ``fn`` is neither callable nor None.

    Example:
        >>> import functools
        >>> callable_fingerprint(None)
        'none'
        >>> callable_fingerprint(len) == callable_fingerprint(len)
        True
        >>> callable_fingerprint(functools.partial(round, ndigits=1)) == callable_fingerprint(
        ...     functools.partial(round, ndigits=2))
        False
    """
    if fn is None:
        return "none"
    if not callable(fn):
        raise ValueError(f"`fn` must be a function (a transform) or None, got {short_repr(fn)}.")
    name = f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', type(fn).__qualname__)}"
    digest = hashlib.sha256()
    _feed_callable(digest, fn, 0)
    return f"{name}:{digest.hexdigest()[:16]}"


_DEPTH = 8
"""How deep `_feed_callable` follows transforms held by transforms (a guard against cycles)."""


def _feed_callable(digest: Any, fn: Any, depth: int) -> None:
    """Add a transform's code and the values it holds to ``digest`` (see `callable_fingerprint`)."""
    if depth > _DEPTH:
        digest.update(b"deeper")
        return
    if isinstance(fn, functools.partial):
        digest.update(b"partial")
        _feed_callable(digest, fn.func, depth + 1)
        _feed_held(digest, (fn.args, fn.keywords), depth)
        return
    if inspect.ismethod(fn):
        _feed_callable(digest, fn.__func__, depth + 1)
        _feed_held(digest, getattr(fn.__self__, "__dict__", {}), depth)
        return
    if inspect.isbuiltin(fn):  # its repr may hold an address; a bound one's object counts (`"abc".upper`)
        digest.update(f"builtin:{getattr(fn, '__module__', '')}.{fn.__qualname__}".encode())
        if not inspect.ismodule(owner := getattr(fn, "__self__", None)):
            _feed_held(digest, owner, depth + 1)
        return
    try:
        body = inspect.getsource(fn if inspect.isroutine(fn) else type(fn))
    except (OSError, TypeError):
        body = f"{type(fn).__module__}.{type(fn).__qualname__}:{getattr(fn, '__qualname__', '')}"
    digest.update(body.encode())
    if inspect.isfunction(fn):
        cells = []
        for cell in fn.__closure__ or ():
            with contextlib.suppress(ValueError):  # a cell not filled yet
                cells.append(cell.cell_contents)
        _feed_held(digest, (fn.__defaults__, fn.__kwdefaults__, cells), depth)
    elif not inspect.isroutine(fn):  # a callable object: its attributes
        held: Any = _attributes(fn)
        if held is None:  # a C object (`operator.itemgetter(0, 2)`): what it pickles as holds its arguments
            with contextlib.suppress(Exception):
                held = fn.__reduce_ex__(4)[1:3]
        _feed_held(digest, held, depth)


def _attributes(value: Any) -> dict[str, Any] | None:
    """What an object holds: its ``__dict__`` and its ``__slots__`` (a slotted dataclass's fields); None for neither.

    Example:
        >>> class Scale:
        ...     __slots__ = ("factor",)
        ...     def __init__(self, factor): self.factor = factor
        >>> _attributes(Scale(2.0)), _attributes(len)
        ({'factor': 2.0}, None)
    """
    held = dict(vars(value)) if hasattr(value, "__dict__") else None
    for kind in type(value).__mro__:
        slots = kind.__dict__.get("__slots__", ())
        for name in [slots] if isinstance(slots, str) else slots:
            if name not in ("__dict__", "__weakref__") and hasattr(value, name):
                held = {**(held or {}), name: getattr(value, name)}
    return held


def _feed_held(digest: Any, value: Any, depth: int) -> None:
    """Add a value a transform holds, as `_feed` adds a sample, with transforms and objects by what they hold."""
    _feed(digest, value, functools.partial(_held_object, depth=depth))


def _held_object(digest: Any, value: Any, depth: int) -> bool:
    """For `_feed`: a transform by `_feed_callable`, an object by its attributes; False for neither (its type then)."""
    if callable(value) and not isinstance(value, type):
        _feed_callable(digest, value, depth + 1)
    elif depth < _DEPTH and (held := _attributes(value)) is not None:
        digest.update(f"object:{type(value).__module__}.{type(value).__qualname__}".encode())
        _feed_held(digest, held, depth + 1)
    else:
        return False
    return True


def dataset_fingerprint(dataset: Any) -> str:
    """A fingerprint of a map-style dataset, from its ``cache_fingerprint()`` or a sample of its items.

    Without a ``cache_fingerprint()`` method the fingerprint covers the type, the length and the bytes of up to
    eight evenly spaced samples. Give your dataset a ``cache_fingerprint()`` (e.g. file names, sizes and mtimes)
    to detect every change; the default looks at only a few items.

    Raises:
        ValueError: If ``dataset`` is not a non-empty map-style dataset (see `check_source`), or its
            ``cache_fingerprint()`` returns an empty string.

    Example:
        >>> dataset_fingerprint([1, 2, 3]) == dataset_fingerprint([1, 2, 3]) != dataset_fingerprint([1, 2, 4])
        True
    """
    length = check_source("dataset", dataset)
    custom = getattr(dataset, "cache_fingerprint", None)
    if callable(custom):
        fingerprint = str(custom())
        if not fingerprint.strip():
            raise ValueError(f"`dataset.cache_fingerprint()` must return a non-empty str, got {fingerprint!r}.")
        return fingerprint
    digest = hashlib.sha256(f"{type(dataset).__qualname__}:{length}".encode())
    for index in sorted({round(k * (length - 1) / max(1, _PROBES - 1)) for k in range(_PROBES)}):
        _feed(digest, dataset[index])
    return digest.hexdigest()[:32]


def _feed(digest: Any, value: Any, other: Callable[[Any, Any], bool] | None = None) -> None:
    """Add ``value`` to ``digest`` the same way in every process: no memory address, whatever the sample holds.

    Arrays and tensors (bfloat16 too) by dtype, shape and bytes; dicts, tuples and lists item by item; numbers,
    strings and None by ``repr``; an object numpy reads as an array (a PIL image) by that array; any other object by
    ``other(digest, object)`` when it returns True, else by its type alone (its ``repr`` may hold an address).

    Example:
        >>> def hex(value): (d := hashlib.sha256(), _feed(d, value)); return d.hexdigest()[:8]
        >>> half = torch.ones(2, dtype=torch.bfloat16)
        >>> hex({"label": 1, "image": half}) == hex({"image": half, "label": 1}), hex(object()) == hex(object())
        (True, True)
        >>> hex((1, "a")) == hex((1, "b")), hex(half) == hex(half.float())
        (False, False)
    """
    if isinstance(value, torch.Tensor):
        tensor = value.detach().cpu().contiguous()
        digest.update(f"tensor:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(value, np.ndarray) and value.dtype.kind != "O":
        digest.update(f"array:{value.dtype.str}:{value.shape}".encode() + np.ascontiguousarray(value).tobytes())
    elif isinstance(value, Mapping):
        for key in sorted(value, key=repr):
            _feed(digest, key)
            _feed(digest, value[key], other)
    elif isinstance(value, np.ndarray):  # of objects
        _feed(digest, value.tolist())
    elif isinstance(value, (tuple, list)):
        digest.update(f"{type(value).__name__}:{len(value)}".encode())
        for item in value:
            _feed(digest, item, other)
    elif value is None or isinstance(value, (str, bytes, int, float, complex, np.generic)):
        digest.update(f"{type(value).__name__}:{value!r}".encode())
    elif hasattr(value, "__array_interface__") or hasattr(value, "__array__"):  # a PIL image: by its pixels
        digest.update(f"{type(value).__qualname__}:".encode())
        _feed(digest, np.asarray(value), other)
    elif other is None or not other(digest, value):
        digest.update(f"object:{type(value).__module__}.{type(value).__qualname__}".encode())
