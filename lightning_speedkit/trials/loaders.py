"""The run's train loaders as a trial session finds them: their generators, and their workers kept out of the trials.

A trial builds its loaders through the fit loop's own ``setup_data``, from the same source as the run. When that
source hands out the same ``DataLoader`` object every time (``fit(train_dataloaders=loader)``), the trials and the
run share it: its ``generator`` (``DataLoader(generator=...)``, the shuffle's and the workers' seeds), and with
``persistent_workers=True`` its worker pool, which a trial's clean-up shuts down. These helpers find the run's
loaders, built or not, so the session can put their generators back and keep their worker pools out of the trials.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.trainer.connectors.data_connector import _request_dataloader
from lightning.pytorch.utilities.combined_loader import CombinedLoader, _shutdown_workers_and_reset_iterator

if TYPE_CHECKING:
    import lightning.pytorch as pl

log = logging.getLogger(__name__)

__all__ = ["loader_generators", "put_back_iterators", "run_loaders", "set_aside_iterators"]


def run_loaders(trainer: pl.Trainer) -> list[Any]:
    """The run's train loaders: the fit loop's, or, before it has built them, what its source hands out.

    Asking the source calls the ``train_dataloader`` hook once more (Lightning calls it at every build) and iterates
    nothing. A source that cannot give its loaders yet gives none here.
    """
    fit_loop = trainer.fit_loop
    if fit_loop._combined_loader is not None:
        return list(fit_loop._combined_loader.flattened)
    if not fit_loop._data_source.is_defined():
        return []
    try:
        loaders = _request_dataloader(fit_loop._data_source)
    except Exception as exc:  # the session only looks for generators here; the trials build the loaders themselves
        log.debug("the train loaders could not be requested before the trials: %s", exc)
        return []
    combined = loaders if isinstance(loaders, CombinedLoader) else CombinedLoader(loaders, "max_size_cycle")
    return list(combined.flattened)


def loader_generators(loaders: list[Any]) -> list[torch.Generator]:
    """The ``torch.Generator`` objects the loaders, their samplers and batch samplers draw from, each once.

    Example:
        >>> from torch.utils.data import DataLoader
        >>> g = torch.Generator().manual_seed(0)
        >>> loader = DataLoader(list(range(8)), shuffle=True, generator=g)
        >>> [found is g for found in loader_generators([loader, loader])]
        [True]
    """
    found: list[torch.Generator] = []
    for dataloader in loaders:
        for owner in (dataloader, getattr(dataloader, "sampler", None), getattr(dataloader, "batch_sampler", None)):
            generator = getattr(owner, "generator", None)
            if isinstance(generator, torch.Generator) and all(generator is not g for g in found):
                found.append(generator)
    return found


def set_aside_iterators(loaders: list[Any]) -> list[tuple[Any, Any]]:
    """Take each loader's kept iterator (a persistent worker pool, or None) out of it, for `put_back_iterators`.

    A trial's ``iter(loader)`` then starts its own pool, and the trial's clean-up shuts that one down, not the run's:
    a pool the run had already started (its loader built before the trials) would otherwise be handed back shut,
    and the run's first epoch would end before its first batch.

    Example:
        >>> from torch.utils.data import DataLoader
        >>> loader = DataLoader(list(range(8)))
        >>> loader._iterator = "the run's pool"
        >>> kept = set_aside_iterators([loader])
        >>> loader._iterator, kept == [(loader, "the run's pool")]
        (None, True)
        >>> loader._iterator = None  # a trial's pool, shut down by its clean-up
        >>> put_back_iterators(kept)
        >>> loader._iterator
        "the run's pool"
    """
    kept = [(dataloader, dataloader._iterator) for dataloader in loaders if hasattr(dataloader, "_iterator")]
    for dataloader, _ in kept:
        dataloader._iterator = None
    return kept


def put_back_iterators(kept: list[tuple[Any, Any]]) -> None:
    """Give each loader back the iterator `set_aside_iterators` took; a trial's pool still held is shut down first."""
    for dataloader, iterator in kept:
        if dataloader._iterator is not iterator:
            _shutdown_workers_and_reset_iterator(dataloader)
        dataloader._iterator = iterator
