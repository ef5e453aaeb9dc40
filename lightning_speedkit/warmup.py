"""Step-based LR warmup then decay that multiplies on top of the user's own scheduler and resumes exactly."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_speedkit.checks import is_int
from lightning_speedkit.cooldown import CooldownCheck, check_method, check_window
from lightning_speedkit.hooks import LeanCallback, epoch_start_skipped
from lightning_speedkit.lr import log_step_lrs, scale_trainer_lrs
from lightning_speedkit.restore import ListOf, StateSpec, cached_state_key, check_checkpoints
from lightning_speedkit.schedule import (
    AUTO,
    DECAYS,
    budget_pending,
    budget_steps,
    budget_timer,
    budget_total,
    check_cooldown,
    check_schedule,
    check_warmup,
    factor_at,
    rebudgeted,
    resolve_decay,
    schedule_step,
    scheduler_names,
    time_fraction,
    warmup_factor,
    warmup_steps_of,
)
from lightning_speedkit.step_factor import StepFactor, has_lrs

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["DECAYS", "WarmupScheduler", "warmup_factor"]

_NO_EPOCH = "no epoch started between the schedule's start and the cool-down's (a trial needs an epoch's start)"


class _Schedule(NamedTuple):
    warmup_steps: int
    total_steps: int | None
    start_step: int
    time_start: float = 0.0  # the share of a time budget spent at the start (a warmup over time counts from it)


_NO_BUDGET = (
    "the Trainer cannot tell the fit's length (max_steps=-1, no max_time, and max_epochs=-1 or a train loader"
    " without a length)"
)


class WarmupScheduler(LeanCallback):
    """Linear LR warmup over optimizer steps, then warmup-stable-decay (or cosine, linear, constant), on every group.

    The step is `lightning_speedkit.schedule.schedule_step` (optimizer steps; batches under manual optimization), so
    accumulation counts right and an epoch ``interval`` cannot stretch the warmup. The multiplier is `warmup_factor`
    of the steps since the schedule started; ``total_steps`` defaults to the Trainer's remaining budget
    (`lightning_speedkit.schedule.budget_steps`: ``estimated_stepping_batches``, counted in batches under manual
    optimization), read again on a resume (a run given more epochs ends its schedule there).

    How it composes with your scheduler: the multiplier is applied only *inside* each ``optimizer.step()`` (torch
    step pre/post hooks on every optimizer): each group's LR is multiplied just before the update and put back
    just after. Everywhere else (your ``lr_scheduler`` stepping per step or per epoch, ``ReduceLROnPlateau``,
    manual optimization, checkpoints, ``LearningRateMonitor``) the groups hold your own scheduled LR, untouched.
    So the effective LR is ``your_lr(step) * factor(step)``: a chainable ``StepLR``/``ExponentialLR`` and a
    closed-form ``LambdaLR``/``OneCycleLR`` both keep their own curve and never see ours. If your scheduler already
    decays, pass ``decay="constant"`` (or ``"auto"``, preset's) to add only the warmup; otherwise the two decays
    multiply, and a one-line warning says so. If something else writes a group's LR *during* ``optimizer.step()``,
    its value is kept (not overwritten) and a warning says so. A step an exception ends (or Ctrl-C) leaves no
    multiplier behind, in the optimizer or in a checkpoint written on it (`lightning_speedkit.step_factor`).

    Cooperation (for other callbacks, found by type): `rescale_base_lrs`, `set_warmup_steps`, `restart` (a new
    warmup and decay from the next batch: fine-tuning after pruning), from ``on_fit_start`` or later, outside
    ``optimizer.step()``. Each fit starts again from the constructor arguments at ``setup``; a resume continues the
    schedule in the checkpoint (its warmup, total and start steps; base LRs are Lightning's to checkpoint).

    Args:
        warmup: Warmup length: an int (optimizer steps, 0 for none) or a float in (0, 1) (fraction of total steps,
            rounded up). The default, 0, runs your LR from the first step, as your run without the callback did (a
            ramp only lowers the mean LR); a callback that raises the LR (`LRFinder`, `BatchSizeFinder`) gives the
            raised peak a ramp of at least `lightning_speedkit.lr.RAISED_RAMP` of the steps left.
        decay: After warmup: ``"wsd"`` (hold the LR, then cool down over the last ``cooldown`` of the budget;
            `lightning_speedkit.schedule`), ``"cosine"``, ``"linear"``, ``"constant"``, or ``"auto"``: ``"wsd"``, and
            ``"constant"`` when the run has an LR scheduler of yours (`lightning_speedkit.schedule.resolve_decay`).
        total_steps: Steps of warmup plus decay; None for the Trainer's estimate of the remaining steps.
        min_lr_ratio: Floor of the decay as a fraction of the base LR, in [0, 1].
        cooldown: For ``"wsd"``: the fraction of the budget the cool-down takes, in [0, 1).
        start_factor: Multiplier at the first warmup step, in [0, 1].
        cooldown_check: For ``"wsd"`` with a step budget, whether to hold the LR to the end instead of cooling down
            while the run is still limited by its LR (held, the run at your LR is the constant-LR run). ``"trial"``:
            real steps at the peak LR and at a third of it, from the same state and put back afterwards, at the start
            of the epoch holding the cool-down's start (`lightning_speedkit.cooldown.trial_plan`, `trial_holds`);
            ``"loss"`` (or True): the training loss still falls over as many steps as the cool-down takes
            (`lightning_speedkit.schedule.still_falling`). Off by default; ``report()["cooldown_check"]``.

    Raises:
        ValueError: In ``__init__`` for a bad argument (the message names it and its value); at the first training
            batch if ``warmup`` exceeds the resolved ``total_steps`` or the Trainer cannot estimate its steps.

    Logged metrics (every Trainer logger, rank zero, every ``log_every_n_steps`` steps): ``speedkit/lr/factor`` (the
    multiplier), ``speedkit/lr/opt{i}_group{j}`` (the effective LR of param group ``j`` of optimizer ``i``).

    Example:
        >>> import lightning as L
        >>> trainer = L.Trainer(logger=False, callbacks=[WarmupScheduler(warmup=100, min_lr_ratio=0.1)])
    """

    def __init__(
        self,
        warmup: int | float = 0,
        decay: str = "wsd",
        total_steps: int | None = None,
        min_lr_ratio: float = 0.0,
        start_factor: float = 0.0,
        cooldown: float = 0.2,
        cooldown_check: bool | str = False,
    ) -> None:
        check_warmup(warmup)
        self._method = check_method(cooldown_check)
        self.cooldown_check = cooldown_check
        steps = warmup if isinstance(warmup, int) else 0
        check_schedule(
            steps, total_steps, decay, min_lr_ratio, start_factor, "warmup", check_cooldown(cooldown), (*DECAYS, AUTO)
        )
        self.cooldown = float(cooldown)
        self._time_fraction: float | None = None
        self.warmup, self.decay, self.total_steps = warmup, decay, total_steps
        self._decay = decay  # the decay run: "auto" resolved at fit start (`resolve_decay`)
        self.min_lr_ratio, self.start_factor = min_lr_ratio, start_factor
        self._warmup_spec, self._total_spec = warmup, total_steps
        self._schedule: _Schedule | None = None
        self._steps = StepFactor("WarmupScheduler", self._step_factor, _log_lrs)  # the factor inside each step
        self._resumed = self._provisional = False
        self._check = CooldownCheck()
        self._pinned: float | None = None  # a cool-down trial's multiplier, during its steps

    @property
    @override
    def state_key(self) -> str:
        # "auto" keyed as "wsd", no `cooldown_check`: preset's checkpoints from before either resume
        decay, floor, start = "wsd" if self.decay == AUTO else self.decay, self.min_lr_ratio, self.start_factor
        return cached_state_key(self, warmup=self.warmup, decay=decay, total_steps=self.total_steps,
                                min_lr_ratio=floor, start_factor=start, cooldown=self.cooldown)  # fmt: skip

    state_spec: ClassVar[StateSpec] = {
        "warmup": (int, float),
        "total_steps": (int, None),
        "schedule": (None, {"warmup_steps": int, "total_steps": (int, None), "start_step": int, "time_start": float}),
        "cooldown_check": {
            "losses": ListOf(float),
            "held": (None, bool),
            "drop": (None, float),
            **{"gap": (None, float), "z": (None, float), "probe_s": float, "step": (None, int), "reason": str},
        },
    }
    """What a checkpoint may hold for the warmup (checked before anything is restored: `lightning_speedkit.restore`)."""

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        check_checkpoints(trainer)
        if stage == "fit":  # a checkpoint's state, if any, is loaded after this
            self._warmup_spec, self._total_spec, self._schedule = self.warmup, self.total_steps, None
            self._resumed = False
            self._steps.reset_warning()
            self._check = CooldownCheck()
            self._resume_hooks(("on_train_batch_end",), WarmupScheduler)

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._decay, warning = resolve_decay(self.decay, scheduler_names(trainer))  # as its first fit did, on a resume
        if warning:
            rank_zero_warn(f"WarmupScheduler: {warning}.")

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if epoch_start_skipped(trainer):  # resumed at an epoch's last batch: the next epoch's start is this
            self.on_train_epoch_start(trainer, pl_module)

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        lr_free = not all(has_lrs(optimizer) for optimizer in trainer.optimizers)  # no LR for a trial to cool down
        if self._method == "trial" and not lr_free and self._check_window(trial=True) is not None:  # undecided, "wsd"
            self._attach(trainer)  # a resumed fit's first epoch: no batch has hooked the steps the trial pins yet
            line = self._check.try_at_epoch_start(trainer, self.schedule, self.cooldown, self._pin)  # type: ignore[arg-type]
            if line is not None:
                rank_zero_info(f"WarmupScheduler: {line}.")

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._schedule is None:
            self._resolve(trainer)
        elif self._resumed and self._total_spec is None:  # sized from the Trainer's budget: read it again
            s = self._schedule
            if (total := rebudgeted(s.total_steps, s.start_step, budget_steps(trainer))) is not None:
                rank_zero_info(
                    f"WarmupScheduler: the budget changed since the checkpoint: {total} steps, not {s.total_steps}."
                )
                warmup = warmup_steps_of(self._warmup_spec, total)  # a share of the budget: of the new one
                self._schedule = s._replace(total_steps=total, warmup_steps=warmup)
        self._resumed = False
        t0, share, spent = self._schedule.time_start if self._schedule else 0.0, self._time_share(), self._time_fraction
        ramp = share and (spent or 0.0) < t0 + share * (1.0 - t0)  # a ramp over time: the clock read every step
        self._time_fraction = time_fraction(trainer, self._time_fraction, every=1 if ramp else None)
        self._attach(trainer)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._provisional and self._schedule is not None:  # a batch's optimizer steps are known now
            self._resolve(trainer, self._schedule.start_step)
        window = self._check_window() if self._method == "loss" else None  # a trial watches no loss of the run
        if window is None or self._schedule is None:
            if self._schedule is not None:
                self._skip_hooks(("on_train_batch_end",), WarmupScheduler)  # nothing (more) to watch in this fit
            return
        done = schedule_step(trainer) - self._schedule.start_step  # the schedule's steps, this batch's included
        if window[0] < done <= window[1]:
            self._check.watch(trainer, outputs)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._detach()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._detach()

    @override
    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        self._steps.saved(checkpoint)  # a checkpoint an exception wrote mid-step keeps the user's LR

    @override
    def state_dict(self) -> dict[str, Any]:
        schedule = None if self._schedule is None else self._schedule._asdict()
        spec = {"warmup": self._warmup_spec, "total_steps": self._total_spec}
        return {**spec, "schedule": schedule, "cooldown_check": self._check.state()}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._warmup_spec = state_dict.get("warmup", self._warmup_spec)
        self._total_spec = state_dict.get("total_steps", self._total_spec)
        schedule, self._resumed = state_dict.get("schedule"), True
        fields = {k: v for k, v in (schedule or {}).items() if k in _Schedule._fields}  # an older one: no time_start
        self._schedule = None if schedule is None else _Schedule(**fields)
        self._check = CooldownCheck.from_state(state_dict.get("cooldown_check"))

    @property
    def schedule(self) -> tuple[int, int | None, int] | None:
        """``(warmup_steps, total_steps, start_step)`` once resolved at a training batch, else None."""
        s = self._schedule
        return None if s is None else (s.warmup_steps, s.total_steps, s.start_step)

    def report(self) -> dict[str, Any]:
        """The schedule as a plain dict: what was asked and, once resolved, the steps it runs.

        Keys: ``warmup`` and ``total_steps`` (as asked, or as set by a finder or pruning), ``decay`` (``decay_used``:
        what ``"auto"`` resolved to at fit start),
        ``min_lr_ratio``, ``start_factor``, ``resolved`` (``warmup_steps``, ``total_steps``, ``start_step``; None
        before the first training batch), ``cooldown_check`` (`lightning_speedkit.cooldown.CooldownCheck.report`:
        ``enabled``, ``method``; ``held``: None until decided, then whether the LR is held to the end; the loss
        check's ``drop`` and ``steps`` watched; the trial's ``gap``, ``z``, ``probe_s``, ``step``; the ``reason``
        no verdict was reached), ``probe_s`` (the trial's seconds, 0 without one) and, when an optimizer has no ``lr``
        in its param groups (an LR-free one, whose steps the schedule leaves as they are), ``left_alone``.
        """
        return {
            "warmup": self._warmup_spec,
            "total_steps": self._total_spec,
            "decay": self.decay,
            "decay_used": None if self._decay == AUTO else self._decay,
            **{"min_lr_ratio": self.min_lr_ratio, "start_factor": self.start_factor, "cooldown": self.cooldown},
            "resolved": None if self._schedule is None else dict(self._schedule._asdict()),
            "cooldown_check": self._check.report(self._method),
            "probe_s": self._check.probe_s,
        } | ({"left_alone": list(self._steps.left_alone)} if self._steps.left_alone else {})

    def factor(self, step: int) -> float:
        """The multiplier applied at ``trainer.global_step == step`` (1.0 before the schedule is resolved)."""
        s = self._schedule
        if self._pinned is not None:  # a cool-down trial's side
            return self._pinned
        if s is None:
            return 1.0
        cooldown = 0.0 if self._check.held else self.cooldown  # held: the LR stays at its peak to the end
        done, decay, floor, start = max(0, step - s.start_step), self._decay, self.min_lr_ratio, self.start_factor
        tf, share = self._time_fraction, self._time_share()
        return factor_at(done, s.warmup_steps, s.total_steps, decay, floor, start, cooldown, tf, share, s.time_start)

    def _time_share(self) -> float:
        """A warmup given as a share (a float) of a run with no step budget: its share of the time budget, else 0."""
        s, spec = self._schedule, self._warmup_spec
        return spec if isinstance(spec, float) and s is not None and s.total_steps is None else 0.0

    def rescale_base_lrs(self, trainer: pl.Trainer, factor: float) -> None:
        """Multiply the base LR of every param group and scheduler by ``factor``; the warmup applies on top."""
        scale_trainer_lrs(trainer, factor)

    def set_warmup_steps(self, warmup_steps: int | float) -> None:
        """Make the warmup ``warmup_steps`` steps long (a float: a share of the budget, of its time if no step one)."""
        total = None if self._schedule is None else self._schedule.total_steps
        check_warmup(warmup_steps)
        steps = warmup_steps_of(warmup_steps, total)
        check_schedule(steps, total, "constant", 0.0, 0.0)
        self._warmup_spec = warmup_steps
        if self._schedule is not None:
            self._schedule = self._schedule._replace(warmup_steps=steps)

    def restart(self, warmup: int | float, total_steps: int | None = None) -> None:
        """Start a new warmup and decay at the next training batch (``total_steps`` None: the remaining steps)."""
        check_warmup(warmup)
        if total_steps is not None:
            steps = warmup if isinstance(warmup, int) else 0
            check_schedule(steps, total_steps, "constant", 0.0, 0.0, "warmup")
        self._warmup_spec, self._total_spec, self._schedule = warmup, total_steps, None
        self._check = CooldownCheck()
        self._resume_hooks(("on_train_batch_end",), WarmupScheduler)

    def _check_window(self, trial: bool = False) -> tuple[int, int] | None:
        """`cooldown.check_window`; None when the check is off or decided, or there is no "wsd" step budget to check.

        A time budget cools down by the clock.
        """
        s, off = self._schedule, self._method is None or self._check.held is not None or self._decay != "wsd"
        if off or s is None or s.total_steps is None or self._time_fraction is not None:
            return None
        return check_window(s.warmup_steps, s.total_steps, self.cooldown, trial)

    def _decide_cooldown(self, step: int) -> None:
        """At the cool-down's first step: hold the LR when the loss watched before it still falls (no trial ran)."""
        window = self._check_window(trial=self._method == "trial")
        if window is not None and self._schedule is not None and step - self._schedule.start_step >= window[1]:
            line = self._check.decide() if self._method == "loss" else self._check.skip(_NO_EPOCH)
            rank_zero_info(f"WarmupScheduler: {line}.")

    def _pin(self, factor: float | None) -> None:
        """Fix the multiplier at ``factor`` for a cool-down trial's steps (None: the schedule's again)."""
        self._pinned = factor

    def _resolve(self, trainer: pl.Trainer, start: int | None = None) -> None:
        start = schedule_step(trainer) if start is None else start
        total, warmup = self._total_spec, self._warmup_spec
        self._provisional = total is None and budget_pending(trainer, start)  # resolved again after the first batch
        if total is None:
            total = budget_total(budget_steps(trainer), start)
        timed = budget_timer(trainer) is not None
        if not is_int(warmup):  # a share of the steps; of the time when there is no step budget (`_time_share`)
            if total is None and not timed:
                raise ValueError(f"`warmup` as a fraction ({warmup}) needs `total_steps`, got None: pass total_steps.")
            warmup = warmup_steps_of(warmup, total)
        if total is None and self._decay != "constant" and not timed and self.decay == AUTO:
            self._decay = "constant"  # preset's default: a run of unknown length keeps the LR, as without a schedule
            rank_zero_info(f"WarmupScheduler: {_NO_BUDGET}: no cool-down, the LR stays at its peak.")
        if total is None and self._decay != "constant" and not timed:
            raise ValueError(
                f"`total_steps` is needed for decay={self._decay!r}, got None, and {_NO_BUDGET}: pass total_steps,"
                " max_steps or max_time."
            )
        check_schedule(int(warmup), total, self._decay, self.min_lr_ratio, self.start_factor, "warmup", self.cooldown)
        self._schedule = _Schedule(int(warmup), total, start, (timed and time_fraction(trainer, None)) or 0.0)
        if self._provisional:
            return
        budget = f"{total} steps" if total is not None else "the time budget" if timed else "a run of unknown length"
        budget += " or the time budget, whichever ends first" if timed and total is not None else ""
        shape = f"wsd (cool-down over the last {self.cooldown:.0%})" if self._decay == "wsd" else self._decay
        ramp = f"a warmup over {share:.0%} of the time" if (share := self._time_share()) else f"{warmup} warmup steps"
        rank_zero_info(
            f"WarmupScheduler: {ramp}, then {shape} decay over {budget}"
            f" (floor {self.min_lr_ratio} x base LR), from global step {start}."
        )

    def _step_factor(self, trainer: pl.Trainer, index: int) -> float | None:
        """The multiplier of this optimizer step (None before the schedule is resolved), the cool-down decided."""
        if self._schedule is None:
            return None
        step = schedule_step(trainer)
        if self._check.held is None and self._pinned is None:
            self._decide_cooldown(step)
        return self.factor(step)

    def _attach(self, trainer: pl.Trainer) -> None:
        self._steps.attach(trainer)

    def _detach(self) -> None:
        self._steps.detach()


def _log_lrs(trainer: pl.Trainer, index: int, factor: float, lrs: list[Any]) -> None:
    log_step_lrs(trainer, index, factor, lrs, schedule_step(trainer))
