"""litdata streaming datasets: the supported versions, a checked directory, and our datasets written in its format.

litdata (`pip install 'lightning-speedkit[streaming]'`) writes a dataset as chunks with ``optimize`` and streams
them to every rank of every node with ``StreamingDataset`` / ``StreamingDataLoader``. On one machine our
`~lightning_speedkit.data.CachedDataset` reads a sample faster (microseconds against about a millisecond; whole fits
in ``benchmarks/results/streaming.json``); litdata is the tool for data beyond one machine. `write_streaming` moves
a dataset (or a CachedDataset) to litdata's format, and `streaming_dataset` opens one after checking the directory
and the installed version.

Nothing here imports litdata until it is used: without it the pack imports and works as before.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import sys
import uuid
from pathlib import Path
from types import ModuleType
from typing import Any

from packaging.version import InvalidVersion, Version

__all__ = [
    "LITDATA_RANGE",
    "StreamingFormatError",
    "check_litdata_version",
    "check_streaming_dir",
    "is_streaming_loader",
    "put_streaming_position",
    "require_litdata",
    "streaming_dataset",
    "streaming_position",
    "write_streaming",
]

LITDATA_MIN, LITDATA_BELOW = "0.2.70", "0.3"
LITDATA_RANGE = f">={LITDATA_MIN},<{LITDATA_BELOW}"
"""The litdata versions the pack supports (tested on 0.2.76): its loader state and ``optimize`` as used here."""


class StreamingFormatError(ValueError):
    """A directory that is not a litdata dataset (missing, not a directory, no ``index.json`` or no chunks)."""


def check_litdata_version(version: str) -> str:
    """``version`` when the pack supports it, else a ValueError naming it and `LITDATA_RANGE`.

    Example:
        >>> check_litdata_version("0.2.76")
        '0.2.76'
        >>> check_litdata_version("0.1.0")
        Traceback (most recent call last):
        ...
        ValueError: litdata 0.1.0 is not supported: lightning_speedkit needs litdata>=0.2.70,<0.3 (pip install 'litdata>=0.2.70,<0.3').
    """  # noqa: E501
    try:
        parsed = Version(version)
    except InvalidVersion:
        parsed = None
    if parsed is None or not Version(LITDATA_MIN) <= parsed < Version(LITDATA_BELOW):
        raise ValueError(
            f"litdata {version} is not supported: lightning_speedkit needs litdata{LITDATA_RANGE}"
            f" (pip install 'litdata{LITDATA_RANGE}')."
        )
    return version


def require_litdata() -> ModuleType:
    """The ``litdata`` module, once its version is checked (`check_litdata_version`).

    Raises:
        ImportError: Without litdata, naming the extra that installs it.
        ValueError: For a litdata version outside `LITDATA_RANGE`.
    """
    try:
        import litdata  # type: ignore[import-untyped]
    except ImportError as error:
        raise ImportError(
            "litdata is not installed: pip install 'lightning-speedkit[streaming]' (or 'litdata"
            f"{LITDATA_RANGE}') to stream datasets."
        ) from error
    check_litdata_version(str(getattr(litdata, "__version__", "unknown")))
    module: ModuleType = litdata
    return module


def check_streaming_dir(path: str | os.PathLike[str]) -> Path:
    """``path`` as a Path when it holds a litdata dataset (an ``index.json`` listing chunks), else an error naming it.

    Raises:
        StreamingFormatError: For a path that does not exist, is not a directory, or is not litdata's format.

    Example:
        >>> import tempfile
        >>> check_streaming_dir(tempfile.mkdtemp())  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        lightning_speedkit.data.streaming.StreamingFormatError: ... is not a litdata dataset: it has no index.json ...
    """
    directory = Path(path)
    shown = repr(str(directory))
    if not directory.exists():
        raise StreamingFormatError(f"the streaming dataset directory {shown} does not exist.")
    if not directory.is_dir():
        raise StreamingFormatError(f"the streaming dataset path {shown} is not a directory.")
    index = directory / "index.json"
    if not index.is_file():
        raise StreamingFormatError(
            f"{shown} is not a litdata dataset: it has no index.json (write one with"
            " lightning_speedkit.data.write_streaming or litdata.optimize)."
        )
    try:
        chunks = json.loads(index.read_text()).get("chunks")
    except (OSError, ValueError, AttributeError) as error:
        raise StreamingFormatError(f"{shown} is not a litdata dataset: index.json unreadable ({error}).") from None
    if not isinstance(chunks, list) or not chunks:
        raise StreamingFormatError(f"{shown} is not a litdata dataset: its index.json lists no chunks.")
    missing = [c.get("filename") for c in chunks if not (directory / str(c.get("filename"))).is_file()]
    if missing:
        raise StreamingFormatError(f"{shown} is a damaged litdata dataset: chunk {missing[0]!r} is missing.")
    return directory


def streaming_dataset(path: str | os.PathLike[str], **kwargs: Any) -> Any:
    """A litdata ``StreamingDataset`` over the local directory ``path``, checked first; ``kwargs`` go to it.

    Raises:
        StreamingFormatError: See `check_streaming_dir`.
        ImportError, ValueError: See `require_litdata`.
    """
    litdata = require_litdata()
    directory = check_streaming_dir(path)
    return litdata.StreamingDataset(str(directory), **kwargs)


def is_streaming_loader(loader: object) -> bool:
    """Whether ``loader`` is a litdata ``StreamingDataLoader`` (False whenever litdata was never imported).

    Example:
        >>> from torch.utils.data import DataLoader
        >>> is_streaming_loader(DataLoader(range(4)))
        False
    """
    module = sys.modules.get("litdata")
    return module is not None and isinstance(loader, module.StreamingDataLoader)


STREAMING_POSITION = (
    "current_epoch",
    "restore",
    "_latest_worker_idx",
    "_num_samples_yielded_streaming",
    "_num_samples_yielded_wrapper",
    "_num_cycles",
)
"""What a litdata ``StreamingDataLoader`` keeps of its place in its epochs (0.2.70-0.2.x): iterating it moves them."""


def streaming_position(loader: object) -> dict[str, Any]:
    """Copies of a litdata ``StreamingDataLoader``'s place in its epochs (`STREAMING_POSITION`); {} for another loader.

    Example:
        >>> from torch.utils.data import DataLoader
        >>> streaming_position(DataLoader(range(4)))
        {}
    """
    if not is_streaming_loader(loader):
        return {}
    return {name: copy.deepcopy(getattr(loader, name)) for name in STREAMING_POSITION if hasattr(loader, name)}


def put_streaming_position(loader: object, position: dict[str, Any]) -> None:
    """Put back what `streaming_position` copied (copies again: the same position may be put back twice)."""
    for name, value in position.items():
        setattr(loader, name, copy.deepcopy(value))


class _Sample:
    """``optimize``'s function: index -> the dataset's sample (picklable, so spawned workers get it)."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __call__(self, index: int) -> Any:
        return self.dataset[index]


def write_streaming(
    dataset: Any,
    output_dir: str | os.PathLike[str],
    chunk_bytes: str | int = "64MB",
    num_workers: int = 1,
    overwrite: bool = False,
    start_method: str | None = None,
) -> Path:
    """Write a map-style dataset (or a `~lightning_speedkit.data.CachedDataset`) to litdata's format with ``optimize``.

    Samples are written in index order. For a CachedDataset the packed rows are written without its ``transform``
    (decoded, pre-augmentation samples, as the cache holds them): give the transform to the ``StreamingDataset``
    instead. The directory appears whole or not at all: ``optimize`` writes into a staging directory beside it, which
    is checked and then renamed.

    Args:
        dataset: Anything with ``__len__`` and ``__getitem__``; its samples are what litdata can serialise (numbers,
            strings, numpy arrays, tensors, PIL images, and tuples, lists or dicts of them). It is pickled to
            ``optimize``'s worker processes.
        output_dir: The dataset directory to write (a local path).
        chunk_bytes: Size of each chunk (``"64MB"``, or bytes): the unit a node downloads and caches.
        num_workers: ``optimize``'s worker processes.
        overwrite: Replace an existing ``output_dir``; else an existing one is an error.
        start_method: How ``optimize`` starts its workers (``"fork"`` starts in milliseconds where the platform
            allows it; None: litdata's default, ``"spawn"``, which imports torch again in each worker).

    Raises:
        ValueError: For an empty dataset, ``num_workers`` < 1, or an existing ``output_dir`` without ``overwrite``.
        StreamingFormatError: If ``optimize`` wrote no chunks (a sample it could not serialise).
    """
    litdata = require_litdata()
    if not hasattr(dataset, "__len__") or not hasattr(dataset, "__getitem__") or len(dataset) == 0:
        raise ValueError(f"`dataset` must be a non-empty map-style dataset, got {type(dataset).__name__}.")
    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
        raise ValueError(f"`num_workers` must be an int >= 1, got {num_workers!r}.")
    target = Path(output_dir).absolute()
    if target.exists() and not overwrite:
        raise ValueError(f"`output_dir` {str(target)!r} already exists; pass overwrite=True to replace it.")
    source = _untransformed(dataset)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.parent / f".{target.name}.staging-{uuid.uuid4().hex[:8]}"
    try:
        litdata.optimize(
            fn=_Sample(source),
            inputs=list(range(len(source))),
            output_dir=str(staging),
            chunk_bytes=chunk_bytes,
            num_workers=num_workers,
            verbose=False,
            start_method=start_method,
        )
        try:
            check_streaming_dir(staging)
        except StreamingFormatError as error:
            raise StreamingFormatError(
                f"optimize wrote no usable dataset for {str(target)!r} (a sample it cannot serialise, or a worker"
                f" that failed: its traceback is above): {error}"
            ) from error
        if target.exists() and overwrite:
            shutil.rmtree(target)
        try:
            os.replace(staging, target)
        except OSError:  # another process wrote it meanwhile: theirs stands when it is whole
            check_streaming_dir(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _untransformed(dataset: Any) -> Any:
    """A CachedDataset's rows without its transform (a shallow copy); any other dataset as it is."""
    from lightning_speedkit.data.cache import CachedDataset

    if isinstance(dataset, CachedDataset) and dataset.transform is not None:
        import copy

        plain = copy.copy(dataset)
        plain.transform = None
        return plain
    return dataset


_SHARDING = ("litdata", "datasets", "webdataset", "torchdata")
"""Libraries whose iterable datasets split themselves among a loader's workers."""


def unsharded_iterable(dataset: Any) -> bool:
    """An ``IterableDataset`` that, as far as its type tells, does not split itself among workers (no library's).

    With ``num_workers=2`` each worker would yield every sample of it: the epoch trains on the data twice.

    Example:
        >>> from torch.utils.data import IterableDataset
        >>> class Stream(IterableDataset):
        ...     def __iter__(self): return iter(range(4))
        >>> unsharded_iterable(Stream()), unsharded_iterable([1, 2])
        (True, False)
    """
    from torch.utils.data import IterableDataset

    return isinstance(dataset, IterableDataset) and not type(dataset).__module__.startswith(_SHARDING)
