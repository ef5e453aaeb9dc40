"""The packed cache on disk: one ``.npy`` file of fixed-size rows, each with its checksum, and a self-checked manifest.

A row holds one sample: an 8-byte checksum, then each field at an offset aligned for its dtype, padded to a multiple
of 8 bytes. The file is an ordinary ``.npy`` of a structured dtype (``numpy.load`` opens it), but it is read here with
positional reads (``os.preadv``), not a memory map: a file truncated under a reader gives a short read and a clear
error instead of SIGBUS, and the pages are still shared between processes through the OS page cache.

Three levels of checks: `check_cache` on open (the manifest parses and matches its own SHA-256; every file it lists
is present with its size), ``check_cache(full=True)`` in the build and ``CachedDataset.verify()`` (each file's
SHA-256 and every row's checksum), and `PackedRows.row` on every read (that row's checksum, `row_checksum`).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from lightning_speedkit.data.rows import pack_row, row_checksum, row_checksums, row_layout, short_repr

__all__ = [
    "DAMAGED",
    "DATA_FILE",
    "FORMAT_VERSION",
    "MANIFEST",
    "CacheDamagedError",
    "PackedRows",
    "check_cache",
    "manifest_text",
    "mark_damaged",
    "parse_manifest",
    "write_packed",
]

FORMAT_VERSION = 4  # 3: a numpy scalar comes back as its dtype's scalar, not a Python number; 4: a PIL image as one
DATA_FILE = "samples.npy"
MANIFEST = "manifest.json"
DAMAGED = "damaged.txt"  # written by a read that found a damaged row: the next open rebuilds the cache
_CHUNK_BYTES = 4 << 20  # rows written and fully checked this many bytes at a time


class CacheDamagedError(RuntimeError):
    """A packed cache is not what its build wrote: a file truncated, overwritten or missing, or a garbled manifest.

    ``directory``, ``file`` (a name inside it), ``index`` (the sample, when one is known) and ``problem`` say where
    and what.
    """

    def __init__(
        self,
        message: str,
        directory: Path | None = None,
        file: str | None = None,
        index: int | None = None,
        problem: str | None = None,
    ) -> None:
        super().__init__(message)
        self.directory, self.file, self.index, self.problem = directory, file, index, problem

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (str(self), self.directory, self.file, self.index, self.problem)


def _damaged(directory: Path, file: str, problem: str, index: int | None = None) -> CacheDamagedError:
    where = f"{file}, sample {index}" if index is not None else file
    message = f"CachedDataset: the cache {directory} is damaged ({where}): {problem}"
    return CacheDamagedError(message, directory, file, index, problem)


def mark_damaged(error: CacheDamagedError) -> CacheDamagedError:
    """Mark the cache named by ``error`` damaged, so that the next open rebuilds it; return the error, saying so."""
    if error.directory is None or error.file == DAMAGED:
        return error
    where = f"{error.file}, sample {error.index}" if error.index is not None else error.file
    try:
        (error.directory / DAMAGED).write_text(f"{where}: {error.problem}\n")
    except OSError:  # a read-only cache: the error still says what is wrong
        return error
    message = f"{error}; it is marked damaged, and the next CachedDataset(...) or build() rebuilds it"
    return CacheDamagedError(message, error.directory, error.file, error.index, error.problem)


def _digest(body: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def manifest_text(body: dict[str, Any]) -> str:
    """The manifest file's text: ``body`` plus the SHA-256 of its canonical JSON, so that damage to it shows.

    Example:
        >>> text = manifest_text({"version": FORMAT_VERSION, "length": 12345})
        >>> parse_manifest(text)["length"]
        12345
        >>> parse_manifest(text.replace("12345", "12346"))
        Traceback (most recent call last):
        ...
        ValueError: does not match its own checksum: it was changed or garbled after the build
    """
    return json.dumps({**body, "sha256": _digest(body)}, sort_keys=True, indent=1)


def parse_manifest(text: str) -> dict[str, Any]:
    """The manifest written by `manifest_text`, after checking it; a ``ValueError`` says what is wrong with it.

    Example:
        >>> parse_manifest('{"version": 2')
        Traceback (most recent call last):
        ...
        ValueError: does not parse as JSON (Expecting ',' delimiter: line 1 column 14 (char 13)): truncated or garbled
    """
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"does not parse as JSON ({error}): truncated or garbled") from None
    if not isinstance(data, dict) or not isinstance(data.get("sha256"), str):
        raise ValueError(f"holds no checksum of its own (got {short_repr(data)}): garbled")
    claimed = data.pop("sha256")
    if _digest(data) != claimed:
        raise ValueError("does not match its own checksum: it was changed or garbled after the build")
    if data.get("version") != FORMAT_VERSION:
        raise ValueError(f"is of format version {data.get('version')!r}, this version reads {FORMAT_VERSION}")
    return data


def write_packed(
    directory: Path, samples: Iterable[Any], length: int, fields: list[dict[str, Any]], is_tuple: bool
) -> dict[str, Any]:
    """Write ``length`` samples as the rows of ``directory / DATA_FILE``, then the manifest; return the manifest.

    The recorded SHA-256 is of the bytes meant to be written, so a full check afterwards catches a bad write.
    """
    _, row_bytes = row_layout(fields)
    formats = [np.dtype(f["dtype"]) if not f["shape"] else (np.dtype(f["dtype"]), tuple(f["shape"])) for f in fields]
    names, offsets = ["checksum", *(f"field{i}" for i in range(len(fields)))], [0, *(f["offset"] for f in fields)]
    dtype = np.dtype({"names": names, "formats": ["<u8", *formats], "offsets": offsets, "itemsize": row_bytes})
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        header, {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": (length,)}
    )
    digest = hashlib.sha256(header.getvalue())
    iterator = iter(samples)
    rows_per_chunk = max(1, _CHUNK_BYTES // row_bytes)
    path = directory / DATA_FILE
    with open(path, "wb") as handle:
        handle.write(header.getvalue())
        for first in range(0, length, rows_per_chunk):
            block = np.zeros((min(rows_per_chunk, length - first), row_bytes // 8), "<u8")
            for offset, row in enumerate(block.view(np.uint8)):
                pack_row(row, fields, next(iterator), first + offset)
            block[:, 0] = row_checksums(block, first)
            digest.update(block.data)
            handle.write(block.data)
        handle.flush()
        os.fsync(handle.fileno())
    body = {
        "version": FORMAT_VERSION,
        "length": length,
        "tuple": is_tuple,
        "fields": fields,
        "row_bytes": row_bytes,
        "data_offset": len(header.getvalue()),
        "files": {DATA_FILE: {"size": len(header.getvalue()) + length * row_bytes, "sha256": digest.hexdigest()}},
    }
    with open(directory / MANIFEST, "w") as handle:
        handle.write(manifest_text(body))
        handle.flush()
        os.fsync(handle.fileno())
    return body


def check_cache(directory: Path, full: bool = False, missing_ok: bool = True) -> dict[str, Any] | None:
    """The manifest of the cache in ``directory``, or None if there is none; raise `CacheDamagedError` if damaged.

    The cheap check, always: no damage mark, the manifest parses and matches its own checksum, every file it lists
    is there with its size. ``full`` also reads every file: its SHA-256 and the checksum of each row. Without
    ``missing_ok``, a missing directory is damage too.
    """
    if not directory.exists():
        if missing_ok:
            return None
        raise _damaged(directory, MANIFEST, "is missing: the cache directory was removed")
    mark = directory / DAMAGED
    if mark.exists():
        try:
            found = mark.read_text(errors="replace").strip()
        except OSError as error:
            found = f"({error})"
        raise _damaged(directory, DAMAGED, f"a read found it damaged: {found}")
    try:
        manifest = parse_manifest((directory / MANIFEST).read_text(errors="replace"))
    except FileNotFoundError:
        raise _damaged(directory, MANIFEST, "is missing") from None
    except (OSError, ValueError) as error:
        raise _damaged(directory, MANIFEST, str(error)) from None
    for name, meta in manifest["files"].items():
        try:
            size = (directory / name).stat().st_size
        except FileNotFoundError:
            raise _damaged(directory, name, "is missing") from None
        if size != meta["size"]:
            raise _damaged(
                directory,
                name,
                f"is {size:,} bytes, the manifest says {meta['size']:,}: truncated or grown after the build",
            )
    if full:
        _check_rows(directory, manifest)
    return manifest


def _check_rows(directory: Path, manifest: dict[str, Any]) -> None:
    """Read the data file once: every row's checksum, then the whole file's SHA-256."""
    row_bytes, length, data_offset = manifest["row_bytes"], manifest["length"], manifest["data_offset"]
    rows_per_chunk = max(1, _CHUNK_BYTES // row_bytes)
    try:
        with open(directory / DATA_FILE, "rb") as handle:
            digest = hashlib.sha256(handle.read(data_offset))
            for first in range(0, length, rows_per_chunk):
                block = np.empty((min(rows_per_chunk, length - first), row_bytes // 8), "<u8")
                got = handle.readinto(block.data)
                if got != block.nbytes:
                    index = first + got // row_bytes
                    raise _damaged(
                        directory, DATA_FILE, f"ends at byte {data_offset + first * row_bytes + got:,}", index
                    )
                digest.update(block.data)
                bad = np.flatnonzero(block[:, 0] != row_checksums(block, first))
                if bad.size:
                    index = first + int(bad[0])
                    start = data_offset + index * row_bytes
                    problem = (
                        f"bytes {start:,}-{start + row_bytes:,} do not match their checksum: changed after the build"
                    )
                    raise _damaged(directory, DATA_FILE, problem, index)
    except OSError as error:
        raise _damaged(directory, DATA_FILE, f"cannot be read ({error})") from None
    if digest.hexdigest() != manifest["files"][DATA_FILE]["sha256"]:
        raise _damaged(directory, DATA_FILE, "does not match its SHA-256 in the manifest: its header was changed")


class PackedRows:
    """Checked reads of one row of a packed file at a time: positional reads, or from memory with ``in_memory``.

    The file is opened in each process on its first read: a spawned DataLoader worker unpickles the path and layout
    only, and a forked one reads through the inherited descriptor (``os.preadv`` moves no shared file position).
    """

    def __init__(self, directory: Path, manifest: dict[str, Any], in_memory: bool = False) -> None:
        self.directory, self.path = directory, directory / DATA_FILE
        self.length: int = manifest["length"]
        self.row_bytes: int = manifest["row_bytes"]
        self.data_offset: int = manifest["data_offset"]
        self._fd: int | None = None
        self._memory: np.ndarray[Any, Any] | None = None
        if in_memory:
            memory = np.fromfile(self.path, dtype="<u8", offset=self.data_offset)
            if memory.size * 8 != self.length * self.row_bytes:
                problem = f"holds {memory.size * 8:,} bytes of rows, the manifest says {self.length * self.row_bytes:,}"
                raise _damaged(directory, DATA_FILE, problem)
            self._memory = memory.reshape(self.length, self.row_bytes // 8)

    def row(self, index: int) -> np.ndarray[Any, np.dtype[np.uint64]]:
        """Row ``index`` (``0 <= index < length``), a private array of 64-bit words, after checking its checksum.

        Raises:
            CacheDamagedError: If the file ends inside the row, or the row does not match its checksum (the cache is
                then marked damaged, so that the next open rebuilds it).
        """
        words: np.ndarray[Any, np.dtype[np.uint64]]
        if self._memory is not None:
            words = self._memory[index].copy()
        else:
            if self._fd is None:
                try:
                    self._fd = os.open(self.path, os.O_RDONLY)
                except FileNotFoundError as error:  # removed after the cache was opened (not EMFILE, EACCES: no damage)
                    raise self._failed(index, f"the file cannot be opened ({error.strerror})") from error
            words = np.empty(self.row_bytes // 8, "<u8")
            start = self.data_offset + index * self.row_bytes
            got = os.preadv(self._fd, [words.data], start)
            if got != self.row_bytes:
                self._read_rest(self._fd, words, index, got)
        if int(words[0]) != row_checksum(words, index):
            raise self._failed(index, "the sample does not match its checksum: the file was changed after the build")
        return words

    def close(self) -> None:
        """Close this process's descriptor of the file (the next read opens it again)."""
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_fd": None}  # another process opens the file itself

    def __del__(self) -> None:
        self.close()

    def _read_rest(self, fd: int, words: np.ndarray[Any, Any], index: int, got: int) -> None:
        """After a short read: read the rest of the row, or fail if the file ends inside it (it was truncated)."""
        start, view = self.data_offset + index * self.row_bytes, words.view(np.uint8)
        while 0 < got < self.row_bytes:
            more = os.preadv(fd, [view[got:].data], start + got)
            if not more:
                break
            got += more
        if got != self.row_bytes:
            raise self._failed(index, f"the file ends at byte {start + got:,}, inside the sample: truncated")

    def _failed(self, index: int, problem: str) -> CacheDamagedError:
        """The error for a damaged row, after marking the cache damaged so that the next open rebuilds it."""
        start = self.data_offset + index * self.row_bytes
        return mark_damaged(
            _damaged(self.directory, DATA_FILE, f"{problem} (bytes {start:,}-{start + self.row_bytes:,})", index)
        )
