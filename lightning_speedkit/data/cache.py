"""Decode once, serve from a packed memory-mapped file: a cache for decoded, pre-augmentation samples.

Format, chosen by measurement (``benchmarks/dataloader.py``): one ``.npy`` file per sample field, opened with
``numpy.load(mmap_mode="r")``. A random read of a decoded 64x64 RGB sample takes ~5 us against ~140 us to open
and decode its JPEG on a 2-core machine; the format needs no extra dependency, the OS page cache shares it between
worker processes and DDP ranks, and opening it in each worker is free (nothing is pickled but the path).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import inspect
import json
import logging
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import torch
from torch.utils.data import Dataset

from lightning_speedkit.checks import check_bool, check_int
from lightning_speedkit.report import atomic_directory

log = logging.getLogger(__name__)

__all__ = ["CacheBudgetError", "CachedDataset", "callable_fingerprint", "dataset_fingerprint"]

_FORMAT_VERSION = 1
_PROBES = 8


class CacheBudgetError(RuntimeError):
    """The packed cache would not fit the disk or memory budget given."""


def callable_fingerprint(fn: Callable[..., Any] | None) -> str:
    """A stable identity for a transform: its qualified name plus a hash of its source code (or its ``repr``).

    Example:
        >>> callable_fingerprint(None)
        'none'
        >>> callable_fingerprint(len) == callable_fingerprint(len)
        True
    """
    if fn is None:
        return "none"
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
    """
    custom = getattr(dataset, "cache_fingerprint", None)
    if callable(custom):
        return str(custom())
    digest = hashlib.sha256(f"{type(dataset).__qualname__}:{len(dataset)}".encode())
    for index in sorted({round(k * (len(dataset) - 1) / max(1, _PROBES - 1)) for k in range(_PROBES)}):
        for field in _as_tuple(dataset[index]):
            digest.update(np.ascontiguousarray(_to_numpy(field)).tobytes())
    return digest.hexdigest()[:32]


def _as_tuple(sample: Any) -> tuple[Any, ...]:
    return tuple(sample) if isinstance(sample, (tuple, list)) else (sample,)


def _to_numpy(field: Any) -> np.ndarray[Any, Any]:
    if isinstance(field, torch.Tensor):
        return field.detach().cpu().numpy()
    return np.asarray(field)


class CachedDataset(Dataset[Any]):
    """Serve ``pre_transform(source[i])`` from a packed memory-mapped cache, then apply ``transform`` per sample.

    The first use decodes every sample once and writes one ``.npy`` file per field into a private temporary
    directory, which is renamed into place with its manifest, under an exclusive file lock: concurrent processes
    (DataLoader workers, DDP ranks, a second job) build it once and share it, and a build killed half-way leaves
    only a stale temporary directory that the next build removes. The cache directory's name holds a fingerprint
    of the source (`dataset_fingerprint`) and of ``pre_transform`` (`callable_fingerprint`), so a change of either
    builds a new cache. Random augmentation belongs in ``transform``, which runs on every access.

    Samples may be a single array/tensor/number or a tuple of them; every sample must have the same shapes and
    dtypes. Tensors come back as tensors, numbers as Python numbers.

    Args:
        source: A map-style dataset returning decoded, deterministic samples.
        path: Directory that holds caches (one sub-directory per fingerprint).
        pre_transform: Deterministic work to cache (decode, resize); part of the fingerprint.
        transform: Per-access work after the cache (random crop, flip, normalise).
        fingerprint: Overrides the source's fingerprint (e.g. a data-set version string).
        max_disk_bytes: Refuse to build a cache larger than this.
        in_memory: Load the packed arrays into RAM instead of memory-mapping them.
        max_memory_bytes: With ``in_memory``, refuse when the arrays exceed this (default: available RAM).

    Raises:
        ValueError: For a source that is not a non-empty map-style dataset, a budget that is not a positive int (bytes),
            or a transform that is not callable.
        CacheBudgetError: When the cache would not fit the free disk space, ``max_disk_bytes`` or the memory budget.

    Example:
        >>> import tempfile
        >>> source = [(torch.full((2, 2), float(i)), i) for i in range(4)]
        >>> cached = CachedDataset(source, tempfile.mkdtemp())
        >>> cached[3]
        (tensor([[3., 3.],
                [3., 3.]]), 3)
    """

    def __init__(
        self,
        source: Any,
        path: str | os.PathLike[str],
        pre_transform: Callable[[Any], Any] | None = None,
        transform: Callable[[Any], Any] | None = None,
        fingerprint: str | None = None,
        max_disk_bytes: int | None = None,
        in_memory: bool = False,
        max_memory_bytes: int | None = None,
    ) -> None:
        if not hasattr(source, "__len__") or not hasattr(source, "__getitem__"):
            raise ValueError(
                f"`source` must be a map-style dataset (with `__len__` and `__getitem__`), got {source!r}."
            )
        if len(source) == 0:
            raise ValueError("`source` must hold at least one sample, got an empty dataset.")
        check_int("max_disk_bytes", max_disk_bytes, optional=True)
        check_int("max_memory_bytes", max_memory_bytes, optional=True)
        check_bool("in_memory", in_memory)
        for name, function in (("pre_transform", pre_transform), ("transform", transform)):
            if function is not None and not callable(function):
                raise ValueError(f"`{name}` must be a function of a sample or None, got {function!r}.")
        self.source = source
        self.pre_transform = pre_transform
        self.transform = transform
        self.max_disk_bytes = max_disk_bytes
        self.in_memory = in_memory
        self.max_memory_bytes = max_memory_bytes
        key = hashlib.sha256(
            f"{fingerprint or dataset_fingerprint(source)}|{callable_fingerprint(pre_transform)}".encode()
        ).hexdigest()[:20]
        self.root = Path(path)
        self.directory = self.root / f"cache-v{_FORMAT_VERSION}-{key}"
        self._arrays: list[np.ndarray[Any, Any]] | None = None
        self.build()
        manifest = json.loads((self.directory / "manifest.json").read_text())
        self._fields: list[dict[str, Any]] = manifest["fields"]
        self._length: int = manifest["length"]
        self._check_memory()

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index: int) -> Any:
        arrays = self._open()
        fields: list[Any] = []
        for meta, array in zip(self._fields, arrays, strict=True):
            value = np.array(array[index])  # a private copy: the memory map stays read-only
            if meta["kind"] == "tensor":
                fields.append(torch.from_numpy(value))
            elif meta["kind"] == "scalar":
                fields.append(value.item())
            else:
                fields.append(value)
        sample = tuple(fields) if self._fields[0]["tuple"] else fields[0]
        return self.transform(sample) if self.transform is not None else sample

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        if not self.in_memory:
            state["_arrays"] = None  # each worker maps the files itself
        return state

    @property
    def nbytes(self) -> int:
        """Size of the packed arrays in bytes."""
        return sum(int(np.prod(m["shape"])) * np.dtype(m["dtype"]).itemsize * self._length for m in self._fields)

    def build(self) -> Path:
        """Build the cache unless a complete one exists; safe to call from many processes at once."""
        if (self.directory / "manifest.json").is_file():
            return self.directory
        self.root.mkdir(parents=True, exist_ok=True)
        with _exclusive_lock(self.root / f".{self.directory.name}.lock"):
            if (self.directory / "manifest.json").is_file():  # another process built it while we waited
                return self.directory
            for stale in self.root.glob(f".{self.directory.name}.tmp-*"):  # left by a killed build
                log.warning("CachedDataset: removing the incomplete cache build %s", stale)
                shutil.rmtree(stale, ignore_errors=True)
            self._write()
        return self.directory

    def _write(self) -> None:
        first = self._decoded(0)
        fields = [self._describe(field, isinstance(first, (tuple, list))) for field in _as_tuple(first)]
        total = sum(int(np.prod(m["shape"])) * np.dtype(m["dtype"]).itemsize for m in fields) * len(self.source)
        free = shutil.disk_usage(self.root).free
        if self.max_disk_bytes is not None and total > self.max_disk_bytes:
            raise CacheBudgetError(
                f"CachedDataset: the cache needs {total:,} bytes, more than `max_disk_bytes`={self.max_disk_bytes:,}."
            )
        if total > free:
            raise CacheBudgetError(
                f"CachedDataset: the cache needs {total:,} bytes, but {self.root} has {free:,} free."
            )
        with atomic_directory(self.directory) as tmp:
            arrays = [
                np.lib.format.open_memmap(
                    tmp / f"field{i}.npy", mode="w+", dtype=m["dtype"], shape=(len(self.source), *m["shape"])
                )
                for i, m in enumerate(fields)
            ]
            for index in range(len(self.source)):
                sample = _as_tuple(first if index == 0 else self._decoded(index))
                for array, field in zip(arrays, sample, strict=True):
                    array[index] = _to_numpy(field)
            for array in arrays:
                array.flush()
            del arrays
            manifest = {"version": _FORMAT_VERSION, "length": len(self.source), "fields": fields}
            (tmp / "manifest.json").write_text(json.dumps(manifest))
        log.info("CachedDataset: packed %d samples (%s bytes) into %s", len(self.source), total, self.directory)

    def _decoded(self, index: int) -> Any:
        sample = self.source[index]
        return self.pre_transform(sample) if self.pre_transform is not None else sample

    @staticmethod
    def _describe(field: Any, is_tuple: bool) -> dict[str, Any]:
        kind = "tensor" if isinstance(field, torch.Tensor) else "scalar" if np.ndim(field) == 0 else "array"
        array = _to_numpy(field)
        return {"kind": kind, "dtype": array.dtype.str, "shape": list(array.shape), "tuple": is_tuple}

    def _check_memory(self) -> None:
        if not self.in_memory:
            return
        budget = self.max_memory_bytes if self.max_memory_bytes is not None else psutil.virtual_memory().available
        if self.nbytes > budget:
            raise CacheBudgetError(
                f"CachedDataset: loading the cache into memory needs {self.nbytes:,} bytes, more than the budget of"
                f" {budget:,} bytes (`max_memory_bytes`); use in_memory=False to memory-map it instead."
            )
        self._open()

    def _open(self) -> list[np.ndarray[Any, Any]]:
        if self._arrays is None:
            files = [self.directory / f"field{i}.npy" for i in range(len(self._fields))]
            self._arrays = [np.load(f) if self.in_memory else np.load(f, mmap_mode="r") for f in files]
        return self._arrays


@contextlib.contextmanager
def _exclusive_lock(path: Path) -> Iterator[None]:
    """An advisory exclusive lock on ``path``, released by the OS if the process dies."""
    with open(path, "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
