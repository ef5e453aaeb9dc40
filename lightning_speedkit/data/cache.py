"""Decode once, serve from a packed file of checked rows: a cache for decoded, pre-augmentation samples.

Format, chosen by measurement (``benchmarks/dataloader.py``): one ``.npy`` file of fixed-size rows, a sample a row
with its checksum (`lightning_speedkit.data.packed`), read with one positional read a sample. A random read of a
decoded 64x64 RGB sample, its checksum checked, costs about 1/30 of opening and decoding its JPEG (10.6 us against
323 us of CPU on a 2-core EPYC, ``benchmarks/results/dataloader.json``); the format needs no extra dependency,
the OS page cache shares it between worker processes and DDP ranks, and opening it in each worker is free (nothing
is pickled but the path).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import itertools
import logging
import operator
import os
import shutil
import struct
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import torch
from PIL import Image
from torch.utils.data import Dataset

from lightning_speedkit.checks import check_bool, check_int
from lightning_speedkit.data.build import decode_all
from lightning_speedkit.data.fingerprint import callable_fingerprint, check_source, dataset_fingerprint
from lightning_speedkit.data.packed import (
    FORMAT_VERSION,
    CacheDamagedError,
    PackedRows,
    check_cache,
    mark_damaged,
    write_packed,
)
from lightning_speedkit.data.place import build_lock, check_path, staging
from lightning_speedkit.data.rows import describe_fields, row_layout, short_repr

log = logging.getLogger(__name__)

__all__ = ["CacheBudgetError", "CachedDataset"]

_STRUCT_CODES = {  # (numpy kind, bytes) -> struct's code, standard sizes
    ("b", 1): "?",
    ("i", 1): "b",
    ("i", 2): "h",
    ("i", 4): "i",
    ("i", 8): "q",
    ("u", 1): "B",
    ("u", 2): "H",
    ("u", 4): "I",
    ("u", 8): "Q",
    ("f", 2): "e",
    ("f", 4): "f",
    ("f", 8): "d",
}


class CacheBudgetError(RuntimeError):
    """The packed cache would not fit the disk or memory budget given."""


class CachedDataset(Dataset[Any]):
    """Serve ``pre_transform(source[i])`` from a packed cache of checked rows, then apply ``transform`` per sample.

    The first use decodes every sample once (in worker processes when timing the first samples says they are
    faster: `lightning_speedkit.data.build`; `build_report` says which) and writes it, with its checksum, into a
    private temporary directory, which is checked, then renamed into place with its manifest, under an exclusive
    file lock: concurrent processes (DataLoader workers, DDP ranks, a second job) build it once and share it, and a
    build killed half-way leaves only a stale temporary directory that the next build removes. The cache
    directory's name holds a fingerprint of the source (`dataset_fingerprint`) and of ``pre_transform``
    (`callable_fingerprint`), so a change of either builds a new cache. Random augmentation belongs in
    ``transform``, which runs on every access.

    A damaged cache is never served. Opening one checks that its manifest is intact and every file has its size;
    every read checks its sample's checksum; `build` and `verify` check every byte. A cache found damaged on open,
    or by an earlier read or `verify`, is rebuilt from ``source``; a read that finds a damaged sample raises
    `CacheDamagedError` naming the cache, the file and the sample.

    Samples may be a single array/tensor/number or a tuple of them; every sample must have the same shapes and
    dtypes. Tensors come back as tensors, arrays as arrays (0-d too), numpy scalars as numpy scalars of their dtype and
    Python numbers as Python numbers, so a collated batch has the source's dtypes.

    Args:
        source: A map-style dataset (``__len__`` and ``__getitem__``) returning decoded, deterministic samples.
        path: Directory that holds caches (one sub-directory per fingerprint); made if missing.
        pre_transform: Deterministic work to cache (decode, resize); part of the fingerprint.
        transform: Per-access work after the cache (random crop, flip, normalise).
        fingerprint: Overrides the source's fingerprint (e.g. a data-set version string).
        max_disk_bytes: Refuse to build a cache whose rows (`nbytes`) exceed this; the data file's header and the
            manifest add under a few KiB.
        in_memory: Load the packed rows into RAM instead of reading them from the file.
        max_memory_bytes: With ``in_memory``, refuse when the rows exceed this (default: available RAM).

    Raises:
        ValueError: For a ``source`` that is not a non-empty map-style dataset (a str, a class, an IterableDataset),
            a ``path`` that is not a non-empty path or lies under a file, a ``fingerprint`` that is not a non-empty
            str, a budget that is not a positive int (bytes), ``in_memory`` not a bool, a transform that is not
            callable, samples whose fields differ from the first sample's, or a cache of another length than
            ``source`` (a ``fingerprint`` that did not change with the data).
        CacheBudgetError: When the cache would not fit the free disk space, ``max_disk_bytes`` or the memory budget.
        CacheDamagedError: When a damaged cache cannot be rebuilt (``source`` fails), or a read finds a damaged
            sample.

    Example:
        >>> import tempfile
        >>> source = [(torch.full((2, 2), float(i)), i) for i in range(4)]
        >>> cached = CachedDataset(source, tempfile.mkdtemp())
        >>> cached[3]
        (tensor([[3., 3.],
                [3., 3.]]), 3)
        >>> cached.verify()
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
        self._source_length = check_source("source", source)
        self.root = check_path(path)
        if fingerprint is not None and (not isinstance(fingerprint, str) or not fingerprint.strip()):
            shown = short_repr(fingerprint)
            raise ValueError(f"`fingerprint` must be a non-empty str (e.g. a data-set version) or None, got {shown}.")
        check_int("max_disk_bytes", max_disk_bytes, optional=True)
        check_int("max_memory_bytes", max_memory_bytes, optional=True)
        check_bool("in_memory", in_memory)
        for name, function in (("pre_transform", pre_transform), ("transform", transform)):
            if function is not None and not callable(function):
                raise ValueError(f"`{name}` must be a function of a sample or None, got {short_repr(function)}.")
        self.source = source
        self.pre_transform = pre_transform
        self.transform = transform
        self.max_disk_bytes = max_disk_bytes
        self.in_memory = in_memory
        self.max_memory_bytes = max_memory_bytes
        self.build_report: dict[str, Any] = {}
        """What this object's build of the cache decided (`lightning_speedkit.data.build.decode_all`) and its
        ``seconds`` (decoding, writing and checking); empty when it found the cache built."""
        identity = fingerprint if fingerprint is not None else dataset_fingerprint(source)
        key = hashlib.sha256(f"{identity}|{callable_fingerprint(pre_transform)}".encode()).hexdigest()[:20]
        self.directory = self.root / f"cache-v{FORMAT_VERSION}-{key}"
        self._open(self._ensure(full=False))
        if self._length != self._source_length:
            raise ValueError(
                f"CachedDataset: the cache {self.directory} holds {self._length} samples but `source` has"
                f" {self._source_length}: its fingerprint ({identity!r}) did not change with the data; give the new"
                " data a new `fingerprint` (or `cache_fingerprint()`)."
            )

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index: int) -> Any:
        position = operator.index(index)  # a TypeError for a non-integer, as for a list
        if position < 0:
            position += self._length
        if not 0 <= position < self._length:
            raise IndexError(f"CachedDataset index {index} is out of range for {self._length} samples.")
        words = self._rows.row(position)  # a private copy, its checksum checked
        fields: list[Any] = []
        for kind, start, dtype, shape, unpack in self._layout:
            if unpack is not None:  # a Python number: straight to one
                fields.append(unpack(words, start)[0])
            else:
                value = np.ndarray(shape, dtype, words, start)
                if kind == "tensor":
                    fields.append(torch.from_numpy(value))
                else:
                    fields.append(value[()] if kind == "numpy" else Image.fromarray(value) if kind == "pil" else value)
        sample = tuple(fields) if self._tuple else fields[0]
        return self.transform(sample) if self.transform is not None else sample

    @property
    def nbytes(self) -> int:
        """Size of the packed rows in bytes: the data file after its header, and what ``in_memory`` loads."""
        return self._length * self._row_bytes

    def build(self) -> Path:
        """Check every byte of the cache and rebuild it if it is damaged or missing; safe from many processes at once.

        Returns:
            The cache directory.
        """
        self._open(self._ensure(full=True))
        return self.directory

    def verify(self) -> None:
        """Read the whole cache and check it: the manifest, every file's size and SHA-256, every sample's checksum.

        Raises:
            CacheDamagedError: Naming the cache directory, the file and, for a sample, its index. The cache is then
                marked damaged: `build` or the next ``CachedDataset(...)`` rebuilds it.
        """
        try:
            check_cache(self.directory, full=True, missing_ok=False)
        except CacheDamagedError as error:
            raise mark_damaged(error) from None

    def _ensure(self, full: bool) -> dict[str, Any]:
        """The manifest of an undamaged cache: the one there (checked), or one built now under the lock."""
        with contextlib.suppress(CacheDamagedError):
            manifest = check_cache(self.directory, full)
            if manifest is not None:
                return manifest
        with build_lock(self.root, self.directory.name):
            damage, manifest = None, None
            try:
                manifest = check_cache(self.directory, full)  # another process may have (re)built it meanwhile
            except CacheDamagedError as error:
                damage = error
                log.warning("%s; rebuilding it from `source`", error)
            if manifest is not None:
                return manifest
            for stale in [
                *self.root.glob(f".{self.directory.name}.tmp-*"),
                *self.root.glob(f".{self.directory.name}.old-*"),
            ]:
                log.warning("CachedDataset: removing the incomplete cache build %s", stale)
                shutil.rmtree(stale, ignore_errors=True)
            try:
                return self._write()
            except Exception as error:
                if damage is None or isinstance(error, (CacheBudgetError, ValueError)):
                    raise
                message = f"{damage}; rebuilding it from `source` failed: {error!r}"
                raise CacheDamagedError(message, damage.directory, damage.file, damage.index, damage.problem) from error

    def _write(self) -> dict[str, Any]:
        began = time.perf_counter()
        first = self._decoded(0)
        fields, is_tuple = describe_fields(first)
        length = self._source_length
        total = row_layout(fields)[1] * length
        free = shutil.disk_usage(self.root).free
        if self.max_disk_bytes is not None and total > self.max_disk_bytes:
            raise CacheBudgetError(
                f"CachedDataset: the cache needs {total:,} bytes, more than `max_disk_bytes`={self.max_disk_bytes:,}."
            )
        if total > free:
            raise CacheBudgetError(
                f"CachedDataset: the cache needs {total:,} bytes, but {self.root} has {free:,} free."
            )
        self._check_memory(total)  # before decoding and writing it, as the disk budgets
        self.build_report = {}
        samples = itertools.chain([first], decode_all(self._decoded, 1, length, report=self.build_report))
        with staging(self.directory) as tmp:
            manifest = write_packed(tmp, samples, length, fields, is_tuple)
            check_cache(tmp, full=True)  # read back: a bad write fails here, not in training
        way = self.build_report
        way["seconds"] = time.perf_counter() - began
        shown = f"{way['workers']} workers" if way["way"] == "workers" else "this process"
        log.info(
            "CachedDataset: packed %d samples (%s bytes) into %s, decoded by %s", length, total, self.directory, shown
        )
        for older in sorted(self.root.glob(f"cache-v*-{self.directory.name.rsplit('-', 1)[1]}")):
            if older != self.directory and older.is_dir():  # an older (or newer) format: not read, left, named
                log.warning(
                    "CachedDataset: %s holds the same source in another cache format, which this version does not read;"
                    " remove it to free its space",
                    older,
                )
        return manifest

    def _decoded(self, index: int) -> Any:
        sample = self.source[index]
        return self.pre_transform(sample) if self.pre_transform is not None else sample

    def _open(self, manifest: dict[str, Any]) -> None:
        """Serve the cache of ``manifest`` (its structure is trusted: the manifest matched its own checksum)."""
        previous: PackedRows | None = getattr(self, "_rows", None)
        if previous is not None:  # build() after a rebuild: read the new file
            previous.close()
        self._length: int = manifest["length"]
        self._row_bytes: int = manifest["row_bytes"]
        self._tuple: bool = manifest["tuple"]
        self._layout = [
            (
                field["kind"],
                field["offset"],
                np.dtype(field["dtype"]),
                tuple(field["shape"]),
                _number_reader(np.dtype(field["dtype"])) if field["kind"] == "scalar" else None,
            )
            for field in manifest["fields"]
        ]
        self._check_memory(self.nbytes)
        self._rows: PackedRows = PackedRows(self.directory, manifest, self.in_memory)

    def _check_memory(self, nbytes: int) -> None:
        """With ``in_memory``, a `CacheBudgetError` when ``nbytes`` of rows exceed the memory budget."""
        if not self.in_memory:
            return
        budget = self.max_memory_bytes if self.max_memory_bytes is not None else psutil.virtual_memory().available
        if nbytes > budget:
            raise CacheBudgetError(
                f"CachedDataset: loading the cache into memory needs {nbytes:,} bytes, more than the budget"
                f" of {budget:,} bytes (`max_memory_bytes`); use in_memory=False to read it from the file instead."
            )


def _number_reader(dtype: np.dtype[Any]) -> Callable[[Any, int], tuple[Any, ...]]:
    """A reader of one number of ``dtype`` at an offset of a buffer: ``struct``'s, 5x faster than numpy's ``item()``.

    Example:
        >>> _number_reader(np.dtype("<i8"))(np.arange(3, dtype="<i8"), 16)
        (2,)
    """
    code = _STRUCT_CODES.get((dtype.kind, dtype.itemsize))
    if code is None:  # complex, long double
        return functools.partial(_number, dtype)
    return functools.partial(struct.unpack_from, ("<" if dtype.str[0] in "<|" else ">") + code)


def _number(dtype: np.dtype[Any], buffer: Any, offset: int) -> tuple[Any]:
    return (np.ndarray((), dtype, buffer, offset).item(),)
