"""Data helpers: a packed cache of decoded samples checked on every read, litdata streaming, batched tensor fetches."""

from lightning_speedkit.data.batched import BatchedTensors, batched_view, fetches_at_once
from lightning_speedkit.data.cache import CacheBudgetError, CachedDataset
from lightning_speedkit.data.fingerprint import callable_fingerprint, dataset_fingerprint
from lightning_speedkit.data.packed import CacheDamagedError
from lightning_speedkit.data.streaming import StreamingFormatError, streaming_dataset, write_streaming

__all__ = [
    "BatchedTensors",
    "CacheBudgetError",
    "CacheDamagedError",
    "CachedDataset",
    "StreamingFormatError",
    "batched_view",
    "callable_fingerprint",
    "dataset_fingerprint",
    "fetches_at_once",
    "streaming_dataset",
    "write_streaming",
]
