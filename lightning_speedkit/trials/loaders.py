"""The run's train loaders as a trial session finds them: their generators, and their workers kept out of the trials.

A trial builds its loaders through the fit loop's own ``setup_data``, from the same source as the run. When that
source hands out the same ``DataLoader`` object every time (``fit(train_dataloaders=loader)``), the trials and the
run share it: its ``generator`` (``DataLoader(generator=...)``, the shuffle's and the workers' seeds), and with
``persistent_workers=True`` its worker pool, which a trial's clean-up shuts down. These helpers find the run's
loaders, built or not, so the session can put their generators back and keep their worker pools out of the trials.

Before the fit builds its train loader (a lever deciding at fit start), reading it means building it: the user's
``train_dataloader`` hook runs. `peek_train_loader` builds it for one read, gives the fit its loader back unbuilt and
the global RNG untouched, and remembers the read per Trainer until what it depends on changes: ``preset()``'s
levers read the loader (the steps left, the fingerprint of a remembered decision) ten times at fit start, and each
read called the user's hook again.
"""

from __future__ import annotations

import contextlib
import logging
import random
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import torch
from lightning.pytorch.trainer.connectors.data_connector import _request_dataloader
from lightning.pytorch.utilities.combined_loader import CombinedLoader, _shutdown_workers_and_reset_iterator
from lightning.pytorch.utilities.parsing import lightning_getattr, lightning_hasattr
from lightning.pytorch.utilities.seed import isolate_rng

from lightning_speedkit.data.streaming import put_streaming_position, streaming_position
from lightning_speedkit.report import quiet_logger

if TYPE_CHECKING:
    import lightning.pytorch as pl

log = logging.getLogger(__name__)

__all__ = [
    "LIGHTNING_INFO",
    "forget_peeks",
    "generators_kept",
    "loader_generators",
    "peek_train_loader",
    "put_back_iterators",
    "run_loaders",
    "set_aside_iterators",
    "streaming_kept",
]

LIGHTNING_INFO = "lightning.pytorch.utilities.rank_zero"
"""Lightning's ``rank_zero_info`` logger: quiet (WARNING) during trials, whose every run would otherwise end with
"`Trainer.fit` stopped: `max_steps=4` reached." and "Loading `train_dataloader` to estimate ..." lines."""

_T = TypeVar("_T")
_PEEKS: weakref.WeakKeyDictionary[Any, tuple[Any, dict[tuple[Any, ...], Any]]] = weakref.WeakKeyDictionary()
"""Per Trainer: its data source (a weak reference) and what `peek_train_loader` read before the fit built the loader."""


def _peek_key(trainer: pl.Trainer) -> tuple[Any, ...]:
    """What a read of the unbuilt train loader depends on that a fit's start can change (beside the data source).

    The step and epoch, the budget, gradient accumulation, the devices, and an attribute named ``batch_size`` as
    Lightning's ``lightning_setattr`` finds it (the module, its ``hparams``, the datamodule); a lever that changes the
    loader otherwise (`lightning_speedkit.BatchSizeFinder` under another name, `lightning_speedkit.DataLoaderTuner`)
    calls `forget_peeks`.
    """
    module = trainer.lightning_module
    size = (
        lightning_getattr(module, "batch_size")
        if module is not None and lightning_hasattr(module, "batch_size")
        else None
    )
    try:
        hash(size)
    except TypeError:  # a dict or a list in the hparams: compared by its text
        size = repr(size)
    budget = (trainer.max_epochs, trainer.max_steps, trainer.limit_train_batches, trainer.accumulate_grad_batches)
    return (trainer.global_step, trainer.current_epoch, *budget, trainer.world_size, size)


def peek_train_loader(trainer: pl.Trainer, read: Callable[[pl.Trainer], _T]) -> _T:
    """``read(trainer)``, for which the fit's train loader may be built, with the fit left as if it never was.

    The read runs under ``isolate_rng`` (building the loader, or a sample's transform, draws from the global RNG).
    Before the fit loop has built its loader, a loader the read built is torn down again, so the fit builds its own
    exactly as without the read, and the value is kept for the next read of the same ``read`` with the same data
    source and `_peek_key`, until `forget_peeks` (every lever's ``setup``; a lever that changes the loader).
    """
    fit_loop = trainer.fit_loop
    if fit_loop._combined_loader is not None:  # built: read it as it is
        with isolate_rng(include_cuda=torch.cuda.is_available()), quiet_logger(LIGHTNING_INFO, logging.WARNING):
            return read(trainer)
    source = getattr(fit_loop._data_source, "instance", None)
    kept = _PEEKS.get(trainer)
    if kept is None or kept[0]() is not source:  # another source (a new fit's): nothing kept applies
        kept = (_weak(source), {})
        _PEEKS[trainer] = kept
    key = (read, *_peek_key(trainer))
    if key in kept[1]:
        return kept[1][key]  # type: ignore[no-any-return]
    try:
        rng, quiet = isolate_rng(include_cuda=torch.cuda.is_available()), quiet_logger(LIGHTNING_INFO, logging.WARNING)
        with rng, generators_kept(source), quiet:
            value = read(trainer)
    finally:
        if fit_loop._combined_loader is not None:
            if fit_loop._data_fetcher is not None:
                fit_loop._data_fetcher.teardown()
                fit_loop._data_fetcher = None
            fit_loop._combined_loader = None
    kept[1][key] = value
    return value


@contextlib.contextmanager
def generators_kept(source: Any) -> Iterator[None]:
    """Put back the generators ``source`` holds (its attributes, and those of its lists, tuples and dicts) on exit.

    A DataModule may hold one generator and hand it to every loader its hook builds, or draw its rows from it: a read
    of the hook draws from it, and the run would shuffle (or train on rows) other than the run without the read.
    ``isolate_rng`` keeps only the global generators; one the hook makes afresh needs nothing. Torch's, numpy's
    (``Generator``, ``RandomState``) and Python's ``random.Random`` are kept.
    """
    kept: list[tuple[Any, Callable[[Any, Any], None], Any]] = []  # (generator, how to put its state back, state)
    for item in _held(source):
        kind = next((k for k in _GENERATOR_STATE if isinstance(item, k)), None)
        if kind is None or any(item is g for g, _, _ in kept):
            continue
        read, put = _GENERATOR_STATE[kind]
        try:
            kept.append((item, put, read(item)))
        except NotImplementedError:  # `random.SystemRandom` has no state to keep
            continue
    try:
        yield
    finally:
        for generator, put, state in kept:
            put(generator, state)


def _held(source: Any) -> Iterator[Any]:
    """What ``source`` holds: its attributes, and the items of those that are lists, tuples and dicts."""
    for value in vars(source).values() if hasattr(source, "__dict__") else ():
        yield from value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else [value]


def streaming_kept(trainer: pl.Trainer) -> Callable[[], None]:
    """Copies of where the litdata loaders the run holds are in their epochs; the function returned puts them back.

    A litdata ``StreamingDataLoader`` keeps its epoch and the samples it yielded on itself, not in a sampler: when the
    data source holds the loader (loaders passed to ``fit``, a DataModule that builds it once), the trials iterate the
    run's own loader, and the run then began one shuffle epoch ahead, its first epoch short of the samples the trials
    drew. The loaders are found on the data source (itself, or what it holds) and in the fit loop's built loader.
    """
    fit_loop = trainer.fit_loop
    source = getattr(fit_loop._data_source, "instance", None)
    built = fit_loop._combined_loader.flattened if fit_loop._combined_loader is not None else []
    kept: list[tuple[Any, dict[str, Any]]] = []
    for loader in [source, *_held(source), *built]:
        if not any(loader is seen for seen, _ in kept) and (position := streaming_position(loader)):
            kept.append((loader, position))

    def put_back() -> None:
        for loader, position in kept:
            put_streaming_position(loader, position)

    return put_back


_GENERATOR_STATE: dict[type, tuple[Callable[[Any], Any], Callable[[Any, Any], None]]] = {
    torch.Generator: (lambda g: g.get_state(), lambda g, s: g.set_state(s)),
    np.random.Generator: (lambda g: g.bit_generator.state, lambda g, s: setattr(g.bit_generator, "state", s)),
    np.random.RandomState: (lambda g: g.get_state(), lambda g, s: g.set_state(s)),
    random.Random: (lambda g: g.getstate(), lambda g, s: g.setstate(s)),
}
"""How to read and put back the state of each kind of generator `generators_kept` keeps (subclasses too)."""


def _weak(source: Any) -> Callable[[], Any]:
    """A weak reference to ``source``, or a strong one where it takes none (None, a list of loaders)."""
    try:
        return weakref.ref(source)
    except TypeError:
        return lambda: source


def forget_peeks(trainer: pl.Trainer) -> None:
    """Forget what `peek_train_loader` read for ``trainer``: the next read builds the loader again."""
    _PEEKS.pop(trainer, None)


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
