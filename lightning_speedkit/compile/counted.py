"""`CountedCompile`: `Compile`'s probe on the fit's own first steps, eager and compiled blocks taking turns."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lightning_speedkit import trials
from lightning_speedkit.compile.payback import MAX_GAIN, compile_worth_probing
from lightning_speedkit.trials.counted import CountedTrials
from lightning_speedkit.trials.snapshot import take_state, undo_block

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_speedkit.compile.callback import Compile, _Compiled

__all__ = ["DECISION_FIELDS", "EAGER", "CountedCompile"]

EAGER = "eager"
"""The setting in place: the module as the user built it."""

DECISION_FIELDS = ("decision", "reason", "probed", "probe_s", "step_s", "rejected")
"""The fields of a `lightning_speedkit.trials.Decision` in `Compile`'s report (the rest go to ``extra``)."""


class CountedCompile(CountedTrials):
    """Eager and compiled blocks of the fit's own first steps (`CountedTrials`), concluded by `Compile`'s rules.

    Beside the step times it keeps each block's losses (for the compiled loss check), stops after the first eager
    block when no speed-up could repay a compile (`compile_worth_probing`) and after a block in which compiling failed
    on any rank, and concludes with `compile_pays_back` (the compile seconds against the saving over the steps left),
    not with a plain step-time margin; so it adds no rounds (``extra_rounds`` 0). Before each compiled block the
    weights and optimizer state are copied to host memory: a compiled block with a non-finite loss on any rank is
    undone (the copy put back, every callback told through ``rolled_back``), the probe ends and the module stays eager.
    """

    extra_rounds = 0
    cuts_short = False  # the compiled block's first steps compile; `block_ended` judges the block whole

    def __init__(self, callback: Compile, compiled: _Compiled, left: float) -> None:
        super().__init__(trials.AsIs(EAGER), [compiled], callback.probe_steps, callback.margin, warmup=1)
        self.callback, self.compiled, self.left = callback, compiled, left
        self.losses: list[list[float | None]] = []
        self._saved: dict[str, Any] | None = None
        self.undone: str | None = None  # how a compiled block with a non-finite loss was undone

    def keep_run_state(self) -> None:
        """Drop the block's copy: the state a rollback put back since stands (`trials.Lever.rolled_back`)."""
        self._saved = None

    @override
    def block_starting(self, trainer: pl.Trainer, setting: trials.Setting) -> None:
        self._saved = None
        if setting is self.compiled:  # its steps are undone if its loss breaks: the step count goes on, as a rollback's
            self._saved = {**take_state(trainer, schedulers=False, precision=False), "step": trainer.global_step}

    def record_loss(self, outputs: Any) -> None:
        """The loss of the step that just ended, in its block's list (called before `step_ended` closes the block)."""
        if self._active is None or not self.blocks:  # another lever's counted probe runs first
            return
        while len(self.losses) < len(self.blocks):
            self.losses.append([])
        self.losses[-1].append(trials.loss_of(outputs))

    def results(self) -> list[trials.TrialResult]:
        """Each finished block as a trial result (rank zero's step times), through `Compile._timed`."""
        finished = [(name, times) for name, times in self.blocks if len(times) == self.steps]
        losses = self.losses + [[]] * (len(finished) - len(self.losses))
        return [
            self.callback._timed(trials.TrialResult(name, True, list(times), list(loss), warmup=self.warmup))
            for (name, times), loss in zip(finished, losses, strict=True)
        ]

    @override
    def block_ended(self, trainer: pl.Trainer) -> trials.Decision | None:
        failed = not trainer.strategy.reduce_boolean_decision(self.callback._failure is None, all=True)
        if failed:
            return self._finish(trainer, failed=True)
        ended = self.losses[-1] if self.losses and len(self.losses) == len(self.blocks) else []
        broke = any(loss is not None and not math.isfinite(loss) for loss in ended)
        if trainer.strategy.reduce_boolean_decision(broke, all=False) and self.blocks[-1][0] == self.compiled.name:
            self.undone = "a rollback had put an earlier state back"  # a guard's, inside the block: it stands
            if self._saved is not None:
                self.undone = f"its steps undone, back to step {self._saved['step']}"
                undo_block(trainer, self._saved)  # every rank its own copy (the same weights under DDP)
            self._saved = None
            return self._finish(trainer, failed=False)
        self._saved = None
        if len(self.blocks) != 1:
            return None
        eager_s = self.results()[0].median_step_s or 0.0
        eager_s = float(trainer.strategy.broadcast(eager_s, src=0))
        c = self.callback
        worth, why = compile_worth_probing(eager_s, self.left, c.min_compile_s, MAX_GAIN, c.margin)
        if worth:
            return None
        report = {"steps_left": None if math.isinf(self.left) else self.left, "compile_s": None, "counted": True}
        return trials.Decision(EAGER, why, True, 0.0, {EAGER: eager_s}, {}, "measured", report)

    @override
    def _decide(self, trainer: pl.Trainer) -> trials.Decision:
        return self._finish(trainer, failed=False)  # `block_ended` checked this last block for a failure

    def _finish(self, trainer: pl.Trainer, failed: bool) -> trials.Decision:
        """Stop the blocks and conclude by `Compile`'s rules (``failed``: compiling failed on some rank)."""
        self.stop(trainer)
        report: dict[str, Any] = {"decision": EAGER, "reason": "", "rejected": {}, "compile_s": None}
        report["steps_left"] = None if math.isinf(self.left) else self.left
        results = self.results()
        self.callback._conclude(report, results, self.compiled, self.left, failed)
        if (undone := self.undone) is not None:  # a compiled block after the first, which `_conclude` reads, broke
            if not report["rejected"].get(self.compiled.name):
                report.update(decision=EAGER, reason=f"eager: a compiled block's loss was not finite ({undone})")
                report["rejected"][self.compiled.name] = report["reason"]
                rank_zero_warn(f"Compile: a compiled block's loss was not finite ({undone}); training goes on eager.")
            else:
                report["reason"] += f" ({undone})"
        report = dict(trainer.strategy.broadcast(report, src=0))
        extra = {**self.counted_fields(), **{k: v for k, v in report.items() if k not in DECISION_FIELDS}}
        extra["trials"] = [r.as_dict() for r in results]
        fields = {k: report[k] for k in ("decision", "reason", "step_s", "rejected")}
        probe_s = self.extra_s(trainer, report["step_s"].get(report["decision"]))  # the compile, when kept eager
        return trials.Decision(**fields, probed=True, probe_s=probe_s, source="measured", extra=extra)
