"""Fingerprints of a data set and of a transform: what names a packed cache, so a change builds a new one."""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Callable
from typing import Any

import numpy as np
from torch.utils.data import IterableDataset

from lightning_speedkit.data.rows import as_fields, short_repr, to_numpy

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
        for field in as_fields(dataset[index]):
            digest.update(np.ascontiguousarray(to_numpy(field)).tobytes())
    return digest.hexdigest()[:32]
