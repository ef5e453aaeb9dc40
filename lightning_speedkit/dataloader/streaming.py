"""A litdata StreamingDataLoader rebuilt with other settings, its state kept; what the tuner tries on one, and what not.

A ``StreamingDataLoader`` streams a ``StreamingDataset`` (an IterableDataset that shards itself by rank and worker,
so workers are safe) and keeps a resumable state (samples yielded by each worker, the epoch). `rebuild_streaming`
builds a new one over the same dataset with other workers and prefetch (and, for a dataset streamed from a remote
URL, another ``max_pre_download``), and loads the old one's state into it, so a loader rebuilt mid-epoch goes on
where the old one stopped. `streaming_candidates` and `untuned_settings` say what `DataLoaderTuner` tries, and
which of litdata's settings it leaves alone, and why.
"""

from __future__ import annotations

import copy
import math
from typing import Any

from torch.utils.data import DataLoader

from lightning_speedkit.dataloader.rebuild import NotRebuildableError, complete_settings

__all__ = ["STREAMING_EXTRA", "rebuild_streaming", "streaming_candidates", "streaming_settings", "untuned_settings"]

STREAMING_EXTRA = ("max_pre_download",)
"""Dataset settings a streaming candidate may also set (chunks downloaded ahead; only with a remote input)."""


def streaming_settings(loader: Any) -> dict[str, Any]:
    """The settings a StreamingDataLoader was built with: the four loader ones, and the dataset's pre-download."""
    workers = int(loader.num_workers)
    settings = complete_settings(workers, bool(loader.persistent_workers), loader.prefetch_factor, loader.pin_memory)
    if _remote(loader.dataset):
        settings["max_pre_download"] = int(getattr(loader.dataset, "max_pre_download", 2))
    return settings


def streaming_candidates(max_workers: int, baseline: dict[str, Any]) -> list[dict[str, Any]]:
    """What to try on a streaming loader: workers 0, 1, 2, 4... up to ``max_workers``; prefetch 2 and 4 at the most.

    Workers are not persistent (litdata sets each epoch's shuffle and resume point when the iterator starts); with a
    remote input each worker count is also tried with twice the baseline's ``max_pre_download``.

    Example:
        >>> [(c["num_workers"], c["prefetch_factor"]) for c in streaming_candidates(2, complete_settings(0))]
        [(0, None), (1, 2), (2, 2), (2, 4)]
    """
    if max_workers < 0:
        raise ValueError(f"`max_workers` must be >= 0, got {max_workers}.")
    counts = sorted({0, max_workers, *(2**k for k in range(max_workers.bit_length()) if 2**k < max_workers)})
    pin = bool(baseline.get("pin_memory", False))
    wanted = [complete_settings(w, persistent_workers=False, pin_memory=pin) for w in counts]
    if max_workers > 0:
        wanted.append(complete_settings(max_workers, persistent_workers=False, prefetch_factor=4, pin_memory=pin))
    if "max_pre_download" in baseline:
        more = 2 * int(baseline["max_pre_download"])
        wanted = [{**c, "max_pre_download": int(baseline["max_pre_download"])} for c in wanted]
        wanted += [{**c, "max_pre_download": more} for c in wanted if c["num_workers"] > 0]
    return wanted


def untuned_settings(loader: Any) -> list[str]:
    """The litdata settings the tuner leaves alone on ``loader``, each with why (one line each)."""
    notes = [
        "chunk size: fixed when the dataset was written; rewrite it with write_streaming(chunk_bytes=...) to change it",
        "max_cache_size: a bound on local disk use the user chose; not traded for speed",
    ]
    if not _remote(loader.dataset):
        notes.append("max_pre_download: the dataset is read from a local directory, nothing is downloaded")
    return notes


def rebuild_streaming(loader: Any, settings: dict[str, Any]) -> DataLoader[Any]:
    """A StreamingDataLoader like ``loader`` (dataset, batch size, collate_fn, shuffle...) with other settings.

    The dataset is a shallow copy (a StreamingDataLoader writes its worker count into its dataset, and the user's
    loader must keep its own), with ``max_pre_download`` when the settings give one. The loader's state
    (its epoch and, mid-epoch, the samples each worker yielded) is loaded into the new one, so nothing is seen twice
    or skipped.

    Raises:
        NotRebuildableError: When the new loader cannot take the old one's state (it is never dropped silently).
    """
    dataset = copy.copy(loader.dataset)  # the loader sets its worker count on the dataset: the user's keeps its own
    if settings.get("max_pre_download") is not None:
        dataset.max_pre_download = int(settings["max_pre_download"])
    workers = int(settings.get("num_workers", loader.num_workers))
    kwargs: dict[str, Any] = {
        "batch_size": loader.batch_size,
        "num_workers": workers,
        "collate_fn": getattr(loader.collate_fn, "collate_fn", None),  # the user's, inside litdata's wrapper
        "pin_memory": bool(settings.get("pin_memory", loader.pin_memory)),
        "timeout": loader.timeout,
        "worker_init_fn": loader.worker_init_fn,
        "multiprocessing_context": loader.multiprocessing_context,
        "generator": loader.generator,
        "drop_last": getattr(dataset, "drop_last", None),
    }
    if workers > 0:
        kwargs["persistent_workers"] = bool(settings.get("persistent_workers", False))
        kwargs["prefetch_factor"] = settings.get("prefetch_factor") or 2
    new: DataLoader[Any] = type(loader)(dataset, **kwargs)
    new.current_epoch = loader.current_epoch  # type: ignore[attr-defined]
    yielded = getattr(loader, "_num_samples_yielded_streaming", 0)  # litdata counts a partial last batch whole
    if loader.restore or 0 < yielded < _length(loader.dataset):  # mid-epoch; a finished epoch has no place to carry
        try:
            new.load_state_dict(loader.state_dict())  # type: ignore[attr-defined]
        except Exception as error:
            raise NotRebuildableError(
                f"the StreamingDataLoader's state cannot move to a loader with {workers} workers ({error})"
            ) from error
    return new


def _remote(dataset: Any) -> bool:
    """Whether a StreamingDataset streams from a URL (s3://, gs://...) rather than a local directory."""
    return getattr(getattr(dataset, "input_dir", None), "url", None) is not None


def _length(dataset: Any) -> float:
    """The dataset's length, or infinity when it has none."""
    try:
        return len(dataset)
    except TypeError:
        return math.inf
