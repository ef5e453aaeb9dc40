"""`CountedCompile`: `Compile`'s probe on the fit's own first steps, eager and compiled blocks taking turns."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from typing_extensions import override

from lightning_speedkit import trials
from lightning_speedkit.compile.payback import MAX_GAIN, compile_worth_probing
from lightning_speedkit.trials.counted import CountedTrials

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
    not with a plain step-time margin; so it adds no rounds (``extra_rounds`` 0).
    """

    extra_rounds = 0
    cuts_short = False  # the compiled block's first steps compile; `block_ended` judges the block whole

    def __init__(self, callback: Compile, compiled: _Compiled, left: float) -> None:
        super().__init__(trials.AsIs(EAGER), [compiled], callback.probe_steps, callback.margin, warmup=1)
        self.callback, self.compiled, self.left = callback, compiled, left
        self.losses: list[list[float | None]] = []

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
        report = dict(trainer.strategy.broadcast(report, src=0))
        extra = {**self.counted_fields(), **{k: v for k, v in report.items() if k not in DECISION_FIELDS}}
        extra["trials"] = [r.as_dict() for r in results]
        fields = {k: report[k] for k in ("decision", "reason", "step_s", "rejected")}
        probe_s = self.extra_s(trainer, report["step_s"].get(report["decision"]))  # the compile, when kept eager
        return trials.Decision(**fields, probed=True, probe_s=probe_s, source="measured", extra=extra)
