"""The `BatchSizeFinder` callback: search at fit start, apply the size, rescale the LR, remember it for a resume."""

from __future__ import annotations

import logging
import time
import weakref
from typing import TYPE_CHECKING, Any, ClassVar

from lightning.pytorch.callbacks import Callback, GradientAccumulationScheduler
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.parsing import lightning_getattr, lightning_hasattr, lightning_setattr
from typing_extensions import override

from lightning_speedkit.batch_size.search import (
    LR_SCALINGS,
    MODES,
    OBJECTIVES,
    apply_margin,
    choose_batch_size,
    hold_global_batch,
    lr_scale_factor,
    next_trial_size,
    run_cap,
)
from lightning_speedkit.checks import check_bool, check_choice, check_int, check_margin, check_number, is_int
from lightning_speedkit.lr import rescale_run_lrs
from lightning_speedkit.restore import ListOf, StateSpec
from lightning_speedkit.trials import BatchSize, Decision, Lever, TrialResult, TrialSession
from lightning_speedkit.trials.loaders import forget_peeks
from lightning_speedkit.trials.measure import estimated_steps

if TYPE_CHECKING:
    import lightning.pytorch as pl

log = logging.getLogger(__name__)

__all__ = ["BatchSizeFinder"]


class BatchSizeFinder(Lever):
    """Find the per-device batch size at fit start with real trial steps, apply it, and rescale the LR to match.

    Each trial trains ``steps_per_trial`` full batches of exactly the size tried (each a full optimizer step) and
    validates one batch, through the Trainer's own loops; sizes are tried from ``init_val`` (default: the size you
    configured) up to the cap (``max_val`` and the per-rank dataset length; the cap itself is tried, never passed).
    ``objective="memory"`` keeps the largest size that fit, less ``margin`` when a size failed; ``"throughput"``
    keeps the smallest size within ``throughput_tolerance`` of the fastest. The final size is verified by a trial if
    it was not tried. Afterwards weights, optimizer, scheduler, precision and loop states, RNG states and modes are
    as before the search. Out-of-memory errors are recognised by type and message (`lightning_speedkit.oom`);
    anything else is raised.

    With several ranks (``ddp``, ``ddp_spawn``) every rank tries the same size and the verdict is all-reduced, so all
    ranks keep the same size, safe for the rank with the least memory. Then the global batch (per device x world
    size x ``accumulate_grad_batches``) is compared with ``reference_batch_size`` (default: the global batch you
    configured) and the LR is scaled by ``lr_scaling`` (param groups' ``lr`` and ``initial_lr`` and schedulers'
    ``base_lrs``, via `lightning_speedkit.lr`). A warmup callback in ``trainer.callbacks`` (`WarmupScheduler`) is
    asked to rescale its base LRs and, when the LR grows, to lengthen its warmup in proportion. With
    ``keep_global_batch=True`` the global batch is held by changing ``accumulate_grad_batches`` and the LR is left
    alone. The decision is saved in checkpoints; a resumed fit applies it again without searching (the life cycle is
    `lightning_speedkit.trials.Lever`'s: ``decision`` is the size, ``extra`` holds ``batch_size``, ``lr_scale``,
    ``accumulate_grad_batches``, ``global_batch``, ``trials``...).

    Args:
        mode: ``"binsearch"`` (double, then bisect between the last fit and the first failure) or ``"power"``.
        init_val: First size tried; None for the configured size.
        max_val: Largest size tried; None for no limit but the dataset (on CPU the memory objective needs it).
        margin: Fraction taken off the largest size that fit when a larger one failed, in [0, 1).
        steps_per_trial: Training batches per trial, each a full optimizer step; None for 2 with ``"memory"`` (the
            second step is the first to hold activations, gradients and optimizer state together) and 3 with
            ``"throughput"`` (the first step is warm-up and is not timed). At least 2 for ``"throughput"``.
        max_trials: Most trials in the search (a verification trial comes on top).
        lr_scaling: ``"linear"``, ``"sqrt"`` or ``"none"``.
        reference_batch_size: Global batch the LR was tuned for; None for the configured global batch.
        keep_global_batch: Hold the global batch with gradient accumulation instead of scaling the LR.
        objective: ``"memory"`` or ``"throughput"``.
        throughput_tolerance: For ``"throughput"``: how far below the best samples/s a smaller size may be.
        batch_arg_name: The batch-size attribute on the model, its ``hparams`` or the datamodule.
        remember: Remember the decision across runs (`lightning_speedkit.trials.memory`): a later run with the same
            fingerprint (model, batch, loader, devices, hardware, versions, arguments) applies it without probing.

    Raises:
        ValueError: In ``__init__`` for a bad argument; in ``setup`` when the run cannot be searched (no batch-size
            attribute, dataloaders passed straight to ``fit``, an unsupported strategy, the memory objective on CPU
            without ``max_val``); at fit start if a batch of 1 does not fit or the dataloader ignores the attribute.

    Logged metrics (rank zero, every Trainer logger, at fit start): ``speedkit/batch_size`` (per device),
    ``speedkit/lr_scale``, ``speedkit/accumulate_grad_batches``.

    Example:
        >>> import lightning as L
        >>> trainer = L.Trainer(logger=False, callbacks=[BatchSizeFinder(max_val=512, lr_scaling="sqrt")])
    """

    AREA = "batch_size"
    EXTRA_SPEC: ClassVar[StateSpec] = {
        "batch_size": int,
        "accumulate_grad_batches": int,
        "lr_scale": float,
        "configured_batch_size": int,
        "world_size": int,
        "global_batch": int,
        "search_s": float,
        "trials": ListOf(dict),
    }

    def __init__(
        self,
        mode: str = "binsearch",
        init_val: int | None = None,
        max_val: int | None = None,
        margin: float = 0.1,
        steps_per_trial: int | None = None,
        max_trials: int = 25,
        lr_scaling: str = "linear",
        reference_batch_size: int | None = None,
        keep_global_batch: bool = False,
        objective: str = "memory",
        throughput_tolerance: float = 0.05,
        batch_arg_name: str = "batch_size",
        remember: bool = True,
    ) -> None:
        self.remember = check_bool("remember", remember)
        check_choice("mode", mode, MODES)
        check_choice("lr_scaling", lr_scaling, LR_SCALINGS)
        check_choice("objective", objective, OBJECTIVES)
        check_int("init_val", init_val, optional=True)
        check_int("max_val", max_val, optional=True)
        if init_val is not None and max_val is not None and init_val > max_val:
            raise ValueError(f"`init_val` must not exceed `max_val` ({max_val}), got {init_val}.")
        check_int("reference_batch_size", reference_batch_size, optional=True)
        check_margin("margin", margin)
        if steps_per_trial is None:
            steps_per_trial = 3 if objective == "throughput" else 2
        if not is_int(steps_per_trial, low=2 if objective == "throughput" else 1):
            raise ValueError(
                f"`steps_per_trial` must be an int >= {2 if objective == 'throughput' else 1}"
                f"{' for objective=throughput' if objective == 'throughput' else ''}, got {steps_per_trial!r}."
            )
        check_int("max_trials", max_trials)
        check_number("throughput_tolerance", throughput_tolerance, 0, 1, open_high=True)
        check_bool("keep_global_batch", keep_global_batch)
        if not isinstance(batch_arg_name, str) or not batch_arg_name:
            raise ValueError(f"`batch_arg_name` must be a non-empty str, got {batch_arg_name!r}.")
        self.mode, self.init_val, self.max_val, self.margin = mode, init_val, max_val, float(margin)
        self.steps_per_trial, self.max_trials = steps_per_trial, max_trials
        self.lr_scaling, self.reference_batch_size, self.keep_global_batch = (
            lr_scaling,
            reference_batch_size,
            keep_global_batch,
        )
        self.objective, self.throughput_tolerance, self.batch_arg_name = objective, throughput_tolerance, batch_arg_name

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if stage != "fit":
            return
        self._decision = None  # a checkpoint's decision, if any, is loaded after this
        strategy = trainer.strategy
        if not isinstance(strategy, (SingleDeviceStrategy, DDPStrategy)) or strategy.restore_checkpoint_after_setup:
            raise ValueError(
                f"BatchSizeFinder supports single-device and DDP strategies (ddp, ddp_spawn), got"
                f" {type(strategy).__name__}: find the size with one of them, then set it."
            )
        if not trainer.fit_loop._data_source.is_module():
            raise ValueError(
                "BatchSizeFinder cannot change the batch size of dataloaders passed straight to `fit()`: return them"
                " from `train_dataloader()` of your LightningModule or LightningDataModule, built from"
                f" `self.{self.batch_arg_name}`."
            )
        if not lightning_hasattr(pl_module, self.batch_arg_name):
            raise ValueError(
                f"BatchSizeFinder: no `{self.batch_arg_name}` on the model, its hparams or the datamodule: add the"
                " attribute, build the train DataLoader from it, or pass `batch_arg_name`."
            )
        if self.objective == "memory" and self.max_val is None and strategy.root_device.type == "cpu":
            raise ValueError(
                "BatchSizeFinder(objective='memory') on CPU never sees an out-of-memory error and would grow to the"
                " dataset length: pass `max_val`, or use objective='throughput'."
            )
        callbacks: list[Callback] = trainer.callbacks  # type: ignore[attr-defined]
        if self.keep_global_batch and any(isinstance(c, GradientAccumulationScheduler) for c in callbacks):
            raise ValueError(
                "BatchSizeFinder(keep_global_batch=True) sets `accumulate_grad_batches`, which a"
                " GradientAccumulationScheduler would overwrite: remove one of them."
            )

    @override
    def decide(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> Decision:
        """The search, unless ``fast_dev_run`` is on or the fit resumes without a decision (the size is then kept)."""
        configured = str(lightning_getattr(pl_module, self.batch_arg_name))
        if trainer.fast_dev_run:  # type: ignore[attr-defined]
            return Decision.skipped(configured, "skipped: `fast_dev_run` is on")
        resumed = self.resumed_without_decision(trainer)
        if resumed:
            return Decision.skipped(configured, resumed + " (searching now would fight the restored optimizer state)")
        found = self._search(trainer, pl_module)
        reason, seconds = found.pop("reason"), found["search_s"]
        return Decision(str(found["batch_size"]), reason, True, seconds, source="measured", extra=found)

    @override
    def apply(self, trainer: pl.Trainer, pl_module: pl.LightningModule, decision: Decision) -> None:
        if "batch_size" in decision.extra:
            self._apply(trainer, pl_module, decision, resumed=decision.source == "resumed")

    @override
    def metrics(self, decision: Decision) -> dict[str, float]:
        found = decision.extra
        if "batch_size" not in found:
            return {}
        return {
            "speedkit/batch_size": float(found["batch_size"]),
            "speedkit/lr_scale": float(found["lr_scale"]),
            "speedkit/accumulate_grad_batches": float(found["accumulate_grad_batches"]),
        }

    def _search(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        started = time.perf_counter()
        configured = int(lightning_getattr(pl_module, self.batch_arg_name))  # type: ignore[arg-type]
        origin, applied = _APPLIED.get(pl_module, (configured, configured))
        configured = origin if applied == configured else configured  # the size an earlier fit found: not the user's
        world, accumulation = trainer.world_size, trainer.accumulate_grad_batches
        mode = "power" if self.objective == "throughput" else self.mode
        trials: list[TrialResult] = []
        results: dict[int, bool] = {}
        speeds: dict[int, float] = {}
        warmup = min(1, self.steps_per_trial - 1)
        with TrialSession(trainer, self.steps_per_trial, warmup=warmup, validate=True) as session:
            per_rank = session.samples_per_rank()
            settings = (trainer.limit_train_batches, trainer.val_check_interval, trainer.check_val_every_n_epoch)
            fits_run = None if per_rank is None else run_cap(per_rank, *settings)
            cap = min(v for v in (self.max_val, per_rank, fits_run, 2**31) if v is not None)
            init = self.init_val or configured
            while len(trials) < self.max_trials:
                size = next_trial_size(mode, results, init, cap)
                if size is None:
                    break
                trial = self._trial(session, size, per_rank)
                trials.append(trial)
                results[size] = trial.fits
                if self.objective == "throughput" and trial.fits and trial.samples_per_s is not None:
                    speeds[size] = trial.samples_per_s
                    if trial.samples_per_s < (1 - self.throughput_tolerance) * max(speeds.values()):
                        break  # bigger got slower: stop growing
            choice = choose_batch_size(results, self.margin, speeds or None, self.throughput_tolerance)
            size = choice.size
            while size is not None and not results.get(size, False):  # verify a size no trial ran
                trial = self._trial(session, size, per_rank)
                trials.append(trial)
                results[size] = trial.fits
                if not trial.fits:
                    size = None if size == 1 else apply_margin(size, self.margin) if self.margin else size - 1
        if size is None:
            fix = "make the model or its inputs smaller, or use gradient checkpointing"
            if min(results) > 1:  # the search stopped before it got to 1
                fix = f"the search stopped at `max_trials`={self.max_trials}: raise it, or lower `init_val`"
            raise ValueError(
                f"BatchSizeFinder: even a batch of {min(results)} ran out of memory ({trials[-1].error}); {fix}."
            )
        reason = choice.reason if size == choice.size else f"{choice.reason}; {choice.size} failed verification"
        reason += f"; cap {cap}" if cap == max(results) and results[cap] else ""
        if self.keep_global_batch:
            target = self.reference_batch_size or configured * world * accumulation
            size, accumulation = hold_global_batch(target, size, world)
            scale = 1.0
        else:
            reference = self.reference_batch_size or configured * world * accumulation
            scale = lr_scale_factor(size * world * accumulation, reference, self.lr_scaling)
        return {
            "batch_size": size,
            "accumulate_grad_batches": accumulation,
            "lr_scale": scale,
            "configured_batch_size": configured,
            "world_size": world,
            "global_batch": size * world * accumulation,
            "reason": reason,
            "search_s": time.perf_counter() - started,
            "trials": [
                {"size": int(t.setting), "fits": t.fits, "samples_per_s": t.samples_per_s, "error": t.error}
                for t in trials
            ],
        }

    def _trial(self, session: TrialSession, size: int, per_rank: int | None) -> TrialResult:
        """Train full batches of ``size`` (spanning epochs when the loader holds fewer) and validate one."""
        full_batches = self.steps_per_trial if per_rank is None else per_rank // size
        return session.run(BatchSize(self.batch_arg_name, size), max_batches=full_batches)

    def _apply(self, trainer: pl.Trainer, pl_module: pl.LightningModule, decision: Decision, resumed: bool) -> None:
        found = decision.extra
        size, accumulation, scale = found["batch_size"], found["accumulate_grad_batches"], found["lr_scale"]
        before = 0.0 if resumed else estimated_steps(trainer)  # the steps the user's schedulers were sized for
        lightning_setattr(pl_module, self.batch_arg_name, size)
        _APPLIED[pl_module] = (found["configured_batch_size"], size)
        if self.keep_global_batch:  # else the accumulation is the user's, a resumed fit's new one too
            trainer.accumulate_grad_batches = accumulation
        trainer.fit_loop._combined_loader = None
        trainer.fit_loop.epoch_loop.val_loop._combined_loader = None
        forget_peeks(trainer)  # the loader is built again, of batches of the new size
        if resumed:  # the LR and the warmup are restored with the optimizers, schedulers and warmup callback
            if found.get("world_size", trainer.world_size) != trainer.world_size:
                rank_zero_warn(
                    f"BatchSizeFinder: resumed on {trainer.world_size} devices but the size was found on"
                    f" {found['world_size']}; the global batch and its LR scale differ from the original run."
                )
        else:
            check_sized_schedulers(trainer, before, estimated_steps(trainer))
            if scale != 1.0:
                rescale_run_lrs(trainer, scale)
            searched = (
                f"{len(found['trials'])} trials in {found['search_s']:.1f} s"
                if decision.source == "measured"
                else f"{decision.source}, no search"
            )
            rank_zero_info(
                f"BatchSizeFinder: batch size {found['configured_batch_size']} -> {size} per device"
                f" ({decision.reason}); global batch {found['global_batch']} = {size} x {trainer.world_size}"
                f" device(s) x {accumulation} accumulation; LR x{scale:.4g} ({self.lr_scaling}); "
                f"{searched}."
            )


_APPLIED: weakref.WeakKeyDictionary[Any, tuple[int, int]] = weakref.WeakKeyDictionary()
"""The batch size the user configured on a module and the size written over it: a later fit of the same module reads
the written size back, and must search and scale the LR from the user's (the optimizer is built from their LR)."""


_LENGTHS = ("total_steps", "T_max", "total_iters")
"""Scheduler attributes that hold its length in steps: ``OneCycleLR``'s, ``CosineAnnealingLR``'s, ``LinearLR``'s."""


def check_sized_schedulers(trainer: pl.Trainer, before: float, after: float) -> None:
    """Name a step-interval LR scheduler sized for the fit's ``before`` steps when a new batch makes them ``after``.

    ``configure_optimizers`` ran before the batch size was found, so a schedule sized from
    ``trainer.estimated_stepping_batches`` is not the fit's length any more: a longer fit steps ``OneCycleLR`` past
    its end (torch raises there, mid-fit: raised here, before a step), a shorter one ends before the schedule does.

    Raises:
        ValueError: For a ``OneCycleLR`` of ``before`` total steps in a fit now longer.
    """
    if after == before:
        return
    for config in trainer.lr_scheduler_configs:
        scheduler, name = config.scheduler, type(config.scheduler).__name__
        if config.interval != "step" or all(getattr(scheduler, a, None) != before for a in _LENGTHS):
            continue
        problem = (
            f"BatchSizeFinder: the new batch size makes the fit {after:g} optimizer steps, but your {name} was sized"
            f" for {before:g} in `configure_optimizers`, before the batch was found"
        )
        fix = "pass the batch size the finder found (its report), or leave the schedule to `WarmupScheduler`"
        if name == "OneCycleLR" and after > before:
            raise ValueError(f"{problem}: it would raise at step {before + 1:g}; {fix}.")
        rank_zero_warn(f"{problem}: its schedule {'ends early' if after > before else 'is cut short'}; {fix}.")
