"""The same batches for every trial of a session, fetched once: `fetch_batches` and `replaying`.

Trials that compare what the steps do with the batches (LRs, a cool-down) rather than how fast the batches come
(loader settings) need the same batches in every trial, which `TrialSession` already gives by rebuilding the loader
from the same RNG state. Rebuilding it also pays its cost again: a sample-by-sample fetch (a third of a small MLP's
step), a worker pool's start-up. Fetched once and replayed, every trial after the first trains on copies of the
batches kept in memory, and none of them waits for data.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from lightning.fabric.utilities.data import _set_sampler_epoch
from lightning.fabric.utilities.seed import _collect_rng_states
from lightning.pytorch.trainer.connectors.data_connector import _DataLoaderSource
from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["REPLAY_BYTES", "Replay", "batch_bytes", "fetch_batches", "replaying"]

REPLAY_BYTES = 1 << 30
"""The most a session keeps in memory to replay its batches (1 GiB); longer trials of larger batches fetch as usual."""


def batch_bytes(batch: Any) -> int:
    """The bytes of the tensors in a batch (any collection Lightning moves to a device).

    Example:
        >>> import torch
        >>> batch_bytes({"x": torch.zeros(4, 8), "y": [torch.zeros(4, dtype=torch.long), "label"]})
        160
    """
    sizes: list[int] = []
    apply_to_collection(batch, Tensor, lambda t: sizes.append(t.numel() * t.element_size()))
    return sum(sizes)


class Replay:
    """An iterable over kept batches that yields a copy of each, its tensors cloned.

    A step that changes its batch in place (a user's in-place normalisation) cannot change the next trial's.

    Example:
        >>> import torch
        >>> kept = [torch.zeros(2), torch.ones(2)]
        >>> replay = Replay(kept)
        >>> first = next(iter(replay))
        >>> _ = first.add_(5)
        >>> len(replay), [b.tolist() for b in replay]
        (2, [[0.0, 0.0], [1.0, 1.0]])
    """

    def __init__(self, batches: Sequence[Any]) -> None:
        self.batches = list(batches)

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[Any]:
        for batch in self.batches:
            yield apply_to_collection(batch, Tensor, Tensor.clone)


def fetch_batches(
    trainer: pl.Trainer, count: int, limit_bytes: int | None = None
) -> tuple[list[Any], dict[str, Any]] | None:
    """The first ``count`` training batches of this epoch, and the RNG streams the loop's first step would find.

    The batches are fetched as the fit loop would (its loader, the sampler's epoch); the RNG streams are taken once
    the sampler has drawn its seed and the first batch is fetched: replayed from there, the steps draw what they
    would draw beside a loader that draws nothing per sample (their dropout masks), so the trials' losses are those
    of trials that fetch their own batches. None when the loader has fewer batches, they would take more than
    ``limit_bytes`` (`REPLAY_BYTES` if None; judged by the first), a batch holds no tensor to copy (a custom batch
    class: a step could change it in place), or ``training_step`` takes the loader's iterator (``dataloader_iter``).
    The caller sets ``trainer.limit_train_batches`` to ``count`` and the RNG streams as the trials will start from,
    and puts them back afterwards; the loader built here is torn down (its workers stopped) before this returns.
    """
    most = REPLAY_BYTES if limit_bytes is None else limit_bytes
    if is_param_in_hook_signature(trainer.lightning_module.training_step, "dataloader_iter", explicit=True):
        return None  # the step fetches for itself (Lightning's own test, `_select_data_fetcher`): no loader built
    fit_loop = trainer.fit_loop
    fit_loop._combined_loader = None
    fit_loop.setup_data()
    loader, fetcher = fit_loop._combined_loader, fit_loop._data_fetcher
    if loader is None or fetcher is None:
        return None
    batches: list[Any] = []
    rng: dict[str, Any] = {}
    try:
        for dataloader in loader.flattened:  # after `setup_data`'s `iter`, as the loop does; a trial's loop, loaded
            _set_sampler_epoch(dataloader, fit_loop.epoch_progress.current.processed)  # from state, iterates no more
        for _ in range(count):
            batch, _index, _loader_index = next(fetcher)
            if not batches:  # a sampler draws its seed at the first batch, not at `iter`
                size = batch_bytes(batch)
                if size * count > most or (size == 0 and batch is not None):  # no tensor to copy: kept as it comes
                    return None
                rng = _collect_rng_states(include_cuda=torch.cuda.is_available())
            batches.append(batch)
    except StopIteration:
        return None
    finally:
        fetcher.teardown()
        fit_loop._combined_loader, fit_loop._data_fetcher = None, None
    return batches, rng


@contextmanager
def replaying(trainer: pl.Trainer, batches: Sequence[Any]) -> Iterator[None]:
    """Within the block, the fit loop's train loader is `Replay` over ``batches`` (rebuilt at its next use)."""
    fit_loop = trainer.fit_loop
    source = fit_loop._data_source
    fit_loop._data_source = _DataLoaderSource(Replay(batches), "train_dataloader")
    try:
        yield
    finally:
        fit_loop._data_source = source
