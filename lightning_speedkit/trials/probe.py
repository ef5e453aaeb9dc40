"""The trials' own callback and the sync points that let every rank agree on a trial's outcome.

`_Probe` is `lightning_speedkit.trials.TrialSession`'s alone: it times each trial step, keeps its loss, stops the trial
after its batches and places the ranks' sync points (`agree`; `agree_failed` after this rank's own failure: running
out of memory, or any error of a trial run with ``catch``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor
from typing_extensions import override

from lightning_speedkit.batch import batch_size_of
from lightning_speedkit.timing import StepTimer
from lightning_speedkit.trials.settings import loss_of

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["PeerFailed", "agree", "agree_failed"]


class PeerFailed(Exception):
    """Another rank's trial failed (out of memory, or an error caught); this rank has taken part in the verdict."""


def agree(trainer: pl.Trainer) -> None:
    """A sync point: raise `PeerFailed` unless every rank reached it (a failed rank answers from its handler)."""
    if not trainer.strategy.reduce_boolean_decision(True, all=True):
        raise PeerFailed


def agree_failed(trainer: pl.Trainer) -> None:
    """This rank's verdict after its own failure: answers the peers' pending sync point with 'failed'."""
    trainer.strategy.reduce_boolean_decision(False, all=True)


class _Probe(Callback):
    """The trials' own callback: times each step through `StepTimer`, keeps its loss, places the ranks' sync points."""

    def __init__(self) -> None:
        self.timer = StepTimer(window=1)
        self.losses: list[float | None] = []
        self.batches = 0

    def start(self, device: torch.device, batches: int) -> None:
        """Time a trial of ``batches`` training batches: the trial stops after them."""
        self.timer = StepTimer(window=1_000_000, device=device)
        self.losses, self.batches = [], batches

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.timer.started == 0:
            self.timer.mark()

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self.timer.step_start(samples=batch_size_of(batch) or 0)

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        agree(trainer)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        agree(trainer)
        self.timer.step_end()
        self.losses.append(loss_of(outputs))
        # the trial ends after its batches (under manual optimization `max_steps` counts optimizer steps instead)
        if len(self.losses) >= self.batches:
            trainer.should_stop = True

    @override
    def on_validation_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        agree(trainer)

    def measured(self) -> tuple[list[float], list[int], list[float]]:
        """Each timed step's seconds, samples and wait for data."""
        self.timer.flush()
        steps = self.timer.recent_steps()
        return [s.data_wait_s + s.compute_s for s in steps], [s.samples for s in steps], [s.data_wait_s for s in steps]
