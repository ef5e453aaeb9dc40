"""Trials: real training steps under a candidate setting inside a running fit, with everything put back afterwards.

This is the one way speedkit decides anything about speed. A `TrialSession` snapshots the model, optimizers,
schedulers, precision plugin, fit-loop progress, RNG streams and the train loader's generators; each `TrialSession.run`
applies a `Setting` (a batch size, loader settings, a memory format, a precision, an LR schedule), trains k real
steps through the Trainer's own loops (data loading included, exactly as the loop does it; precision, DDP and the
user's hooks behave as in training), reverts the setting and restores the snapshot, so every trial starts from the
same state and sees the same batches. Each trial ends with a verdict all ranks agree on (an out-of-memory error on
any rank fails it on every rank) and rank zero's timings and losses broadcast to all, so every rank decides alike.

When to probe, and what to keep, is decided by the pure rules of `lightning_speedkit.decisions`.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from lightning.fabric.utilities.seed import _collect_rng_states, _set_rng_states
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers.logger import DummyLogger
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.utilities.parsing import lightning_getattr, lightning_setattr
from lightning.pytorch.utilities.seed import isolate_rng
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor
from torch.amp.grad_scaler import _refresh_per_optimizer_state
from torchmetrics import Metric
from typing_extensions import override

from lightning_speedkit.batch import batch_size_of
from lightning_speedkit.decisions import check_probe_steps, choose_setting, loss_is_sound, probe_pays_back
from lightning_speedkit.oom import is_oom_error, release_memory
from lightning_speedkit.timing import StepTimer

if TYPE_CHECKING:
    import lightning.pytorch as pl

log = logging.getLogger(__name__)

__all__ = [
    "PROBE_ROUNDS",
    "AsIs",
    "BatchSize",
    "Setting",
    "TrialResult",
    "TrialSession",
    "decision_summary",
    "log_decision",
    "loss_of",
    "measure",
    "steps_left",
]


def steps_left(trainer: pl.Trainer) -> float:
    """Training batches left in this fit (``inf`` for an unbounded one), from ``trainer.estimated_stepping_batches``.

    Estimating builds the train loader and its iterator, which draws from the global RNG; a fit that has not built
    them yet gets them back unbuilt and its RNG untouched, so asking changes nothing about the run.
    """
    fit_loop = trainer.fit_loop
    built = fit_loop._combined_loader is not None
    with isolate_rng(include_cuda=torch.cuda.is_available()):
        estimated = trainer.estimated_stepping_batches
    if not built and fit_loop._combined_loader is not None:
        if fit_loop._data_fetcher is not None:
            fit_loop._data_fetcher.teardown()
            fit_loop._data_fetcher = None
        fit_loop._combined_loader = None
    if math.isinf(estimated):
        return math.inf
    return max(0.0, float(estimated) - trainer.global_step) * trainer.accumulate_grad_batches


PROBE_ROUNDS = 2
"""Rounds of one trial per setting that `measure` interleaves (a probe costs ``steps * rounds * settings`` steps)."""


# ---------------------------------------------------------------------------------------------------- settings
class Setting:
    """A candidate setting for the length of one trial: `apply` before its steps, `revert` after (even on failure).

    Subclass it for a lever; ``name`` labels the setting in reports. `callbacks` may add callbacks that run during
    the trial's steps (an LR schedule stepping the LR, a check on the batches).
    """

    name = "as is"

    def apply(self, trainer: pl.Trainer) -> None:
        """Put the setting in place."""

    def revert(self, trainer: pl.Trainer) -> None:
        """Undo `apply`."""

    def callbacks(self) -> Sequence[Callback]:
        """Callbacks to run during the trial's steps."""
        return ()


class AsIs(Setting):
    """The run as it is set up: the "without it" every lever compares against."""

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


# ---------------------------------------------------------------------------------------------------- results
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


class _PeerOutOfMemory(Exception):
    """Another rank ran out of memory in this trial (this rank has already taken part in the verdict)."""


def _agree(trainer: pl.Trainer) -> None:
    """A sync point: raise `_PeerOutOfMemory` unless every rank reached it (a failed rank answers from its handler)."""
    if not trainer.strategy.reduce_boolean_decision(True, all=True):
        raise _PeerOutOfMemory


def _agree_failed(trainer: pl.Trainer) -> None:
    """This rank's verdict after its own OOM: answers the peers' pending sync point with 'failed'."""
    trainer.strategy.reduce_boolean_decision(False, all=True)


def loss_of(outputs: Any) -> float | None:
    """The scalar training loss in a ``training_step``'s outputs (a tensor, or a dict's ``"loss"``), else None.

    Example:
        >>> loss_of({"loss": torch.tensor(0.5)}), loss_of(None)
        (0.5, None)
    """
    loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
    return float(loss.detach().float()) if isinstance(loss, Tensor) and loss.numel() == 1 else None


class _Probe(Callback):
    """The trials' own callback: times each step through `StepTimer`, keeps its loss, places the ranks' sync points."""

    def __init__(self) -> None:
        self.timer = StepTimer(window=1)
        self.losses: list[float | None] = []

    def start(self, device: torch.device) -> None:
        self.timer = StepTimer(window=1_000_000, device=device)
        self.losses = []

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
        _agree(trainer)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        _agree(trainer)
        self.timer.step_end()
        self.losses.append(loss_of(outputs))

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

    def measured(self) -> tuple[list[float], list[int]]:
        self.timer.flush()
        steps = self.timer.recent_steps()
        return [s.data_wait_s + s.compute_s for s in steps], [s.samples for s in steps]


def _cpu_copy(value: Any) -> Any:
    """A deep copy with every tensor copied to host memory (so a snapshot costs no device memory)."""
    copied = apply_to_collection(value, Tensor, lambda t: t.detach().to("cpu", copy=True))
    return copy.deepcopy(copied)


# ---------------------------------------------------------------------------------------------------- the session
class TrialSession:
    """Run trials inside ``on_fit_start`` and put everything back afterwards.

    Use as a context manager; `run` tries one `Setting`. Before every trial and on exit, the weights, optimizer and
    scheduler states, precision plugin (e.g. the grad scaler), fit-loop progress, RNG streams (torch, CUDA, numpy,
    Python) and the train loader's generators are as they were on entry; module train/eval modes, loggers, callbacks
    and loop limits too, and the dataloaders are rebuilt at their next use. So every trial trains on the same batches
    from the same weights, and the run that follows is exactly the run without trials. Trials run with gradient
    all-reduce blocked (``strategy.block_backward_sync``): memory is the same (DDP's buckets exist from its
    construction), and a rank that runs out of memory cannot leave the others waiting inside backward.

    Args:
        trainer: The Trainer, in ``on_fit_start`` (optimizers set up, strategy wrapped).
        steps: Training batches per trial, each a full optimizer step.
        warmup: Leading steps of each trial left out of its median step time.
        validate: Also run one validation batch after the steps (the batch-size finder probes eval memory).

    Raises:
        ValueError: If ``steps`` is not an int >= 1 or ``warmup`` not an int in [0, steps).
    """

    def __init__(self, trainer: pl.Trainer, steps: int, warmup: int = 1, validate: bool = False) -> None:
        check_probe_steps("steps", steps)
        if isinstance(warmup, bool) or not isinstance(warmup, int) or not 0 <= warmup < steps:
            raise ValueError(f"`warmup` must be an int in [0, steps={steps}), got {warmup!r}.")
        self.trainer, self.steps, self.warmup, self.validate = trainer, steps, warmup, validate
        self.probe = _Probe()
        self.seconds = 0.0
        self.elapsed_s = 0.0
        self._started = 0.0
        self._saved: dict[str, Any] = {}

    def __enter__(self) -> TrialSession:
        trainer, module, fit_loop = self.trainer, self.trainer.lightning_module, self.trainer.fit_loop
        epoch_loop = fit_loop.epoch_loop
        self._started = time.perf_counter()
        self._saved = {
            "model": _cpu_copy(module.state_dict()),
            "optimizers": [_cpu_copy(opt.state_dict()) for opt in trainer.optimizers],
            "schedulers": [copy.deepcopy(cfg.scheduler.state_dict()) for cfg in trainer.lr_scheduler_configs],
            "precision": _cpu_copy(trainer.precision_plugin.state_dict()),
            "precision_plugin": trainer.strategy.precision_plugin,
            "loop": copy.deepcopy(fit_loop.state_dict()),
            "modes": {name: sub.training for name, sub in module.named_modules()},
            "forward": module.__dict__.get("forward"),
            "stage": trainer.state.stage,
            "callbacks": trainer.callbacks,  # type: ignore[attr-defined]
            "loggers": trainer.loggers,
            "limits": (trainer.limit_train_batches, trainer.limit_val_batches, trainer.accumulate_grad_batches),
            "loop_limits": (fit_loop.max_epochs, fit_loop.min_epochs, epoch_loop.max_steps, epoch_loop.min_steps),
            "rng": _collect_rng_states(include_cuda=torch.cuda.is_available()),
            # A train loader built before the trials (its iterator already drew from the RNG) is put back as it was.
            "data": (
                (fit_loop._combined_loader, fit_loop._data_fetcher, fit_loop.max_batches, trainer.val_check_batch)
                if fit_loop._combined_loader is not None
                else None
            ),
            "generators": {},
        }
        self._saved["generators"] = {id(g): (g, g.get_state()) for g in self._loader_generators()}
        trainer.callbacks = [self.probe]  # type: ignore[attr-defined]
        trainer.loggers = [DummyLogger()] if trainer.loggers else []
        trainer.accumulate_grad_batches = 1  # every trial batch is a full optimizer step, optimizer state included
        trainer.limit_val_batches = 0  # validation runs once per trial, explicitly, after the training steps
        return self

    def _loader_generators(self) -> list[torch.Generator]:
        loader = self.trainer.fit_loop._combined_loader
        found: list[torch.Generator] = []
        for dataloader in loader.flattened if loader is not None else []:
            for owner in (dataloader, getattr(dataloader, "sampler", None), getattr(dataloader, "batch_sampler", None)):
                generator = getattr(owner, "generator", None)
                if isinstance(generator, torch.Generator) and all(generator is not g for g in found):
                    found.append(generator)
        return found

    def _restore_rng(self) -> None:
        _set_rng_states(self._saved["rng"])
        for generator, state in self._saved["generators"].values():
            generator.set_state(state)

    def batches_per_epoch(self) -> int | None:
        """Training batches per epoch on this rank with the loaders as set now (None for iterable datasets)."""
        return self._loader_length(lambda dataloader: dataloader)

    def samples_per_rank(self) -> int | None:
        """Training samples each rank sees per epoch (the length of its sampler), None for iterable datasets."""
        return self._loader_length(lambda dataloader: getattr(dataloader, "sampler", None))

    def _loader_length(self, part: Callable[[Any], Any]) -> int | None:
        """The shortest ``len(part(loader))`` over the train loaders, rebuilt now (None when one has no length)."""
        fit_loop = self.trainer.fit_loop
        fit_loop._combined_loader = None
        fit_loop.setup_data()
        self._restore_rng()
        loader = fit_loop._combined_loader
        lengths: list[int] = []
        dataloaders: list[Any] = loader.flattened if loader is not None else []
        for dataloader in dataloaders:
            try:
                lengths.append(len(part(dataloader)))
            except TypeError:
                return None
        return min(lengths) if lengths else None

    def run(self, setting: Setting, max_batches: int | None = None) -> TrialResult:
        """Apply ``setting``, train ``steps`` batches (and validate one if asked), revert; all ranks get one result.

        Args:
            setting: What to try.
            max_batches: At most this many batches per epoch (the batch-size finder's full batches); the trial then
                spans epochs. Without it, a train loader shorter than ``steps`` is an error.

        Raises:
            ValueError: If the train loader has fewer batches per epoch than ``steps`` (and no ``max_batches``).
        """
        trainer = self.trainer
        fit_loop, val_loop = trainer.fit_loop, trainer.fit_loop.epoch_loop.val_loop
        self._restore_rng()
        outcome, error = "fits", ""
        setting.apply(trainer)
        try:
            limit = self.steps if max_batches is None else max(1, min(self.steps, max_batches))
            if max_batches is None:
                available = self.batches_per_epoch()
                if available is not None and available < self.steps:
                    raise ValueError(
                        f"`steps`={self.steps} is longer than the train loader: {available} batches per epoch;"
                        " use fewer probe steps or more data."
                    )
            trainer.limit_train_batches = limit
            fit_loop.max_epochs, fit_loop.min_epochs = self.steps, None
            fit_loop.epoch_loop.max_steps, fit_loop.epoch_loop.min_steps = self.steps, None
            trainer.callbacks = [self.probe, *setting.callbacks()]  # type: ignore[attr-defined]
            self.probe.start(trainer.strategy.root_device)
            with self._no_sync():
                fit_loop._combined_loader = None
                fit_loop.load_state_dict(copy.deepcopy(self._saved["loop"]))
                fit_loop.restarting = False
                fit_loop.run()
                if self.validate and val_loop._data_source.is_defined():
                    trainer.limit_val_batches = 1
                    val_loop._combined_loader = None
                    trainer.validating = True
                    val_loop.run()
                    trainer.training = True
                _agree(trainer)  # the verdict: a rank that failed after the last sync point answers here
        except _PeerOutOfMemory:
            outcome, error = "peer", "another rank ran out of memory"
        except Exception as exc:
            if not is_oom_error(exc):
                self._clean_up()
                setting.revert(trainer)
                self._restore_state()
                raise
            outcome, error = "oom", str(exc).splitlines()[0][:300]
        finally:
            trainer.callbacks = [self.probe]  # type: ignore[attr-defined]
        self._clean_up()
        setting.revert(trainer)
        self._restore_state()
        if outcome == "oom":
            _agree_failed(trainer)
        if outcome != "fits":  # the failed step's tensors may sit in reference cycles through its traceback
            release_memory()
        step_s, samples = self.probe.measured() if outcome == "fits" else ([], [])
        mine = TrialResult(setting.name, outcome == "fits", step_s, self.probe.losses, samples, self.warmup, error)
        result: TrialResult = trainer.strategy.broadcast(mine, src=0)
        if outcome != "fits":  # a failure is every rank's verdict, whatever rank zero saw
            result = TrialResult(setting.name, False, [], [], [], self.warmup, error)
        self.seconds += result.seconds
        log.debug("trial %s: %s %s", setting.name, outcome, error)
        return result

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

    def _restore_state(self) -> None:
        """Weights, optimizers, schedulers, precision plugin, loop progress and RNG as on entry."""
        trainer, module, saved = self.trainer, self.trainer.lightning_module, self._saved
        module.load_state_dict(saved["model"])
        for optimizer, state in zip(trainer.optimizers, saved["optimizers"], strict=True):
            optimizer.load_state_dict(state)
        for config, state in zip(trainer.lr_scheduler_configs, saved["schedulers"], strict=True):
            config.scheduler.load_state_dict(state)
        trainer.strategy.precision_plugin = saved["precision_plugin"]
        _reset_grad_scaler(trainer.precision_plugin)
        trainer.precision_plugin.load_state_dict(copy.deepcopy(saved["precision"]))
        trainer.fit_loop.load_state_dict(copy.deepcopy(saved["loop"]))
        trainer.fit_loop.restarting = False
        self._restore_rng()

    def __exit__(self, *exc_info: object) -> None:
        trainer, module, fit_loop = self.trainer, self.trainer.lightning_module, self.trainer.fit_loop
        saved = self._saved
        self._restore_state()
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
        if saved["data"] is not None:
            fit_loop._combined_loader, fit_loop._data_fetcher, fit_loop.max_batches, trainer.val_check_batch = saved[
                "data"
            ]
        else:
            fit_loop._combined_loader = None
        fit_loop.epoch_loop.val_loop._combined_loader = None
        self.elapsed_s = time.perf_counter() - self._started
        release_memory()


def _reset_grad_scaler(plugin: Any) -> None:
    """Forget a GradScaler's per-optimizer step state, which ``load_state_dict`` leaves as it is.

    An OOM between ``unscale_`` and ``update`` leaves an optimizer marked unscaled; the next trial's ``unscale_``
    would then fail with "unscale_() has already been called".
    """
    scaler = getattr(plugin, "scaler", None)
    if scaler is not None and hasattr(scaler, "_per_optimizer_states"):
        scaler._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)


def measure(
    trainer: pl.Trainer,
    current: Setting,
    candidates: Sequence[Setting],
    steps: int,
    margin: float,
    max_gain: float,
    warmup: int = 1,
    rounds: int = PROBE_ROUNDS,
    loss_tolerance: float | None = None,
) -> dict[str, Any]:
    """Decide between the setting in place and ``candidates`` by real training steps; the report of that decision.

    Follows the rules of `lightning_speedkit.decisions`: no probe when it cannot pay back within the run (a reason
    says so); otherwise, in one `TrialSession`, ``rounds`` rounds of one trial per setting (the setting in place
    first), interleaved so that drift on a shared machine hits every setting alike; each setting's time is the median
    of its timed steps over all rounds. The fastest candidate is chosen only if it beats the setting in place by
    ``margin``. With ``loss_tolerance``, a candidate whose first-round losses are non-finite or clearly worse than the
    setting in place's is rejected. Every rank returns the same report; the caller applies ``report["decision"]``.

    Returns:
        ``decision`` (a setting's name), ``reason``, ``probed``, ``probe_s`` (seconds the trials took, set-up
        included), ``steps_left``, ``step_s`` (median seconds per step by setting), ``rejected`` (setting: why) and
        ``trials`` (each `TrialResult` as a dict).

    Raises:
        ValueError: If the train loader has fewer batches per epoch than ``steps``.
    """
    settings = (current, *candidates)
    left = steps_left(trainer)
    pays, why = probe_pays_back(steps * rounds * len(settings), left, max_gain)
    report: dict[str, Any] = {"decision": current.name, "reason": why, "probed": False, "probe_s": 0.0}
    report.update(steps_left=None if math.isinf(left) else left, step_s={}, rejected={}, trials=[])
    if not pays:
        return report
    with TrialSession(trainer, steps, warmup) as session:
        batches = session.batches_per_epoch()
        if batches is not None and batches < steps:
            raise ValueError(
                f"`probe_steps` must not be longer than the train loader: got {steps}, the loader has {batches}"
                " batches per epoch."
            )
        results = [session.run(setting) for _ in range(rounds) for setting in settings]
    first = results[: len(settings)]
    for setting, result in zip(settings, first, strict=True):
        problem = result.error if not result.fits else ""
        if not problem and loss_tolerance is not None and result is not first[0]:
            problem = loss_is_sound(result.losses, first[0].losses, loss_tolerance)
        own = [r for r in results if r.setting == setting.name]
        timed = [t for r in own if r.fits for t in r.step_s[r.warmup :]]
        if problem or not all(r.fits for r in own):
            report["rejected"][setting.name] = problem or next(r.error for r in own if not r.fits)
        report["step_s"][setting.name] = statistics.median(timed) if timed and not problem else None
    decision, reason = choose_setting(report["step_s"], current.name, margin)
    report.update(decision=decision, reason=reason, probed=True, probe_s=session.elapsed_s)
    report["trials"] = [result.as_dict() for result in results]
    return report


def decision_summary(decision: Mapping[str, Any]) -> dict[str, Any]:
    """A `measure` report for a lever's ``report()``: step times in milliseconds (``step_ms``), the trials left out.

    Example:
        >>> decision_summary({"decision": "a", "step_s": {"a": 0.01, "b": None}, "trials": []})
        {'decision': 'a', 'step_ms': {'a': 10.0, 'b': None}}
    """
    out = {k: v for k, v in decision.items() if k not in ("step_s", "trials")}
    if decision.get("step_s"):
        out["step_ms"] = {k: None if v is None else 1e3 * v for k, v in decision["step_s"].items()}
    return out


def log_decision(trainer: pl.Trainer, area: str, decision: Mapping[str, Any]) -> None:
    """Log a measured decision on rank zero: ``speedkit/<area>/<setting>_step_ms`` and ``speedkit/<area>/probe_s``."""
    if not (trainer.is_global_zero and decision.get("probed")):
        return
    step_s = decision.get("step_s") or {}
    metrics = {f"speedkit/{area}/{name}_step_ms": 1e3 * s for name, s in step_s.items() if s is not None}
    metrics[f"speedkit/{area}/probe_s"] = float(decision.get("probe_s", 0.0))
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=trainer.global_step)
