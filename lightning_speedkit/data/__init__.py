"""Data helpers: a packed cache of decoded samples, checked on every read."""

from lightning_speedkit.data.cache import CacheBudgetError, CachedDataset
from lightning_speedkit.data.fingerprint import callable_fingerprint, dataset_fingerprint
from lightning_speedkit.data.packed import CacheDamagedError

__all__ = ["CacheBudgetError", "CacheDamagedError", "CachedDataset", "callable_fingerprint", "dataset_fingerprint"]
