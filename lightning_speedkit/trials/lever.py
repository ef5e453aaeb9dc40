"""The lever contract, written once: `Decision` (what a lever decided, and why) and `Lever` (its life cycle).

A speed lever (ChannelsLast, PrecisionTuner, FusedOptimizer, DataLoaderTuner, BatchSizeFinder, LRFinder, Compile)
fills in what is particular to it and inherits the rest:

- ``AREA`` (its metric namespace, ``speedkit/<AREA>/...``) and ``MAX_GAIN`` (the payback rule's best case);
- `Lever.plan`: the setting in place and the settings to try, or a `Decision` saying why there is nothing to
  measure (the default `Lever.decide` measures them with `lightning_speedkit.trials.measure`);
- `Lever.apply`: put a decision in place (on a resume too, from the checkpoint's decision);
- `Lever.decide` itself only when it decides otherwise (a search, a range test, a compile's payback).

The base gives each lever the same life cycle: a ``state_key`` from its constructor arguments (two instances coexist
in one checkpoint), the decision in ``state_dict`` (checked before any restore: `lightning_speedkit.restore`), one
resume rule (a checkpoint's decision is applied without probing; a resumed fit whose checkpoint holds none keeps the
setting in place and says so), one order at fit start (decide -> log -> apply) and one `report`.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import Self, override

from lightning_speedkit.decisions import counted_cost, fitted_block
from lightning_speedkit.hooks import LeanCallback
from lightning_speedkit.report import log_rank_zero
from lightning_speedkit.restore import StateSpec, cached_state_key, check_checkpoints
from lightning_speedkit.trials.decision import DECISION_SPEC, SOURCES, Decision
from lightning_speedkit.trials.loaders import forget_peeks

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_speedkit.trials.counted import CountedTrials
    from lightning_speedkit.trials.memory import Remembering
    from lightning_speedkit.trials.settings import LeaveOut, Setting, TrialResult

__all__ = ["DECISION_SPEC", "SOURCES", "Decision", "Lever"]

_OWN_STEP_HOOKS = ("on_train_batch_start", "on_train_batch_end")
"""A lever's step hooks: needed while its counted trials or its memory's live check time steps, then skipped
(`lightning_speedkit.hooks.LeanCallback`) until the next fit starts."""


class Lever(LeanCallback):
    """The life cycle every speed lever shares; a lever fills in `plan` and `apply` (and `decide` if it must).

    At ``on_fit_start``, in this order: a decision from a checkpoint is taken as it is (no probe); a resumed fit
    whose checkpoint holds none keeps the setting in place (its steps left and optimizer state belong to the run as it
    was), unless it was written while the counted trials ran: they start again; an earlier fit's decision, or one
    remembered from an earlier run, is taken when it `holds` for this fit; otherwise `decide`. A new decision is
    logged (``speedkit/<AREA>/<setting>_step_ms``, ``speedkit/<AREA>/probe_s``), then `apply` puts it in place on
    every rank. The decision is the lever's state.
    """

    AREA: ClassVar[str] = ""
    """The metric namespace: ``speedkit/<AREA>/...``."""

    MAX_GAIN: ClassVar[float] = 0.5
    """The most this lever is taken to save of a step, for the payback rule (`lightning_speedkit.decisions`)."""

    WARMUP: ClassVar[int] = 1
    """Leading steps of each trial left out of its median step time."""

    LEGACY_STATE_KEYS: ClassVar[tuple[str, ...]] = ()
    """Keys earlier versions saved the decision under (read, never written)."""

    EXTRA_SPEC: ClassVar[StateSpec] = {}
    """What the lever's own fields of a saved decision may be (beside `DECISION_SPEC`)."""

    COUNTED: ClassVar[bool] = False
    """Whether the lever probes on counted trials (`lightning_speedkit.trials.counted`) when no setting changes math."""

    MIN_BLOCK: ClassVar[int | None] = None
    """With a value, counted blocks are fitted to the run (`~lightning_speedkit.trials.counted.fitted_block`): the
    longest it repays, from ``probe_steps`` down to this many steps."""
    COUNTED_ROUNDS: ClassVar[int] = 3
    """Rounds of counted blocks (`~lightning_speedkit.trials.counted.COUNTED_ROUNDS`); more for short blocks."""

    probe_steps: int
    margin: float
    remember: bool = True
    """Whether decisions are remembered across runs (`lightning_speedkit.trials.memory`); each lever's argument."""
    loss_tolerance: float | None = None
    """With a value, a candidate whose trial losses are non-finite or this much worse is rejected."""
    _arguments: dict[str, Any]
    _decision: Decision | None
    _memory: Remembering | None
    _counted: CountedTrials | None
    _deciding: bool  # resumed from a checkpoint written while the lever's counted trials ran: probe again
    _job: str | None  # this fit's job key, taken at fit start (`holds`)

    def __new__(cls, *args: Any, **kwargs: Any) -> Self:
        """Record the constructor's arguments, for `state_key` (every lever's arguments have defaults)."""
        lever = super().__new__(cls)
        try:
            bound = inspect.signature(cls.__init__).bind(None, *args, **kwargs)
        except TypeError as error:  # a misspelt or extra argument: named with the class, as `__init__` would be
            raise TypeError(f"{cls.__name__}: {error}") from None
        bound.apply_defaults()
        lever._arguments = dict(list(bound.arguments.items())[1:])
        lever._decision = lever._memory = lever._counted = lever._job = None
        lever._deciding = False
        return lever

    @property
    def state_spec(self) -> StateSpec:
        """What a checkpoint may hold for this lever: its decision (`DECISION_SPEC` and `EXTRA_SPEC`), or None."""
        decision = {**DECISION_SPEC, **self.EXTRA_SPEC}
        return {**dict.fromkeys(("decision", *self.LEGACY_STATE_KEYS), (None, decision)), "deciding": bool}

    @property
    @override
    def state_key(self) -> str:
        cached = self.__dict__.get("_speedkit_state_key")  # read on every hook call: the arguments never change
        if cached is not None:
            return str(cached[1])
        shown = {name: value if isinstance(value, (int, float, str, bool, type(None))) else repr(value)
                 for name, value in self._arguments.items() if name != "remember"}  # fmt: skip
        return cached_state_key(self, **shown)

    @property
    def decision(self) -> Decision | None:
        """The decision in use (None before fit start)."""
        return self._decision

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        check_checkpoints(trainer)
        forget_peeks(trainer)  # a new fit: its train loader is read afresh
        if stage == "fit":  # an earlier fit an exception ended mid-probe left its trials: not this fit's
            self._counted, self._deciding = None, False

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from lightning_speedkit.trials.job import fingerprint_key, read_fingerprint
        from lightning_speedkit.trials.memory import Remembering

        self._resume_hooks(_OWN_STEP_HOOKS, Lever)
        resuming = trainer.ckpt_path is not None  # its decision is the checkpoint's: no job to compare (no sample read)
        print_, unread = (None, "") if resuming else read_fingerprint(trainer, self.state_key)  # the memory's too
        self._job = None if print_ is None else fingerprint_key(print_)
        kept = self._decision  # from a checkpoint, made at setup, or an earlier fit's (which may not hold for this one)
        if kept is not None and (kept.source == "resumed" or self.holds(trainer, kept)):
            self.apply(trainer, pl_module, kept)
            rank_zero_info(f"{type(self).__name__}: {kept.decision} ({self._describe(kept)}).")
            return
        self._decision, self._memory = None, (memory := Remembering(self.remember))
        recalled = None if resuming else memory.recall(trainer, print_, unread)
        if recalled is not None and not self.holds(trainer, recalled):
            recalled, memory.note = None, "the remembered decision does not hold for this run: decided again"
        decision = recalled or self.decide(trainer, pl_module)
        if decision is not None:  # None: counted trials decide on the first training steps
            self._settle(trainer, pl_module, decision, store=recalled is None)

    def _settle(self, trainer: pl.Trainer, pl_module: pl.LightningModule, decision: Decision, store: bool) -> None:
        """The one order: a new decision is stored and logged, then every decision is applied."""
        self._decision = decision = self.finish(decision)
        decision.extra.setdefault("job", self._job)  # what `holds` compares a later fit's job with
        if store and self._memory is not None:
            self._memory.store(trainer, decision)
        self._log(trainer, decision)
        self.apply(trainer, pl_module, decision)
        rank_zero_info(f"{type(self).__name__}: {decision.decision} ({self._describe(decision)}).")

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._counted is not None:
            self._counted.step_started(trainer)
        elif self._memory is not None:
            self._memory.step_started(trainer)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._counted is not None:
            decision = self._counted.step_ended(trainer, outputs)
            if decision is not None:
                self._counted = None
                self._settle(trainer, pl_module, decision, store=True)
        elif self._memory is not None and self._decision is not None:
            self._memory.step_ended(trainer, self._decision)
        if self._counted is None and (self._memory is None or not self._memory.timing):
            self._skip_hooks(_OWN_STEP_HOOKS, Lever)  # decided, nothing left to time: off until the next fit starts

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._counted is not None:  # the run ended inside the counted window (early stopping): keep what was
            counted, self._counted = self._counted, None
            counted.stop(trainer)
            reason = "training ended before the counted trials did: the setting in place was kept"
            self._settle(trainer, pl_module, Decision.skipped(counted.current.name, reason), store=False)

    def plan(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> tuple[Setting, Sequence[Setting]] | Decision:
        """The setting in place and the settings to try, or the decision to keep when there is nothing to measure."""
        raise NotImplementedError

    def decide(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> Decision | None:
        """Measure the candidates of `plan` against the setting in place.

        On counted trials when the lever takes them (`COUNTED`) and no setting changes the math: the decision then
        comes after the first training steps (this returns None); else on restored trials (`trials.measure`).
        """
        from lightning_speedkit.trials.measure import PROBE_ROUNDS, measure, probe_cost

        plan = self.plan(trainer, pl_module)
        if isinstance(plan, Decision):
            return plan
        current, others = plan
        resumed = self.resumed_without_decision(trainer)
        if resumed:
            return Decision.skipped(current.name, resumed)
        if not others:
            return Decision.skipped(current.name, f"nothing to try: {current.name} is the only setting")
        if self.COUNTED and not any(s.changes_math for s in (current, *others)):
            settings, block = 1 + len(others), self.block_steps(trainer, 1 + len(others))
            cost = counted_cost(settings, block, self.COUNTED_ROUNDS, self.margin)
            pays, why, left = probe_cost(trainer, cost, self.MAX_GAIN)
            if not pays:
                return Decision(current.name, why, source="skipped", extra={"steps_left": left, "counted": True})
            self._counted = self.counted_trials(current, others, block, warmup=min(self.WARMUP, block - 1))
            self._counted.join(trainer)
            return None
        steps, warmup, tolerance = self.probe_steps, min(self.WARMUP, self.probe_steps - 1), self.loss_tolerance
        rounds, after = PROBE_ROUNDS, self.after_reference
        return measure(trainer, current, others, steps, self.margin, self.MAX_GAIN, warmup, rounds, tolerance, after)

    def block_steps(self, trainer: pl.Trainer, settings: int) -> int:
        """Steps per block of a counted probe of ``settings`` settings: ``probe_steps``, or fitted with `MIN_BLOCK`."""
        from lightning_speedkit.trials import steps_left

        if self.MIN_BLOCK is None:
            return self.probe_steps
        shortest, left = min(self.MIN_BLOCK, self.probe_steps), steps_left(trainer)
        return fitted_block(self.probe_steps, shortest, settings, left, self.MAX_GAIN, self.COUNTED_ROUNDS, self.margin)

    def after_reference(self, result: TrialResult, waits: list[float], steps_left: float) -> str | LeaveOut:
        """After the setting in place's restored trial: why to keep it, "" to try the others, a `LeaveOut` for some.

        ``waits``: that trial's steps' waits for data (rank zero's, the same on every rank); ``steps_left``: before it.
        """
        return ""

    def counted_trials(self, current: Setting, others: Sequence[Setting], steps: int, warmup: int) -> CountedTrials:
        """The counted probe of ``current`` against ``others`` (a lever with its own rules between blocks overrides)."""
        from lightning_speedkit.trials.counted import CountedTrials

        return CountedTrials(current, others, steps, self.margin, warmup=warmup, rounds=self.COUNTED_ROUNDS)

    def holds(self, trainer: pl.Trainer, decision: Decision) -> bool:
        """Whether an earlier fit's or run's ``decision`` holds for this fit (else the lever decides again).

        By default when it was made for the same job (the key of `lightning_speedkit.trials.job.fingerprint` at fit
        start: the model, the data, the devices...): a second fit of another model decides again.
        """
        made_for = decision.extra.get("job")
        return made_for is None or made_for == self._job

    def finish(self, decision: Decision) -> Decision:
        """A new decision, completed with the lever's own fields before it is stored, logged and applied."""
        return decision

    def apply(self, trainer: pl.Trainer, pl_module: pl.LightningModule, decision: Decision) -> None:
        """Put ``decision`` in place (also on a resume, where ``decision.source`` is ``"resumed"``)."""
        raise NotImplementedError

    def resumed_without_decision(self, trainer: pl.Trainer) -> str:
        """The one resume rule: no decision of this lever in the checkpoint, no probe (unless written mid-probe)."""
        if trainer.ckpt_path is None or self._deciding:
            return ""
        return (
            f"skipped: resumed from a checkpoint without a {type(self).__name__} decision (the run it continues"
            " did not have one); the setting in place is kept"
        )

    def rolled_back(self, trainer: pl.Trainer, step: int) -> None:
        """A rollback (`TrainingGuard`'s) put the state of ``step`` back: a counted probe's block keeps that state.

        A probe that copied the state at a block's start, to undo the block, drops the copy (its ``keep_run_state``):
        put back at the block's end, it would undo the rollback and its LR backoff.
        """
        keep = getattr(self._counted, "keep_run_state", None)
        if callable(keep):
            keep()

    def report(self) -> dict[str, Any]:
        """The decision (`Decision.summary`) after the lever's own `status`, and `~.memory`'s notes; {} before one."""
        memory = self._memory.report() if self._memory is not None else {"remember": self.remember}
        return {**self.status(), **(self._decision.summary() if self._decision is not None else {}), **memory}

    def status(self) -> dict[str, Any]:
        """What the lever reports beside its decision (e.g. how many tensors it converted)."""
        return {}

    @override
    def state_dict(self) -> dict[str, Any]:
        deciding = {"deciding": True} if self._counted is not None else {}  # a resume probes again
        return {"decision": None if self._decision is None else self._decision.as_dict(), **deciding}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = next((state_dict[k] for k in ("decision", *self.LEGACY_STATE_KEYS) if state_dict.get(k)), None)
        self._deciding = bool(state_dict.get("deciding"))
        if saved:
            resumed = Decision.from_dict(saved)
            resumed.source = "resumed"
            self._decision = resumed

    def _describe(self, decision: Decision) -> str:
        if decision.source == "remembered":
            return f"remembered from {decision.extra.get('remembered_at', 'an earlier run')}: {decision.reason}"
        return decision.reason if decision.source != "resumed" else f"resumed from the checkpoint: {decision.reason}"

    def metrics(self, decision: Decision) -> dict[str, float]:
        """What a new decision logs: when measured, ``speedkit/<AREA>/<setting>_step_ms`` and ``.../probe_s``."""
        if not decision.probed:
            return {}
        metrics = {f"speedkit/{self.AREA}/{name}_step_ms": 1e3 * s for name, s in decision.step_s.items() if s}
        metrics[f"speedkit/{self.AREA}/probe_s"] = float(decision.probe_s)
        return metrics

    def _log(self, trainer: pl.Trainer, decision: Decision) -> None:
        """Log a new decision's `metrics` on rank zero (through the Trainer's loggers)."""
        metrics = {k: v for k, v in self.metrics(decision).items() if math.isfinite(v)}
        if metrics:
            log_rank_zero(trainer, metrics)
