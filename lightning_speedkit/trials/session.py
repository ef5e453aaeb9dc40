"""`TrialSession`: real training steps under a `Setting` inside a running fit, everything put back afterwards."""

from __future__ import annotations

import contextlib
import copy
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from lightning.fabric.utilities.seed import _collect_rng_states, _set_rng_states
from lightning.pytorch.loggers.logger import DummyLogger
from lightning.pytorch.strategies import ParallelStrategy

from lightning_speedkit.checks import check_probe_steps
from lightning_speedkit.oom import is_oom_error, release_memory
from lightning_speedkit.report import quiet_logger
from lightning_speedkit.trials.loaders import (
    LIGHTNING_INFO,
    loader_generators,
    put_back_iterators,
    run_loaders,
    set_aside_iterators,
    streaming_kept,
)
from lightning_speedkit.trials.probe import PeerFailed, _Probe, agree, agree_failed
from lightning_speedkit.trials.replay import fetch_batches, replaying
from lightning_speedkit.trials.settings import Setting, TrialResult
from lightning_speedkit.trials.snapshot import (
    loop_flags,
    metric_states,
    put_back,
    put_metric_states,
    restore_loop_flags,
    take_state,
)

if TYPE_CHECKING:
    import lightning.pytorch as pl

log = logging.getLogger(__name__)

__all__ = ["LIGHTNING_INFO", "TrialSession"]


class TrialSession:
    """Run trials inside ``on_fit_start``, or ``on_train_epoch_start`` later in the fit, and put everything back.

    Use as a context manager; `run` tries one `Setting`. Before every trial and on exit, the weights, optimizer and
    scheduler states, precision plugin (e.g. the grad scaler), fit-loop progress, RNG streams (torch, CUDA, numpy,
    Python) and the train loaders' generators (built or not yet, `lightning_speedkit.trials.loaders`) are as they
    were on entry, and a persistent worker pool the run has started is kept out of the trials; module train/eval
    modes, loggers, callbacks and loop limits too, and the dataloaders are rebuilt at their next use. So every trial
    trains on the same batches from the same weights, and the run that follows is exactly the run without trials.
    Trials run with gradient all-reduce blocked (``strategy.block_backward_sync``): memory is the same (DDP's buckets
    exist from its construction), and a rank that runs out of memory cannot leave the others waiting inside
    backward. Lightning's info lines about the trials' own loops ("`Trainer.fit` stopped: `max_steps=4` reached.")
    are held back. A trial runs Lightning's fit loop, so the module's train and epoch hooks run around its steps, as in
    Lightning's own LR finder; the run's callbacks and loggers are set aside, and the module's fit hooks run once.

    Args:
        trainer: The Trainer, in ``on_fit_start`` (optimizers set up, strategy wrapped) or at an epoch's start, where
            the optimizers and schedulers already hold state (each trial then starts from a copy of it).
        steps: Training batches per trial, each a full optimizer step.
        warmup: Leading steps of each trial left out of its median step time.
        validate: Also run one validation batch after the steps (the batch-size finder probes eval memory).
        replay: Fetch the trials' batches once and give every trial copies of them (`lightning_speedkit.trials.replay`),
            for trials that differ in what the steps do, not in how the batches come; batches over 1 GiB in all, or
            trials longer than an epoch, fetch as usual.

    Raises:
        ValueError: If ``steps`` is not an int >= 1 or ``warmup`` not an int in [0, steps).
    """

    def __init__(
        self, trainer: pl.Trainer, steps: int, warmup: int = 1, validate: bool = False, replay: bool = False
    ) -> None:
        check_probe_steps("steps", steps)
        if isinstance(warmup, bool) or not isinstance(warmup, int) or not 0 <= warmup < steps:
            raise ValueError(f"`warmup` must be an int in [0, steps={steps}), got {warmup!r}.")
        self.trainer, self.steps, self.warmup, self.validate = trainer, steps, warmup, validate
        self.replay = replay
        self._to_fetch = replay  # until the first trial fetches the batches (once: too few or too large, not again)
        self._batches: list[Any] | None = None
        self._replay_rng: dict[str, Any] = {}
        self.probe = _Probe()
        self.seconds = 0.0
        self.waits: dict[str, list[float]] = {}  # per setting, its last trial's waits for data (rank zero's)
        self.elapsed_s = 0.0
        self._started = 0.0
        self._saved: dict[str, Any] = {}
        self._quiet = contextlib.ExitStack()

    def __enter__(self) -> TrialSession:
        trainer, module, fit_loop = self.trainer, self.trainer.lightning_module, self.trainer.fit_loop
        epoch_loop = fit_loop.epoch_loop
        self._started = time.perf_counter()
        self._quiet.enter_context(quiet_logger(LIGHTNING_INFO, logging.WARNING))
        self._saved = {
            **take_state(trainer),
            "precision_plugin": trainer.strategy.precision_plugin,
            "loop": copy.deepcopy(fit_loop.state_dict()),
            "loader_states": fit_loop._combined_loader_states_to_load,
            "loop_flags": loop_flags(fit_loop),
            "modes": {name: sub.training for name, sub in module.named_modules()},
            "metrics": metric_states(module),
            "forward": module.__dict__.get("forward"),
            "stage": trainer.state.stage,
            "should_stop": trainer.should_stop,  # a stop asked before the trials (at fit start) is the run's
            "callbacks": trainer.callbacks,  # type: ignore[attr-defined]
            "loggers": trainer.loggers,
            "limits": (trainer.limit_train_batches, trainer.limit_val_batches, trainer.accumulate_grad_batches),
            "loop_limits": (fit_loop.max_epochs, fit_loop.min_epochs, epoch_loop.max_steps, epoch_loop.min_steps),
            "rng": _collect_rng_states(include_cuda=torch.cuda.is_available()),
            "streaming": streaming_kept(trainer),  # a litdata loader's own place in its epochs
            # A train loader built before the trials (its iterator already drew from the RNG) is put back as it was.
            "data": (
                (fit_loop._combined_loader, fit_loop._data_fetcher, fit_loop.max_batches, trainer.val_check_batch)
                if fit_loop._combined_loader is not None
                else None
            ),
            "reload_epoch": fit_loop._last_train_dl_reload_epoch,
        }
        loaders = run_loaders(trainer)  # built or not: a loader handed out again shares its generator and its pool
        self._saved["generators"] = {id(g): (g, g.get_state()) for g in loader_generators(loaders)}
        self._saved["iterators"] = set_aside_iterators(loaders)
        trainer.callbacks = [self.probe]  # type: ignore[attr-defined]
        trainer.loggers = [DummyLogger()] if trainer.loggers else []
        trainer.accumulate_grad_batches = 1  # every trial batch is a full optimizer step, optimizer state included
        trainer.limit_val_batches = 0  # validation runs once per trial, explicitly, after the training steps
        return self

    def _restore_rng(self) -> None:
        _set_rng_states(self._saved["rng"])
        for generator, state in self._saved["generators"].values():
            generator.set_state(state)

    def require_steps(self, argument: str) -> None:
        """Raise a ``ValueError`` naming ``argument`` when the train loader has fewer batches than a trial's steps."""
        batches = self.batches_per_epoch()
        if batches is not None and batches < self.steps:
            raise ValueError(
                f"`{argument}` must not be longer than the train loader: got {self.steps}, the loader has {batches}"
                " batches per epoch."
            )

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

    def run(self, setting: Setting, max_batches: int | None = None, catch: bool = False) -> TrialResult:
        """Apply ``setting``, train ``steps`` batches (and validate one if asked), revert; all ranks get one result.

        Args:
            setting: What to try.
            max_batches: At most this many batches per epoch (the batch-size finder's full batches); the trial then
                spans epochs. Without it, a train loader shorter than ``steps`` is an error.
            catch: Any error of the steps fails the trial (on every rank, as running out of memory does), its first
                line in the result's ``error``; without it, only running out of memory does and other errors raise.

        Raises:
            ValueError: If the train loader has fewer batches per epoch than ``steps`` (and no ``max_batches``).
        """
        trainer = self.trainer
        fit_loop, val_loop = trainer.fit_loop, trainer.fit_loop.epoch_loop.val_loop
        self._restore_rng()
        outcome, error = "fits", ""
        setting.apply(trainer)
        try:  # whatever ends the trial (an interrupt too), the clean-up and `revert` run
            limit = self.steps if max_batches is None else max(1, min(self.steps, max_batches))
            if max_batches is None:
                available = self.batches_per_epoch()
                if available is not None and available < self.steps:
                    raise ValueError(
                        f"`steps`={self.steps} is longer than the train loader: {available} batches per epoch;"
                        " use fewer probe steps or more data."
                    )
            trainer.limit_train_batches = limit
            batches = self._replayed(limit)
            epoch, step = trainer.current_epoch, trainer.global_step  # 0 at fit start; later for a trial mid-fit
            fit_loop.max_epochs, fit_loop.min_epochs = epoch + self.steps, None
            fit_loop.epoch_loop.max_steps, fit_loop.epoch_loop.min_steps = step + self.steps, None
            if not trainer.lightning_module.automatic_optimization:  # its optimizer steps a batch vary: `_Probe` stops
                fit_loop.epoch_loop.max_steps = -1
            trainer.callbacks = [self.probe, *setting.callbacks()]  # type: ignore[attr-defined]
            trainer.should_stop = False  # the run's own stop (put back on exit) does not end a trial before its steps
            self.probe.start(trainer.strategy.root_device, self.steps)
            with self._no_sync(), replaying(trainer, batches) if batches else contextlib.nullcontext():
                fit_loop._combined_loader = None
                fit_loop._data_fetcher = None  # a fetcher of the run (a trial mid-fit) is kept aside, not reused
                self._load_loop([])  # the run's own loader position is not the trial's (a stateful loader's)
                fit_loop.restarting = False
                # An iteration-bounded fit loop stays "restarting", and so would its epoch loop, keeping the batch
                # counts of the epoch before: a trial mid-fit would then find its epoch done before any step.
                fit_loop.epoch_loop.restarting = False
                fit_loop.run()
                if self.validate and val_loop._data_source.is_defined():
                    trainer.limit_val_batches = 1
                    val_loop._combined_loader = None
                    trainer.validating = True
                    val_loop.run()
                    trainer.training = True
                agree(trainer)  # the verdict: a rank that failed after the last sync point answers here
        except PeerFailed:
            outcome, error = "peer", "another rank failed (out of memory, or an error of its step)"
        except Exception as exc:
            if not (catch or is_oom_error(exc)):
                raise
            line = str(exc).splitlines()[0][:300] if str(exc) else ""
            outcome, error = "failed", line if is_oom_error(exc) else f"{type(exc).__name__}: {line}"
        finally:
            trainer.callbacks = [self.probe]  # type: ignore[attr-defined]
            self._clean_up()
            if outcome == "failed":  # the peers wait in a sync point: answered before a revert's own collectives
                agree_failed(trainer)
            setting.revert(trainer)
            self._restore_state()
        if outcome != "fits":  # the failed step's tensors may sit in reference cycles through its traceback
            release_memory()
        step_s, samples, waits = self.probe.measured() if outcome == "fits" else ([], [], [])
        mine = TrialResult(setting.name, outcome == "fits", step_s, self.probe.losses, samples, self.warmup, error)
        result, self.waits[setting.name] = trainer.strategy.broadcast((mine, waits), src=0)
        if outcome != "fits":  # a failure is every rank's verdict, whatever rank zero saw
            result = TrialResult(setting.name, False, [], [], [], self.warmup, error)
        self.seconds += result.seconds
        log.debug("trial %s: %s %s", setting.name, outcome, error)
        return result

    def _replayed(self, limit: int) -> list[Any] | None:
        """The batches every trial replays (fetched by the first), or None to fetch as usual."""
        if self._to_fetch:
            self._to_fetch = False
            fetched = fetch_batches(self.trainer, limit) if limit == self.steps else None
            if not self.trainer.strategy.reduce_boolean_decision(fetched is not None, all=True):
                fetched = None  # every rank replays, or none does (a loader of its own issues collectives)
            self._restore_rng()
            if fetched is not None:
                self._batches, self._replay_rng = fetched
        if self._batches is not None:
            _set_rng_states(self._replay_rng)  # as a trial's steps find it after its loader drew its seed
        return self._batches

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
        trainer, saved = self.trainer, self._saved
        trainer.strategy.precision_plugin = saved["precision_plugin"]
        put_back(trainer, saved)  # copies: the next trial puts the same state back
        self._load_loop(saved["loader_states"])
        saved["streaming"]()
        trainer.fit_loop.restarting = False
        self._restore_rng()

    def _load_loop(self, loader_states: list[Any]) -> None:
        """The fit loop's progress as on entry; ``loader_states`` queued for its loaders (Lightning queues the saved).

        A stateful train loader's position (torchdata's ``StatefulDataLoader``, litdata's) is in the loop's state:
        queued as loaded, it went to the trial's loader, which has no state to take, and the fit crashed.
        """
        self.trainer.fit_loop.load_state_dict(copy.deepcopy(self._saved["loop"]))
        self.trainer.fit_loop._combined_loader_states_to_load = loader_states

    def __exit__(self, *exc_info: object) -> None:
        try:
            self._put_back()
        finally:
            self._quiet.close()
            self.elapsed_s = time.perf_counter() - self._started  # all of the session's cost, clean-up included

    def _put_back(self) -> None:
        """The run as on entry: state, callbacks, loggers, limits, modes, metrics, loaders; memory released."""
        trainer, fit_loop, saved = self.trainer, self.trainer.fit_loop, self._saved
        epoch_loop = fit_loop.epoch_loop
        self._restore_state()
        restore_loop_flags(saved["loop_flags"])
        trainer.callbacks, trainer.loggers = saved["callbacks"], saved["loggers"]  # type: ignore[attr-defined]
        trainer.limit_train_batches, trainer.limit_val_batches, trainer.accumulate_grad_batches = saved["limits"]
        fit_loop.max_epochs, fit_loop.min_epochs, epoch_loop.max_steps, epoch_loop.min_steps = saved["loop_limits"]
        self._restore_modes()
        trainer.state.stage = saved["stage"]
        trainer.should_stop = saved["should_stop"]
        put_metric_states(saved["metrics"])  # not in state_dict: what the run had accumulated, not the trials' updates
        connector = trainer._logger_connector
        connector.reset_results()
        connector.reset_metrics()
        if (data := saved["data"]) is not None:
            fit_loop._combined_loader, fit_loop._data_fetcher, fit_loop.max_batches, trainer.val_check_batch = data
        else:
            fit_loop._combined_loader = None
        epoch_loop.val_loop._combined_loader = None
        fit_loop._last_train_dl_reload_epoch = saved["reload_epoch"]
        put_back_iterators(saved["iterators"])
        # A failed trial was collected in `run`; on an accelerator, cycles may still pin device memory that the
        # run needs (a batch-size trial's activations). On the CPU the collector frees them in its own time.
        release_memory(collect=trainer.strategy.root_device.type != "cpu")
