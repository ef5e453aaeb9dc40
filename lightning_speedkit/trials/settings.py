"""What a trial tries and what it returns: `Setting` (a candidate for k steps) and `TrialResult`."""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.parsing import lightning_getattr, lightning_setattr
from torch import Tensor
from typing_extensions import override

from lightning_speedkit.batch import batch_size_of

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["AsIs", "BatchSize", "LeaveOut", "Setting", "TrialResult", "loss_of", "loss_tensor"]


class Setting:
    """A candidate setting for the length of one trial: `apply` before its steps, `revert` after (even on failure).

    Subclass it for a lever; ``name`` labels the setting in reports. `callbacks` may add callbacks that run during
    the trial's steps (an LR schedule stepping the LR, a check on the batches).
    """

    name = "as is"

    changes_math = True
    """Whether the setting changes what a training step computes (a batch size, an LR). A setting that does not, or
    changes only its rounding (a memory layout, loader workers, compile, a fused update, an autocast precision, whose
    blocks `lightning_speedkit.precision` checks by their loss), can be tried on steps that count
    (`lightning_speedkit.trials.counted`); one that does is tried on restored steps."""

    def apply(self, trainer: pl.Trainer) -> None:
        """Put the setting in place."""

    def revert(self, trainer: pl.Trainer) -> None:
        """Undo `apply`."""

    def callbacks(self) -> Sequence[Callback]:
        """Callbacks to run during the trial's steps."""
        return ()


class AsIs(Setting):
    """The run as it is set up: the "without it" every lever compares against."""

    changes_math = False

    def __init__(self, name: str = "as is") -> None:
        self.name = name


class BatchSize(Setting):
    """A batch size, written to the module's (or datamodule's) batch-size attribute; every batch must be that size."""

    def __init__(self, batch_arg_name: str, size: int) -> None:
        self.batch_arg_name, self.size, self.name = batch_arg_name, size, str(size)
        self._check = _BatchCheck(size)
        self._was: Any = None

    @override
    def apply(self, trainer: pl.Trainer) -> None:
        self._was = lightning_getattr(trainer.lightning_module, self.batch_arg_name)
        lightning_setattr(trainer.lightning_module, self.batch_arg_name, self.size)

    @override
    def revert(self, trainer: pl.Trainer) -> None:
        lightning_setattr(trainer.lightning_module, self.batch_arg_name, self._was)

    @override
    def callbacks(self) -> Sequence[Callback]:
        return (self._check,)


class _BatchCheck(Callback):
    def __init__(self, size: int) -> None:
        self.size = size

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        seen = batch_size_of(batch)
        if seen is not None and seen != self.size:
            raise ValueError(
                f"BatchSizeFinder: the train dataloader yielded a batch of {seen} while the batch size was set to"
                f" {self.size}; build the DataLoader in `train_dataloader()` from the batch-size attribute each time"
                " it is called."
            )


@dataclass(frozen=True)
class LeaveOut:
    """What a lever's ``after_reference`` gives to try only some candidates: those ``names`` are not tried, for ``why``.

    Example:
        >>> LeaveOut(("num_workers=2",), "its start-up cannot pay back")
        LeaveOut(names=('num_workers=2',), why='its start-up cannot pay back')
    """

    names: tuple[str, ...]
    why: str


@dataclass
class TrialResult:
    """One trial, as rank zero measured it (every rank holds the same copy).

    Attributes:
        setting: The setting's name.
        fits: Whether every rank ran every step (False after an out-of-memory error on any rank).
        step_s: Seconds per training step, data loading included (the first step also pays the iterator start).
        losses: The training loss of each step (None where the step returned none).
        samples: Samples per step.
        warmup: Leading steps left out of `median_step_s` and `samples_per_s`.
        error: The out-of-memory message, or why the trial failed.
    """

    setting: str
    fits: bool
    step_s: list[float] = field(default_factory=list)
    losses: list[float | None] = field(default_factory=list)
    samples: list[int] = field(default_factory=list)
    warmup: int = 1
    error: str = ""

    @property
    def median_step_s(self) -> float | None:
        """Median seconds per step after the warm-up steps (None without such steps)."""
        timed = self.step_s[self.warmup :]
        return statistics.median(timed) if self.fits and timed else None

    @property
    def samples_per_s(self) -> float | None:
        """Samples per second over the steps after the warm-up (None without such steps)."""
        timed = self.step_s[self.warmup :]
        if not self.fits or not timed or sum(timed) <= 0:
            return None
        return sum(self.samples[self.warmup : len(self.step_s)]) / sum(timed)

    @property
    def seconds(self) -> float:
        """Seconds of training steps this trial cost."""
        return float(sum(self.step_s))

    def as_dict(self) -> dict[str, Any]:
        """A plain dict for reports and ``state_dict``, with the median step time and samples/s."""
        return {**asdict(self), "median_step_s": self.median_step_s, "samples_per_s": self.samples_per_s}


def loss_of(outputs: Any) -> float | None:
    """The scalar training loss in a ``training_step``'s outputs (a tensor, or a dict's ``"loss"``), else None.

    Example:
        >>> import torch
        >>> loss_of({"loss": torch.tensor(0.5)}), loss_of(None)
        (0.5, None)
    """
    loss = loss_tensor(outputs)
    return None if loss is None else float(loss.float())


def loss_tensor(outputs: Any) -> Tensor | None:
    """`loss_of` without reading the value (no device sync): the detached scalar loss tensor, else None.

    Example:
        >>> import torch
        >>> loss_tensor({"loss": torch.tensor(0.5, requires_grad=True)}).requires_grad, loss_tensor("no")
        (False, None)
    """
    loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
    return loss.detach() if isinstance(loss, Tensor) and loss.numel() == 1 else None
