"""Rebuild a DataLoader with other worker settings, keeping what it yields; the settings as a trial setting."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, Sampler, default_collate
from typing_extensions import override

from lightning_speedkit.data.batched import BatchedTensors, batched_view, collated, fetches_at_once
from lightning_speedkit.data.streaming import is_streaming_loader
from lightning_speedkit.trials import Setting
from lightning_speedkit.trials.job import BUILT_FROM

__all__ = [
    "BATCHED",
    "SETTINGS",
    "LoaderSettings",
    "NotRebuildableError",
    "Owner",
    "complete_settings",
    "default_candidates",
    "loader_settings",
    "rebuild_dataloader",
    "settings_name",
    "slower_workers",
    "valid_candidate",
]

SETTINGS = ("num_workers", "persistent_workers", "prefetch_factor", "pin_memory")
"""The loader settings a candidate may set, in the order reports name them."""
BATCHED = "batched_fetch"
"""One more setting, named after the four when set: each batch fetched by one indexing call a tensor
(`lightning_speedkit.data.batched`), for a ``TensorDataset`` collated by ``default_collate`` only."""
Owner = pl.LightningModule | pl.LightningDataModule
"""What builds the loaders: a LightningDataModule or LightningModule."""
_MISSING = object()


class NotRebuildableError(ValueError):
    """A DataLoader that cannot be rebuilt with other settings without changing what it yields."""


def complete_settings(
    num_workers: int,
    persistent_workers: bool | None = None,
    prefetch_factor: int | None = None,
    pin_memory: bool = False,
    batched_fetch: bool = False,
) -> dict[str, Any]:
    """All four loader settings; with workers, persistent ones and ``prefetch_factor=2`` unless given.

    ``batched_fetch`` adds `BATCHED` (only when true, so the four alone name a loader as built).

    Example:
        >>> complete_settings(2)
        {'num_workers': 2, 'persistent_workers': True, 'prefetch_factor': 2, 'pin_memory': False}
        >>> complete_settings(0, persistent_workers=True, prefetch_factor=4)
        {'num_workers': 0, 'persistent_workers': False, 'prefetch_factor': None, 'pin_memory': False}
        >>> complete_settings(0, batched_fetch=True)[BATCHED]
        True
    """
    workers = num_workers > 0
    return {
        "num_workers": num_workers,
        "persistent_workers": workers and (persistent_workers is None or bool(persistent_workers)),
        "prefetch_factor": (prefetch_factor or 2) if workers else None,
        "pin_memory": bool(pin_memory),
    } | ({BATCHED: True} if batched_fetch else {})


def loader_settings(loader: DataLoader[Any]) -> dict[str, Any]:
    """The four settings ``loader`` was built with.

    A loader rebuilt to fetch its batches at once (`BATCHED`) says so too.

    Example:
        >>> loader_settings(DataLoader(list(range(8)), num_workers=1))
        {'num_workers': 1, 'persistent_workers': False, 'prefetch_factor': 2, 'pin_memory': False}
    """
    batched = isinstance(loader.dataset, BatchedTensors)
    return complete_settings(
        loader.num_workers, loader.persistent_workers, loader.prefetch_factor, loader.pin_memory, batched
    )


def settings_name(settings: dict[str, Any]) -> str:
    """The label of a setting in reports (``decision``, ``step_s``).

    Example:
        >>> settings_name(complete_settings(0))
        'num_workers=0, persistent_workers=False, prefetch_factor=None, pin_memory=False'
    """
    names = (*SETTINGS, *sorted(k for k in settings if k not in SETTINGS))  # a streaming dataset's own, after
    return ", ".join(f"{name}={settings[name]}" for name in names)


def default_candidates(max_workers: int, pin_memory: bool = False, batched: bool = False) -> list[dict[str, Any]]:
    """Candidate settings: ``num_workers`` 0, 1, 2, 4, ... up to ``max_workers`` (always included).

    Workers are persistent (no start-up cost each epoch) with ``prefetch_factor=2``. With ``batched`` (the dataset
    is rows of in-memory tensors, fetched a batch at once: `lightning_speedkit.data.batched.fetches_at_once`), the
    candidates are no workers with and without `BATCHED` instead: a sample's whole cost is its fetch and stack, which
    the batched fetch takes away in the training process, where a worker would only move it to another process (and
    copy the batch back) at the price of its start-up and a core.

    Example:
        >>> [c["num_workers"] for c in default_candidates(6)]
        [0, 1, 2, 4, 6]
        >>> default_candidates(0)
        [{'num_workers': 0, 'persistent_workers': False, 'prefetch_factor': None, 'pin_memory': False}]
        >>> [(c["num_workers"], c.get(BATCHED, False)) for c in default_candidates(2, batched=True)]
        [(0, False), (0, True)]
    """
    if max_workers < 0:
        raise ValueError(f"`max_workers` must be >= 0, got {max_workers}.")
    if batched:
        return [complete_settings(0, pin_memory=pin_memory, batched_fetch=fetch) for fetch in (False, True)]
    counts = [0] + [2**k for k in range(max_workers.bit_length()) if 2**k < max_workers] + [max_workers]
    return [complete_settings(w, pin_memory=pin_memory) for w in sorted(set(counts))]


def rebuild_dataloader(
    loader: DataLoader[Any], settings: dict[str, Any], batch_sampler: Sampler[list[int]] | None = None
) -> DataLoader[Any]:
    """A new DataLoader like ``loader`` (dataset, sampler, batch size, collate_fn, ...) with other worker settings.

    With ``batch_sampler``, it serves those batches of indices instead of drawing its own (counted trials serve
    an epoch's batches, drawn once, through several loaders: `lightning_speedkit.dataloader.counted`). With
    ``settings[BATCHED]``, its dataset is served by `lightning_speedkit.data.batched.BatchedTensors` (the same
    batches, each fetched at once); a loader rebuilt so is rebuilt from the user's dataset and ``collate_fn``.

    A litdata ``StreamingDataLoader`` is rebuilt as one, its state kept
    (`lightning_speedkit.dataloader.streaming.rebuild_streaming`).

    Raises:
        NotRebuildableError: For a DataLoader subclass (its extra behaviour would be lost), an IterableDataset
            with workers (each worker would yield the whole dataset unless it shards itself), a StreamingDataLoader
            whose state cannot move to the new settings, or `BATCHED` for a dataset `batched_view` refuses.

    Example:
        >>> loader = DataLoader(list(range(10)), batch_size=4, shuffle=True, drop_last=True)
        >>> new = rebuild_dataloader(loader, {"num_workers": 2, "persistent_workers": True, "prefetch_factor": 4})
        >>> new.num_workers, new.batch_size, new.drop_last, new.sampler is loader.sampler
        (2, 4, True, True)
        >>> getattr(new, BUILT_FROM)["num_workers"], getattr(new, BUILT_FROM)["dataset"]  # the user's, for memory
        (0, 'list')
    """
    new = _rebuilt(loader, settings, batch_sampler)
    built_from = getattr(loader, BUILT_FROM, None) or {
        **loader_settings(loader),
        "dataset": type(loader.dataset).__name__,
    }
    setattr(new, BUILT_FROM, built_from)  # the user's settings and dataset type, for remembered decisions
    return new


def _rebuilt(
    loader: DataLoader[Any], settings: dict[str, Any], batch_sampler: Sampler[list[int]] | None
) -> DataLoader[Any]:
    if is_streaming_loader(loader) and batch_sampler is None:
        from lightning_speedkit.dataloader.streaming import rebuild_streaming

        return rebuild_streaming(loader, settings)
    if type(loader) is not DataLoader:
        raise NotRebuildableError(f"{type(loader).__name__} is a DataLoader subclass; rebuilding it would lose it.")
    dataset, collate_fn = loader.dataset, loader.collate_fn
    if isinstance(dataset, BatchedTensors) and collate_fn is collated:  # rebuilt before: from the user's own again
        dataset, collate_fn = dataset.source, default_collate
    if settings.get(BATCHED):
        view = batched_view(dataset, collate_fn)
        if view is None:
            raise NotRebuildableError(
                f"`{BATCHED}` needs a TensorDataset (or a Subset of one) collated by default_collate, got a"
                f" {type(dataset).__name__}{'' if collate_fn is default_collate else ' with its own collate_fn'}."
            )
        dataset, collate_fn = view, collated
    workers = int(settings.get("num_workers", loader.num_workers))
    if isinstance(dataset, IterableDataset) and workers > 0:
        raise NotRebuildableError(
            f"{type(dataset).__name__} is an IterableDataset: with workers each one would yield every sample"
            " unless the dataset shards itself by worker."
        )
    kwargs: dict[str, Any] = {
        "collate_fn": collate_fn,
        "timeout": loader.timeout,
        "worker_init_fn": loader.worker_init_fn,
        "multiprocessing_context": loader.multiprocessing_context,
        "generator": loader.generator,
        "pin_memory": bool(settings.get("pin_memory", loader.pin_memory)),
        "pin_memory_device": loader.pin_memory_device,
        "num_workers": workers,
    }
    if hasattr(loader, "in_order"):
        kwargs["in_order"] = loader.in_order
    if workers > 0:
        kwargs["persistent_workers"] = bool(settings.get("persistent_workers", loader.persistent_workers))
        kwargs["prefetch_factor"] = settings.get("prefetch_factor") or 2
    if batch_sampler is not None:
        return DataLoader(dataset, batch_sampler=batch_sampler, **kwargs)
    if isinstance(dataset, IterableDataset):
        return DataLoader(dataset, batch_size=loader.batch_size, drop_last=loader.drop_last, **kwargs)
    if loader.batch_size is not None and type(loader.batch_sampler) is BatchSampler:
        return DataLoader(
            dataset, batch_size=loader.batch_size, sampler=loader.sampler, drop_last=loader.drop_last, **kwargs
        )
    if loader.batch_sampler is None:  # `batch_size=None`: each item is already a batch, converted, not collated
        return DataLoader(dataset, batch_size=None, sampler=loader.sampler, **kwargs)
    return DataLoader(dataset, batch_sampler=loader.batch_sampler, **kwargs)


class LoaderSettings(Setting):
    """Loader settings as a trial `~lightning_speedkit.trials.Setting`: the owner's hooks return rebuilt loaders.

    `apply` patches the hooks of the LightningDataModule (or LightningModule) that builds the loaders, so each call
    returns the user's loader rebuilt with `rebuild_dataloader`; `revert` removes the patches. Only hooks the owner
    overrides are patched. A loader that cannot be rebuilt is returned as it is, and ``on_refused`` gets the reason;
    one whose samples are not rows of tensors (a validation loader beside a ``TensorDataset``'s train loader) is
    rebuilt with the settings but `BATCHED`.

    Args:
        owner: The LightningDataModule or LightningModule whose hooks build the loaders.
        settings: The four settings (see `complete_settings`).
        hooks: The hooks to patch; a trial needs only the train loader.
        on_refused: Called with the reason when a hook's loader cannot be rebuilt.
    """

    def __init__(
        self,
        owner: Owner,
        settings: dict[str, Any],
        hooks: Sequence[str] = ("train_dataloader",),
        on_refused: Callable[[str], None] | None = None,
    ) -> None:
        self.owner, self.settings, self.hooks, self.on_refused = owner, dict(settings), tuple(hooks), on_refused
        self.name = settings_name(self.settings)
        self._saved: dict[str, Any] = {}

    @override
    def apply(self, trainer: pl.Trainer) -> None:
        for hook in self.hooks:
            if hook in self._saved or not is_overridden(hook, self.owner):
                continue
            self._saved[hook] = vars(self.owner).get(hook, _MISSING)
            setattr(self.owner, hook, self._rebuilding(hook, getattr(self.owner, hook)))

    @override
    def revert(self, trainer: pl.Trainer) -> None:
        for hook, previous in self._saved.items():
            if previous is _MISSING:
                vars(self.owner).pop(hook, None)
            else:
                setattr(self.owner, hook, previous)
        self._saved = {}

    def rebuild(self, loader: Any, hook: str) -> Any:
        """``loader`` (one ``hook`` built) rebuilt with these settings; as it is when not a DataLoader or refused."""
        if not isinstance(loader, DataLoader):
            return loader
        settings = self.settings
        if settings.get(BATCHED) and not fetches_at_once(loader.dataset, loader.collate_fn):
            settings = {k: v for k, v in settings.items() if k != BATCHED}  # not rows of tensors: the rest only
        try:
            return rebuild_dataloader(loader, settings)
        except NotRebuildableError as error:
            if self.on_refused is not None:
                self.on_refused(f"{hook}: {error}")
            return loader

    def rebuild_in_place(self, trainer: pl.Trainer) -> None:
        """Rebuild the loaders the fit already holds, in place: the hooks are not called again.

        A hook called twice draws twice (a random subset, a generator the DataModule holds): the run would then train
        or validate on other samples than the run without the tuner, whose Lightning calls each hook once a fit. A
        litdata loader carries where its last pass stopped (a validation cut short would resume there): its loop
        builds it again from its (patched) hook, as Lightning would after a reload.
        """
        loop = trainer.fit_loop
        for held, hook in ((loop, "train_dataloader"), (loop.epoch_loop.val_loop, "val_dataloader")):
            combined = held._combined_loader
            if combined is None or hook not in self.hooks:
                continue
            if any(is_streaming_loader(loader) for loader in combined.flattened):
                held._combined_loader = None
            else:
                combined.flattened = [self.rebuild(loader, hook) for loader in combined.flattened]

    def _rebuilding(self, hook: str, original: Callable[[], Any]) -> Callable[[], Any]:
        def rebuilt() -> Any:
            return self.rebuild(original(), hook)

        return rebuilt


def valid_candidate(candidate: object) -> bool:
    """Whether ``candidate`` is a settings dict a `lightning_speedkit.DataLoaderTuner` takes.

    Example:
        >>> valid_candidate({"num_workers": 2, BATCHED: False}), valid_candidate({"num_workers": -1})
        (True, False)
    """
    if not isinstance(candidate, dict) or set(candidate) - {*SETTINGS, BATCHED} or "num_workers" not in candidate:
        return False
    workers, prefetch = candidate["num_workers"], candidate.get("prefetch_factor")
    return (
        isinstance(workers, int)
        and not isinstance(workers, bool)
        and workers >= 0
        and (prefetch is None or (isinstance(prefetch, int) and not isinstance(prefetch, bool) and prefetch >= 1))
        and all(isinstance(candidate.get(key, False), bool) for key in ("persistent_workers", "pin_memory", BATCHED))
    )


def slower_workers(extra: dict[str, Any]) -> str | None:
    """What more workers measured, when each setting tried with more was slower: ``"num_workers=1 26% slower"``.

    ``extra`` is a `lightning_speedkit.DataLoaderTuner` decision's; the fastest of those settings is named, against
    the loader kept. None when none was tried, one was faster, or the loader was rebuilt.

    Example:
        >>> kept = complete_settings(0)
        >>> tried = [{**complete_settings(1), "step_s": 0.026}, {**complete_settings(2), "step_s": 0.03}]
        >>> slower_workers({"rebuilt": False, "baseline": kept, "baseline_step_s": 0.02, "candidates": tried})
        'num_workers=1 30% slower'
    """
    base_s, kept = extra.get("baseline_step_s"), extra.get("baseline")
    if extra.get("rebuilt", True) or not base_s or not isinstance(kept, dict):
        return None
    more = [c for c in extra.get("candidates", []) if c.get("step_s") and c["num_workers"] > kept["num_workers"]]
    if not more:
        return None
    best = min(more, key=lambda c: float(c["step_s"]))
    slower = float(best["step_s"]) / float(base_s) - 1.0
    return f"num_workers={best['num_workers']} {slower:.0%} slower" if slower > 0 else None
