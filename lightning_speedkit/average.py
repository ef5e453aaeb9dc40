"""WeightAverage: validate, checkpoint and end with a moving average of the weights, its horizon set by the run.

At a constant LR the weights jitter around the path training follows, and so does ``val_acc`` from one validation to
the next: the demo's ResNet reads 0.94, then 0.70, then 1.00 on three epochs in a row. An exponential moving average
of the weights follows the same path with the jitter averaged out (Polyak averaging; Hägele et al. 2024 found that
averaging recovers part of a cool-down's gain at a constant LR). Training itself is untouched: the average is a shadow
copy, updated after each optimizer step, and put in place of the trained weights only while validating.

Anchors: TensorFlow's ``ExponentialMovingAverage`` (``num_updates``: the decay ``min(d, (1 + t) / (10 + t))``, so the
first steps are not dragged back to the initial weights), timm's ``ModelEmaV2`` (every floating-point tensor of the
state, the batch-norm statistics included) and Lightning's ``WeightAveraging`` (the average is what a checkpoint's
``state_dict`` holds, and what the module holds after fit; the trained weights are kept for a resume). Lightning's
callback keeps a deep copy of the whole module in an ``AveragedModel``; this one keeps only the averaged tensors and
updates them with one ``torch._foreach_lerp_``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any, ClassVar

import lightning.pytorch as pl
import torch
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor
from typing_extensions import override

from lightning_speedkit.budget import estimated_budget
from lightning_speedkit.checks import check_number
from lightning_speedkit.hooks import LeanCallback
from lightning_speedkit.report import log_rank_zero
from lightning_speedkit.restore import ListOf, StateSpec, check_checkpoints

__all__ = ["SHARE", "WeightAverage", "ema_decay", "validation_interval", "warm_decay"]

SHARE = 0.25
"""The average's time constant as a share of the steps between two validations: each validation sees the weights
of about the last quarter of the interval (the demo: 31 steps of its 125-step epochs)."""

_NO_INTERVAL = 4000.0
"""Steps between validations assumed when the run has none that can be counted (an endless loader, no validation
and no step limit): a time constant of 1,000 steps, Lightning's ``EMAWeightAveraging`` default of 0.999."""


def ema_decay(interval: float, share: float = SHARE) -> float:
    """The decay of a moving average whose time constant is ``share`` of ``interval`` optimizer steps.

    A time constant of one step or less averages nothing (0.0: the average is the latest weights).

    Example:
        >>> round(ema_decay(125), 4)  # the demo: 125 steps between validations, a 31-step time constant
        0.968
        >>> ema_decay(4000), ema_decay(3)
        (0.999, 0.0)
    """
    horizon = share * interval
    return 0.0 if horizon <= 1.0 else 1.0 - 1.0 / horizon


def warm_decay(decay: float, updates: int) -> float:
    """The decay of update number ``updates`` (from 0): ``min(decay, (1 + updates) / (10 + updates))``.

    Early on the average would otherwise drag the weights of the first steps along for many more; TensorFlow's
    ``ExponentialMovingAverage`` with ``num_updates`` does the same.

    Example:
        >>> warm_decay(0.968, 0), warm_decay(0.968, 90), warm_decay(0.968, 1000)
        (0.1, 0.91, 0.968)
    """
    return min(decay, (1.0 + updates) / (10.0 + updates))


def validation_interval(trainer: pl.Trainer) -> float:
    """Optimizer steps between two validations of this fit (its steps per epoch when it never validates).

    Read once the fit loop has its data (``on_train_start`` and later): ``val_check_batch`` training batches,
    times ``check_val_every_n_epoch`` when a check comes once an epoch, over ``accumulate_grad_batches``. A loader
    without a length falls back to the run's total steps, else `_NO_INTERVAL`.
    """
    batches = float(trainer.num_training_batches)
    check = trainer.val_check_batch
    validates = trainer.enable_validation and check is not None and not math.isinf(check)
    interval = float(check) if validates and check is not None else batches
    if validates and interval >= batches and trainer.check_val_every_n_epoch:
        interval = batches * trainer.check_val_every_n_epoch
    if math.isinf(interval) or interval <= 0:
        total = estimated_budget(trainer)
        return _NO_INTERVAL if math.isinf(total) else max(1.0, total)
    return max(1.0, interval / max(1, trainer.accumulate_grad_batches))


def _tensors(module: torch.nn.Module) -> Iterator[tuple[str, Tensor]]:
    """The averaged tensors by state-dict name: every floating-point parameter and buffer (batch-norm statistics)."""
    yield from ((n, p) for n, p in module.named_parameters() if p.is_floating_point())
    yield from ((n, b) for n, b in module.named_buffers() if b.is_floating_point())


class WeightAverage(LeanCallback):
    """Validate, checkpoint and end the fit with an exponential moving average of the weights.

    After every optimizer step the average moves towards the weights by ``1 - decay`` (`warm_decay` early on), for
    every floating-point parameter and buffer, on every rank alike (their weights are the same under DDP). The decay
    is set when training starts, from the run (`ema_decay` of `validation_interval`), unless ``decay`` is given. While
    the fit validates, the module holds the average; after, the trained weights again, so training goes on as if there
    were no average. The module's tensors are read again at each epoch's first step: the average starts again from the
    weights when their shapes have changed (`StructuredPruning`, at an epoch's start), and when it is not finite at a
    validation, and when a `TrainingGuard` rolls the weights back (`rolled_back`). A checkpoint's ``state_dict`` holds
    the average (what ``load_from_checkpoint`` gives you, and what the monitored metric measured); the callback's
    state keeps the trained weights, so a resumed fit goes on from them with the same average. After fit, the module
    holds the average; its batch-norm statistics, which each DDP rank averages from its own batches, rank zero's.

    Args:
        decay: The decay in [0, 1); None (default): from the steps between two validations, a time constant of
            ``share`` of them.
        share: The time constant's share of the steps between two validations, in (0, 1].

    Raises:
        ValueError: For a ``decay`` outside [0, 1) or a ``share`` outside (0, 1].

    Logged metric: ``speedkit/average/decay`` (once, when set).

    Example:
        >>> import lightning as L
        >>> trainer = L.Trainer(logger=False, callbacks=[WeightAverage()])
    """

    state_spec: ClassVar[StateSpec] = {
        "decay": (float, None),
        "interval": (float, None),
        "updates": int,
        "last_step": int,
        "restarts": ListOf(str),
        "trained": (dict, None),
    }
    """What a checkpoint may hold for the average (checked before anything is restored: `lightning_speedkit.restore`).
    ``trained`` is the trained weights by state-dict name, while the checkpoint's ``state_dict`` holds the average."""

    def __init__(self, decay: float | None = None, share: float = SHARE) -> None:
        if decay is not None:
            check_number("decay", decay, 0, 1, open_high=True)
        check_number("share", share, 0, 1, open_low=True)
        self.decay = None if decay is None else float(decay)
        self.share = float(share)
        self._after_fit: list[Tensor] | None = None  # the trained weights, on the host, from the fit's end to the next
        self._reset()

    def _reset(self) -> None:
        """A fit's own average: a second fit (another model, or the same one again) starts one of its own."""
        self._decay: float | None = self.decay
        self._interval: float | None = None
        self._names: list[str] = []
        self._average: list[Tensor] | None = None
        self._trained: list[Tensor] | None = None  # the trained weights while the module holds the average
        self._module_tensors: list[Tensor] = []  # the module's averaged tensors, as last read
        self._reread = True
        self._updates = 0
        self._last_step = -1
        self._restarts: list[str] = []
        self._trained_in_fit = False  # whether this fit's training loop ran (a finished run's resume runs none)
        self._ended = False  # whether the average went in at this fit's end

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        check_checkpoints(trainer)
        if stage == "fit":  # a checkpoint's state, if any, loads after this
            self._reset()

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._after_fit, self._trained_in_fit, self._ended = None, True, False
        self._last_step = max(self._last_step, trainer.global_step)  # a batch that ends at it stepped nothing
        if self.decay is None and self._decay is None:  # a resume keeps the decay it had
            self._interval = validation_interval(trainer)
            self._decay = ema_decay(self._interval, self.share)
            log_rank_zero(trainer, {"speedkit/average/decay": self._decay})

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._reread = True  # at the epoch's first step, after every epoch-start hook (pruning's) has run

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step <= self._last_step:  # no optimizer step (accumulating, or a skipped batch)
            return
        self._last_step = trainer.global_step
        if self._reread or self._average is None:  # the module's tensors are read again once an epoch
            self._reread = False
            names, tensors = self._current(pl_module)
            if self._average is None or not self._matches(self._average, names, tensors):
                self._start(names, tensors, "" if self._average is None else "the weights changed shape")
                return
        weight = 1.0 - warm_decay(self._decay if self._decay is not None else 0.0, self._updates)
        with torch.no_grad():
            torch._foreach_lerp_(self._average, self._module_tensors, weight)
        self._updates += 1

    @override
    def on_validation_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.state.fn != TrainerFn.FITTING or self._average is None or self._trained is not None:
            return
        names, tensors = self._current(pl_module)
        if not self._matches(self._average, names, tensors):
            return  # the weights changed since the last step (a rollback of another shape): validate them
        if not all(bool(torch.isfinite(a).all()) for a in self._average):
            self._start(names, tensors, f"not finite at step {trainer.global_step}")
            return
        with torch.no_grad():
            self._trained = [t.detach().clone() for t in tensors]
            torch._foreach_copy_(tensors, self._average)

    @override
    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._put_back(pl_module)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._put_back(pl_module)

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._trained_in_fit:  # resumed from a finished run's checkpoint: no step ran, and no `on_train_end`
            self.settle_weights(trainer, pl_module)  # the module ends with the average, as the run it resumed did

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.settle_weights(trainer, pl_module)

    def settle_weights(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Put the average in the module, once a fit, on every rank (a collective: every rank calls it).

        Called at the fit's end, and earlier by a callback that exports the weights there (`Int8Export`, which settles
        every callback's end-of-fit weights in list order first, wherever it is in the list).
        """
        if self._ended:
            return
        self._ended = True
        self._put_back(pl_module)
        names, tensors = self._current(pl_module)
        if self._average is not None and self._matches(self._average, names, tensors):
            buffers = {name for name, _ in pl_module.named_buffers()}
            local = {n: _host_copy(a) for n, a in zip(names, self._average, strict=True) if n in buffers}
            shared = trainer.strategy.broadcast(local, src=0)  # each rank averaged its own batches' statistics
            with torch.no_grad():
                for name, average in zip(names, self._average, strict=True):
                    if name in shared:  # rank zero's, as DDP's forward hands out its buffers: every rank ends alike
                        average.copy_(shared[name])
                self._after_fit = [_host_copy(t) for t in tensors]  # a checkpoint saved after fit resumes from them
                torch._foreach_copy_(tensors, self._average)

    def rolled_back(self, trainer: pl.Trainer, step: int) -> None:
        """`TrainingGuard` put the weights of ``step`` back: the average, which holds the broken steps, starts again."""
        if self._average is not None:
            names, tensors = self._current(trainer.lightning_module)
            self._start(names, tensors, f"rolled back to step {step}")
            if self._ended:  # after the average went in: the weights put back are what a resume goes on from
                self._after_fit = [_host_copy(t) for t in tensors]

    @override
    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        """The checkpoint's ``state_dict`` gets the average (the trained weights are in this callback's state)."""
        state = checkpoint.get("state_dict")
        if self._average is None or not isinstance(state, dict):
            return
        for name, average in zip(self._names, self._average, strict=True):
            if name in state:
                state[name] = _host_copy(average)

    @override
    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        """The module was just given the checkpoint's average: keep it as the average, put the trained weights back."""
        saved = checkpoint.get("callbacks", {}).get(self.state_key) or {}
        trained = saved.get("trained")
        if trainer.state.fn != TrainerFn.FITTING or not isinstance(trained, dict):
            return  # not a resume of this callback's fit: the checkpoint's weights start both
        names, tensors = self._current(pl_module)
        with torch.no_grad():
            self._names, self._average = names, [t.detach().clone() for t in tensors]
            for name, tensor in zip(names, tensors, strict=True):
                if name in trained:
                    tensor.copy_(trained[name])

    @override
    def state_dict(self) -> dict[str, Any]:
        trained = None
        if self._average is not None:
            values = next(v for v in (self._trained, self._after_fit, self._module_tensors) if v is not None)
            trained = {name: _host_copy(value) for name, value in zip(self._names, values, strict=True)}
        return {
            "decay": self._decay,
            "interval": self._interval,
            "updates": self._updates,
            "last_step": self._last_step,
            "restarts": list(self._restarts),
            "trained": trained,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        decay = state_dict.get("decay")
        self._decay = self.decay if self.decay is not None else (None if decay is None else float(decay))
        interval = state_dict.get("interval")
        self._interval = None if interval is None else float(interval)
        self._updates = int(state_dict.get("updates", 0))
        self._last_step = int(state_dict.get("last_step", -1))
        self._restarts = list(state_dict.get("restarts", []))

    def report(self) -> dict[str, Any]:
        """What the average did, as a plain dict.

        Keys: ``decay`` (None before the first step), ``time_constant_steps`` (``1 / (1 - decay)``),
        ``interval_steps`` (the steps between validations it was set from; None for a given ``decay``), ``updates``
        and ``restarts`` (why the average started again from the weights, if it did).
        """
        decay = self._decay
        return {
            "decay": decay,
            "time_constant_steps": None if decay is None else 1.0 / (1.0 - decay),  # decay < 1 always
            "interval_steps": self._interval,
            "updates": self._updates,
            "restarts": list(self._restarts),
        }

    def _current(self, pl_module: pl.LightningModule) -> tuple[list[str], list[Tensor]]:
        """The module's averaged tensors now and their names; remembered for the steps and `state_dict`.

        The parameters themselves, not detached views: a layout change (`ChannelsLast`, also in its counted probe)
        gives a parameter new storage under the same object, which a view taken before would no longer see. Every
        write to them is under ``torch.no_grad()``.
        """
        pairs = list(_tensors(pl_module))
        self._module_tensors = [t for _, t in pairs]
        return [n for n, _ in pairs], self._module_tensors

    def _matches(self, average: list[Tensor], names: list[str], tensors: list[Tensor]) -> bool:
        """Whether ``tensors`` (named ``names``) are the ones ``average`` averages, by name and shape."""
        return names == self._names and _same_shapes(average, tensors)

    def _start(self, names: list[str], tensors: list[Tensor], why: str) -> None:
        """Start the average again from ``tensors`` (the first step, or after ``why``)."""
        if why:
            self._restarts.append(why)
        self._names, self._average, self._updates = names, [t.detach().clone() for t in tensors], 0

    def _put_back(self, pl_module: pl.LightningModule) -> None:
        """The trained weights back in the module, if it holds the average."""
        if self._trained is None:
            return
        _, tensors = self._current(pl_module)
        with torch.no_grad():
            torch._foreach_copy_(tensors, self._trained)
        self._trained = None


def _host_copy(tensor: Tensor) -> Tensor:
    """A copy in host memory, for a checkpoint: saving never needs a second copy of the weights on the device."""
    return tensor.detach().to("cpu", copy=True)


def _same_shapes(first: list[Tensor], second: list[Tensor]) -> bool:
    return len(first) == len(second) and all(a.shape == b.shape for a, b in zip(first, second, strict=True))
