"""Where a `~lightning_speedkit.data.CachedDataset` lives: the ``path`` check, the build lock, the atomic replacement.

A cache is built in a private directory beside its place and renamed into it (`staging`), under an exclusive file
lock that concurrent processes share (`build_lock`); a place where the lock cannot be made fails naming ``path``.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import IO

__all__ = ["build_lock", "check_path", "staging"]


def check_path(path: object) -> Path:
    """``path`` as a Path if it names a directory, or a place where one can be made; else a ``ValueError``.

    Example:
        >>> check_path("")
        Traceback (most recent call last):
        ...
        ValueError: `path` must be a directory path (a non-empty str or os.PathLike), got ''.
    """
    text = os.fspath(path) if isinstance(path, os.PathLike) else path
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"`path` must be a directory path (a non-empty str or os.PathLike), got {path!r}.")
    root = Path(text)
    for place in (root, *root.parents):
        if place.exists():
            if not place.is_dir():
                raise ValueError(
                    f"`path` must be a directory or where one can be made, got {path!r}: {place} is a file."
                )
            break
    return root


def build_lock(root: Path, name: str) -> contextlib.AbstractContextManager[None]:
    """The exclusive build lock of the cache ``name`` in ``root`` (made if missing), released by the OS if we die.

    Raises:
        OSError: Of the file system's type and errno, naming ``path`` (``root``), when the lock cannot be made there.
    """
    try:
        root.mkdir(parents=True, exist_ok=True)
        handle = open(root / f".{name}.lock", "a+")  # noqa: SIM115 (closed by the lock)
    except OSError as error:
        message = (
            f"CachedDataset: the cache {name} is not built yet and `path`={str(root)!r} cannot hold it"
            f" ({error.strerror or error}); give a writable `path`, or build the cache there once from a process that"
            " can write to it"
        )
        raise _same_kind(error, message) from error
    return _exclusive_lock(handle)


@contextlib.contextmanager
def staging(directory: Path) -> Iterator[Path]:
    """A private directory beside ``directory`` that replaces it (a damaged one is moved aside) when the block succeeds.

    Call under the build lock. A crash leaves only ``.<name>.tmp-*`` or ``.<name>.old-*``, which the next build removes.
    """
    tmp = directory.parent / f".{directory.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        yield tmp
        if directory.exists():  # the damaged cache: readers that have it open keep their descriptors
            old = directory.parent / f".{directory.name}.old-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            os.rename(directory, old)
            shutil.rmtree(old, ignore_errors=True)
        os.rename(tmp, directory)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _same_kind(error: OSError, message: str) -> OSError:
    """An error of ``error``'s type and errno saying ``message`` (a plain ``OSError`` if that type takes other args).

    Example:
        >>> denied = _same_kind(PermissionError(13, "Permission denied"), "`path` cannot hold it")
        >>> type(denied).__name__, str(denied), str(_same_kind(OSError("no errno"), "`path` cannot hold it"))
        ('PermissionError', '[Errno 13] `path` cannot hold it', '`path` cannot hold it')
    """
    arguments = (message,) if error.errno is None else (error.errno, message)
    try:
        return type(error)(*arguments)
    except TypeError:
        return OSError(*arguments)


@contextlib.contextmanager
def _exclusive_lock(handle: IO[str]) -> Iterator[None]:
    """An advisory exclusive lock on the open file ``handle`` (closed after), released by the OS if the process dies."""
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
