"""Honest batch-size trials inside a running fit: real steps at exactly the size tried, agreed by every rank.

This is the only module of the finder that touches Lightning's loops. A `TrialSession` snapshots the model,
optimizers, schedulers, precision plugin and fit loop, runs each trial as real training steps plus one validation
step through the Trainer's own loops (so precision, DDP and the user's hooks behave as in training), and restores
everything on exit. Each trial ends with an all-reduced verdict, so every rank agrees whether a size fit.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import time
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers.logger import DummyLogger
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.utilities.parsing import lightning_setattr
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor
from torchmetrics import Metric
from typing_extensions import override

from lightning_speedkit.batch import batch_size_of
from lightning_speedkit.oom import is_oom_error, release_memory

if TYPE_CHECKING:
    import lightning.pytorch as pl

log = logging.getLogger(__name__)

__all__ = ["TrialResult", "TrialSession"]


class _PeerOutOfMemory(Exception):
    """Another rank ran out of memory in this trial (this rank has already taken part in the verdict)."""


class TrialResult:
    """One trial: the size, whether it fit on every rank, rank zero's samples/s, and the OOM message if any."""

    def __init__(self, size: int, fits: bool, samples_per_s: float | None, error: str = "") -> None:
        self.size, self.fits, self.samples_per_s, self.error = size, fits, samples_per_s, error

    def as_dict(self) -> dict[str, Any]:
        """A plain dict for reports and ``state_dict``."""
        return {"size": self.size, "fits": self.fits, "samples_per_s": self.samples_per_s, "error": self.error}


def _agree(trainer: pl.Trainer) -> None:
    """A sync point: raise `_PeerOutOfMemory` unless every rank reached it (a failed rank answers from its handler)."""
    if not trainer.strategy.reduce_boolean_decision(True, all=True):
        raise _PeerOutOfMemory


class _Probe(Callback):
    """The only callback during trials: checks batch sizes, times steps, and places the ranks' sync points."""

    def __init__(self) -> None:
        self.size = 0
        self.ends: list[float] = []
        self.samples: list[int] = []
        self.val_batches: list[int] = []
        self.cuda = False

    def start(self, size: int, cuda: bool) -> None:
        self.size, self.cuda, self.ends, self.samples, self.val_batches = size, cuda, [], [], []

    def _now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

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
        self.samples.append(seen or self.size)

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        _agree(trainer)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        _agree(trainer)
        self.ends.append(self._now())

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
        _agree(trainer)
        self.val_batches.append(batch_size_of(batch) or 0)

    def samples_per_second(self) -> float | None:
        """Samples/s over the steps after the first (which pays for warm-up); None with fewer than two steps."""
        if len(self.ends) < 2 or self.ends[-1] <= self.ends[0]:
            return None
        return sum(self.samples[1 : len(self.ends)]) / (self.ends[-1] - self.ends[0])


def _cpu_copy(value: Any) -> Any:
    """A deep copy with every tensor copied to host memory (so a snapshot costs no device memory)."""
    copied = apply_to_collection(value, Tensor, lambda t: t.detach().to("cpu", copy=True))
    return copy.deepcopy(copied)


class TrialSession:
    """Run trials at chosen batch sizes inside ``on_fit_start`` and put everything back afterwards.

    Use as a context manager; `run` tries one size. On exit the weights, optimizer and scheduler states, precision
    plugin (e.g. the grad scaler), fit-loop progress, module train/eval modes, loggers, callbacks and loop limits are
    as they were, the dataloaders are rebuilt at the next use, and memory is released. Trials run with gradient
    all-reduce blocked (``strategy.block_backward_sync``): memory is the same (DDP's buckets exist from its
    construction), and a rank that runs out of memory cannot leave the others waiting inside backward.

    Args:
        trainer: The Trainer, in ``on_fit_start``.
        batch_arg_name: The batch-size attribute (model, its ``hparams``, or the datamodule).
        steps_per_trial: Training batches per trial, each a full optimizer step; one validation batch follows.
    """

    def __init__(self, trainer: pl.Trainer, batch_arg_name: str, steps_per_trial: int) -> None:
        self.trainer = trainer
        self.batch_arg_name = batch_arg_name
        self.steps_per_trial = steps_per_trial
        self.probe = _Probe()
        self._saved: dict[str, Any] = {}

    def __enter__(self) -> TrialSession:
        trainer, module, fit_loop = self.trainer, self.trainer.lightning_module, self.trainer.fit_loop
        epoch_loop = fit_loop.epoch_loop
        self._saved = {
            "model": _cpu_copy(module.state_dict()),
            "optimizers": [_cpu_copy(opt.state_dict()) for opt in trainer.optimizers],
            "schedulers": [copy.deepcopy(cfg.scheduler.state_dict()) for cfg in trainer.lr_scheduler_configs],
            "precision": _cpu_copy(trainer.precision_plugin.state_dict()),
            "loop": copy.deepcopy(fit_loop.state_dict()),
            "modes": {name: sub.training for name, sub in module.named_modules()},
            "forward": module.__dict__.get("forward"),
            "stage": trainer.state.stage,
            "callbacks": trainer.callbacks,  # type: ignore[attr-defined]
            "loggers": trainer.loggers,
            "limits": (trainer.limit_train_batches, trainer.limit_val_batches, trainer.accumulate_grad_batches),
            "loop_limits": (fit_loop.max_epochs, fit_loop.min_epochs, epoch_loop.max_steps, epoch_loop.min_steps),
        }
        trainer.callbacks = [self.probe]  # type: ignore[attr-defined]
        trainer.loggers = [DummyLogger()] if trainer.loggers else []
        trainer.accumulate_grad_batches = 1  # every trial batch is a full optimizer step, optimizer state included
        trainer.limit_val_batches = 0  # validation runs once per trial, explicitly, after the training steps
        fit_loop.max_epochs, fit_loop.min_epochs = self.steps_per_trial, None
        epoch_loop.max_steps, epoch_loop.min_steps = self.steps_per_trial, None
        return self

    def samples_per_rank(self) -> int | None:
        """Training samples each rank sees per epoch (the length of its sampler), None for iterable datasets."""
        fit_loop = self.trainer.fit_loop
        fit_loop._combined_loader = None
        fit_loop.setup_data()
        loader = fit_loop._combined_loader
        lengths: list[int] = []
        dataloaders: list[Any] = loader.flattened if loader is not None else []
        for dataloader in dataloaders:
            sampler = getattr(dataloader, "sampler", None)
            try:
                lengths.append(len(sampler))  # type: ignore[arg-type]
            except TypeError:
                return None
        return min(lengths) if lengths else None

    def run(self, size: int, samples_per_rank: int | None) -> TrialResult:
        """Train ``steps_per_trial`` full batches of ``size``, validate one batch; every rank gets the same result."""
        trainer, module = self.trainer, self.trainer.lightning_module
        fit_loop, val_loop = trainer.fit_loop, trainer.fit_loop.epoch_loop.val_loop
        lightning_setattr(module, self.batch_arg_name, size)
        full_batches = self.steps_per_trial if samples_per_rank is None else samples_per_rank // size
        trainer.limit_train_batches = max(1, min(self.steps_per_trial, full_batches))
        self.probe.start(size, cuda=trainer.strategy.root_device.type == "cuda")
        outcome, error = "fits", ""
        try:
            with self._no_sync():
                fit_loop._combined_loader = None
                fit_loop.load_state_dict(copy.deepcopy(self._saved["loop"]))
                fit_loop.restarting = False
                fit_loop.run()
                if trainer.fit_loop.epoch_loop.val_loop._data_source.is_defined():
                    trainer.limit_val_batches = 1
                    val_loop._combined_loader = None
                    trainer.validating = True
                    val_loop.run()
                    trainer.training = True
                _agree(trainer)  # the verdict: a rank that failed after the last sync point answers here
        except _PeerOutOfMemory:
            outcome = "peer"
        except Exception as exc:
            if not is_oom_error(exc):
                raise
            outcome, error = "oom", str(exc).splitlines()[0][:300]
        finally:
            self._clean_up()
        if outcome == "oom":
            _agree_failed(trainer)
        if outcome != "fits":  # the failed step's tensors may sit in reference cycles through its traceback
            release_memory()
        speed = self.probe.samples_per_second() if outcome == "fits" else None
        speed = trainer.strategy.broadcast(speed, src=0)
        log.debug("trial at %d: %s %s", size, outcome, error)
        if outcome == "peer":
            error = "another rank ran out of memory"
        return TrialResult(size, outcome == "fits", speed, error)

    def _no_sync(self) -> contextlib.AbstractContextManager[Any]:
        strategy = self.trainer.strategy
        if isinstance(strategy, ParallelStrategy):
            return strategy.block_backward_sync()
        return contextlib.nullcontext()

    def _clean_up(self) -> None:
        """After a trial (even a failed one): close the data iterators, drop gradients, restore modes."""
        trainer, module = self.trainer, self.trainer.lightning_module
        for loop in (trainer.fit_loop, trainer.fit_loop.epoch_loop.val_loop):
            fetcher = getattr(loop, "_data_fetcher", None)
            if fetcher is not None:
                fetcher.teardown()
                loop._data_fetcher = None
        trainer.limit_val_batches = 0
        trainer.should_stop = False
        if module.__dict__.get("forward") is not self._saved["forward"]:
            # An OOM between a strategy's forward redirection (DDP) and the step leaves `forward` patched.
            if self._saved["forward"] is None:
                del module.__dict__["forward"]
            else:
                module.__dict__["forward"] = self._saved["forward"]
        module.zero_grad(set_to_none=True)
        for optimizer in trainer.optimizers:
            optimizer.zero_grad(set_to_none=True)
        self._restore_modes()

    def _restore_modes(self) -> None:
        modes = self._saved["modes"]
        for name, sub in self.trainer.lightning_module.named_modules():
            if name in modes:
                sub.training = modes[name]

    def __exit__(self, *exc_info: object) -> None:
        trainer, module, fit_loop = self.trainer, self.trainer.lightning_module, self.trainer.fit_loop
        saved = self._saved
        module.load_state_dict(saved["model"])
        for optimizer, state in zip(trainer.optimizers, saved["optimizers"], strict=True):
            optimizer.load_state_dict(state)
        for config, state in zip(trainer.lr_scheduler_configs, saved["schedulers"], strict=True):
            config.scheduler.load_state_dict(state)
        trainer.precision_plugin.load_state_dict(saved["precision"])
        fit_loop.load_state_dict(copy.deepcopy(saved["loop"]))
        fit_loop.restarting = False
        trainer.callbacks, trainer.loggers = saved["callbacks"], saved["loggers"]  # type: ignore[attr-defined]
        trainer.limit_train_batches, trainer.limit_val_batches, trainer.accumulate_grad_batches = saved["limits"]
        fit_loop.max_epochs, fit_loop.min_epochs, fit_loop.epoch_loop.max_steps, fit_loop.epoch_loop.min_steps = saved[
            "loop_limits"
        ]
        self._restore_modes()
        trainer.state.stage = saved["stage"]
        trainer.should_stop = False
        for sub in module.modules():  # metric states are not in state_dict: clear what the trials accumulated
            if isinstance(sub, Metric):
                sub.reset()
        connector = trainer._logger_connector
        connector.reset_results()
        connector.reset_metrics()
        fit_loop._combined_loader = None
        fit_loop.epoch_loop.val_loop._combined_loader = None
        release_memory()


def _agree_failed(trainer: pl.Trainer) -> None:
    """This rank's verdict after its own OOM: answers the peers' pending sync point with 'failed'."""
    trainer.strategy.reduce_boolean_decision(False, all=True)
