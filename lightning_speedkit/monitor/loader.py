"""The train loader's settings as they are in use: a loader tuner rebuilds the loader after the fit started."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from lightning_speedkit.layout import is_channels_last
from lightning_speedkit.monitor.diagnosis import LoaderSettings

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["first_loader", "loader_in_use", "speedups_in_use"]


def loader_in_use(loader: LoaderSettings | None, trainer: pl.Trainer) -> LoaderSettings | None:
    """``loader`` (read at fit start) read again off the train loader in use, with what a tuner measured of workers.

    `lightning_speedkit.DataLoaderTuner` rebuilds the loader in its probe and after it; advice from the settings
    read at fit start told a run with 2 workers to try 2 workers. A tuner in ``trainer.callbacks`` (found by its
    ``workers_measured_slower`` method) adds what it measured of more workers, when they all lost; `speedups_in_use`
    what the model already runs with (it was advised torch.compile when compiled).
    """
    if loader is None:
        return None
    now = first_loader(trainer.train_dataloader)
    if now is not None:
        loader = LoaderSettings.from_loader(now, loader.cores, loader.ranks_per_node, loader.accelerator)
    loader = replace(loader, in_use=speedups_in_use(trainer))
    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        measured = getattr(callback, "workers_measured_slower", None)
        note = measured() if callable(measured) else None
        if note:
            return replace(loader, workers_measured_slower=note)
    return loader


def speedups_in_use(trainer: pl.Trainer) -> tuple[str, ...]:
    """What the compute-bound advice would name that the run already has: compiled, NHWC, bf16 or fp16 autocast."""
    module, used = trainer.lightning_module, []
    if module is not None and _compiled(module):
        used.append("torch.compile")
    if module is not None and is_channels_last(module):
        used.append("channels_last")
    if str(trainer.precision).startswith(("bf16", "16", "transformer-engine")):  # a half precision already
        used.append("bf16-mixed precision")
    return tuple(used)


def _compiled(module: pl.LightningModule) -> bool:
    """Compiled: by `lightning_speedkit.Compile` or ``module.compile``, as ``fit(torch.compile(model))``, or in part.

    Lightning keeps the ``torch.compile`` of a module passed to fit in ``_compiler_ctx``; a submodule compiled by the
    user (``self.net = torch.compile(net)``) is an ``OptimizedModule``.
    """
    if getattr(module, "_compiled_call_impl", None) is not None or getattr(module, "_compiler_ctx", None):
        return True
    return any(type(sub).__name__ == "OptimizedModule" for sub in module.modules())


def first_loader(loaders: Any) -> Any:
    """The first ``DataLoader`` in what ``trainer.train_dataloader`` holds (a loader, or a list/dict of them).

    Example:
        >>> from torch.utils.data import DataLoader
        >>> loader = DataLoader(range(4))
        >>> first_loader({"a": [None, loader]}) is loader, first_loader(None)
        (True, None)
    """
    if loaders is None or hasattr(loaders, "num_workers"):
        return loaders
    items = loaders.values() if isinstance(loaders, Mapping) else loaders if isinstance(loaders, (list, tuple)) else ()
    for item in items:
        found = first_loader(item)
        if found is not None:
            return found
    return None
