"""Where `Int8Export` finds what it exports: the module's weights (best checkpoint), validation data, metrics."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.model_helpers import is_overridden

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from torch import nn
    from torchmetrics import Metric

__all__ = ["best_checkpoint", "first_line", "metrics_of", "module_to_export", "validation_loader"]


def module_to_export(
    trainer: pl.Trainer, pl_module: pl.LightningModule, use_best_checkpoint: bool = True
) -> tuple[nn.Module, str]:
    """A CPU FP32 copy of the module with the best checkpoint's weights, and where those weights came from.

    A best checkpoint that does not fit the module (saved before pruning) gives a fresh copy of the final weights:
    ``load_state_dict`` copies the tensors whose shapes match before it raises, so the copy it failed on is a mix.
    """
    module = _cpu_copy(trainer, pl_module)
    best = best_checkpoint(trainer) if use_best_checkpoint else None
    if best is None:
        return module, "final weights"
    try:
        state = torch.load(best, map_location="cpu", weights_only=True)["state_dict"]
    except Exception as error:  # e.g. a type that weights_only refuses
        rank_zero_warn(
            f"Int8Export: cannot read the weights of the best checkpoint {best} with weights_only=True,"
            f" exporting the final weights instead: {type(error).__name__}: {first_line(error)}"
        )
        return module, "final weights"
    try:
        module.load_state_dict(state)
    except RuntimeError as error:
        rank_zero_warn(
            f"Int8Export: the best checkpoint {best} does not fit the module any more (saved before pruning?),"
            f" exporting the final weights instead: {first_line(error)}"
        )
        return _cpu_copy(trainer, pl_module), "final weights"  # not the half-loaded copy
    return module, f"best checkpoint {best}"


def _cpu_copy(trainer: pl.Trainer, pl_module: pl.LightningModule) -> nn.Module:
    """A CPU FP32 deep copy of ``pl_module`` sharing (not copying) the trainer, callbacks, loggers and datamodule."""
    callbacks, datamodule = getattr(trainer, "callbacks", []), getattr(trainer, "datamodule", None)
    keep = [trainer, trainer.strategy, *callbacks, *trainer.loggers, datamodule]
    memo: dict[int, Any] = {id(o): o for o in keep if o is not None}  # hooks may point at them: share, not copy
    return copy.deepcopy(pl_module, memo).to("cpu", torch.float32)


def best_checkpoint(trainer: pl.Trainer) -> str | None:
    """The best checkpoint of the first ``ModelCheckpoint`` that monitors a metric and has one on disk, or None."""
    for callback in trainer.checkpoint_callbacks:
        if not isinstance(callback, ModelCheckpoint) or callback.monitor is None:
            continue
        if callback.best_model_path and Path(callback.best_model_path).is_file():
            return callback.best_model_path
    return None


def first_line(error: BaseException) -> str:
    """The first line of an error, or its first ``size mismatch`` line (``load_state_dict`` puts those second)."""
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    return next((line for line in lines if line.startswith("size mismatch")), lines[0] if lines else "")


def metrics_of(module: nn.Module) -> dict[str, Metric]:
    """The torchmetrics ``Metric`` submodules of ``module`` by name."""
    from torchmetrics import Metric

    return {name: m for name, m in module.named_modules() if name and isinstance(m, Metric)}


def validation_loader(trainer: pl.Trainer, pl_module: pl.LightningModule) -> Any:
    """The full (unsharded) validation loader: the datamodule's or the module's, else the Trainer's first."""
    loaders: Any = None
    datamodule = getattr(trainer, "datamodule", None)
    if datamodule is not None and is_overridden("val_dataloader", datamodule):
        loaders = datamodule.val_dataloader()
    elif is_overridden("val_dataloader", pl_module):
        loaders = pl_module.val_dataloader()
    else:
        loaders = trainer.val_dataloaders
    if isinstance(loaders, dict):
        loaders = next(iter(loaders.values()), None)
    if isinstance(loaders, (list, tuple)):
        loaders = loaders[0] if loaders else None
    if loaders is None:
        raise RuntimeError(
            "Int8Export: there is no validation data to calibrate and verify on; define `val_dataloader` in the"
            " LightningModule or DataModule, or pass `val_dataloaders` to `fit`."
        )
    return loaders
