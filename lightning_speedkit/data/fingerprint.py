"""Fingerprints of a data set and of a transform: what names a packed cache, so a change builds a new one."""

from __future__ import annotations

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
    """A stable identity for a transform: its qualified name plus a hash of its source code (or its ``repr``).

    Raises:
        ValueError: If ``fn`` is neither callable nor None.

    Example:
        >>> callable_fingerprint(None)
        'none'
        >>> callable_fingerprint(len) == callable_fingerprint(len)
        True
    """
    if fn is None:
        return "none"
    if not callable(fn):
        raise ValueError(f"`fn` must be a function (a transform) or None, got {short_repr(fn)}.")
    name = f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', type(fn).__qualname__)}"
    try:
        body = inspect.getsource(fn if inspect.isroutine(fn) else type(fn))
    except (OSError, TypeError):
        body = repr(fn)
    state = repr(sorted(vars(fn).items())) if hasattr(fn, "__dict__") and not inspect.isroutine(fn) else ""
    return f"{name}:{hashlib.sha256((body + state).encode()).hexdigest()[:16]}"


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


def _feed(digest: Any, value: Any) -> None:
    """Add ``value`` to ``digest`` the same way in every process: no memory address, whatever the sample holds.

    Arrays and tensors (bfloat16 too) by dtype, shape and bytes; dicts, tuples and lists item by item; numbers,
    strings and None by ``repr``; any other object by its type alone (its ``repr`` may hold an address).

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
            _feed(digest, value[key])
    elif isinstance(value, np.ndarray):  # of objects
        _feed(digest, value.tolist())
    elif isinstance(value, (tuple, list)):
        digest.update(f"{type(value).__name__}:{len(value)}".encode())
        for item in value:
            _feed(digest, item)
    elif value is None or isinstance(value, (str, bytes, int, float, complex, np.generic)):
        digest.update(f"{type(value).__name__}:{value!r}".encode())
    else:
        digest.update(f"object:{type(value).__module__}.{type(value).__qualname__}".encode())
