"""After a pruning step: new optimizers and schedulers for the new parameters, and the warmup restarted."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy

from lightning_speedkit.lr import warmups

if TYPE_CHECKING:
    import lightning.pytorch as pl

log = logging.getLogger(__name__)

__all__ = ["rebuild_optimizers", "restart_warmup"]


def rebuild_optimizers(trainer: pl.Trainer) -> None:
    """New optimizers and schedulers from ``configure_optimizers``, keeping the current LRs and scheduler states.

    Pruned layers hold new ``nn.Parameter`` objects, so the old optimizers would update tensors that are no longer
    in the model. Under DDP the model is wrapped again first (a collective: every rank calls this).
    """
    strategy = trainer.strategy
    old_optimizers = list(strategy.optimizers)
    old_schedulers = [config.scheduler for config in strategy.lr_scheduler_configs]
    if isinstance(strategy, DDPStrategy):  # the DDP reducer holds the old parameters: wrap again (collective)
        strategy.model = strategy.lightning_module
        strategy.configure_ddp()
    strategy.setup_optimizers(trainer)
    for old, new in zip(old_optimizers, strategy.optimizers, strict=False):
        if len(old.param_groups) == len(new.param_groups):
            for old_group, new_group in zip(old.param_groups, new.param_groups, strict=True):
                new_group.update({k: v for k, v in old_group.items() if k != "params"})
    for old_scheduler, config in zip(old_schedulers, strategy.lr_scheduler_configs, strict=False):
        if type(old_scheduler) is type(config.scheduler):
            config.scheduler.load_state_dict(old_scheduler.state_dict())


def restart_warmup(trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, rewarm: int | float) -> None:
    """Restart every warmup callback's warmup for ``rewarm``, and let it attach to the new optimizers now.

    The warmups are found by the cooperation protocol (`lightning_speedkit.lr.warmups`, any callback that is
    `~lightning_speedkit.lr.WarmupLike`) and driven through its public ``restart``; without one, nothing happens.
    """
    for warmup in warmups(trainer):
        warmup.restart(rewarm)
        if isinstance(warmup, Callback):  # idempotent: resolves the new schedule and attaches to the new optimizers
            warmup.on_train_batch_start(trainer, pl_module, batch, 0)
