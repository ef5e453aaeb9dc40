"""Data helpers: a packed, memory-mapped cache of decoded samples."""

from lightning_speedkit.data.cache import CacheBudgetError, CachedDataset, callable_fingerprint, dataset_fingerprint

__all__ = ["CacheBudgetError", "CachedDataset", "callable_fingerprint", "dataset_fingerprint"]
