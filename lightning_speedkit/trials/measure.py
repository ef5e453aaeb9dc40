"""Deciding by trials: how many steps are left, one `measure` for every lever, and its report and metrics."""

from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.utilities.seed import isolate_rng

from lightning_speedkit.decisions import choose_setting, clearly_slower, loss_is_sound, probe_pays_back
from lightning_speedkit.report import log_rank_zero, quiet_logger
from lightning_speedkit.restore import StateSpec, check_checkpoints
from lightning_speedkit.trials.session import LIGHTNING_INFO, TrialSession
from lightning_speedkit.trials.settings import Setting

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["PROBE_ROUNDS", "RemembersDecision", "decision_summary", "log_decision", "measure", "steps_left"]


def steps_left(trainer: pl.Trainer) -> float:
    """Training batches left in this fit (``inf`` for an unbounded one), from ``trainer.estimated_stepping_batches``.

    Estimating builds the train loader and its iterator, which draws from the global RNG; a fit that has not built
    them yet gets them back unbuilt and its RNG untouched, so asking changes nothing about the run.
    """
    fit_loop = trainer.fit_loop
    built = fit_loop._combined_loader is not None
    with isolate_rng(include_cuda=torch.cuda.is_available()), quiet_logger(LIGHTNING_INFO, logging.WARNING):
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
    of its timed steps over all rounds. A candidate that the first round shows clearly slower (`clearly_slower`: by
    over three margins, at least 10%) is not timed again, and when all are, no second round runs. The fastest
    candidate is chosen only if it beats the setting in place by ``margin``. With ``loss_tolerance``, a candidate whose
    first-round losses are non-finite or clearly worse than the setting in place's is rejected. Every rank returns the
    same report; the caller applies ``report["decision"]``.

    Returns:
        ``decision`` (a setting's name), ``reason``, ``probed``, ``probe_s`` (seconds the trials took, set-up
        included), ``steps_left``, ``step_s`` (median seconds per step by setting), ``rejected`` (setting: why),
        ``dropped`` (candidates timed in the first round only) and ``trials`` (each `TrialResult` as a dict).

    Raises:
        ValueError: If the train loader has fewer batches per epoch than ``steps``.
    """
    settings = (current, *candidates)
    left = steps_left(trainer)
    pays, why = probe_pays_back(steps * rounds * len(settings), left, max_gain)
    report: dict[str, Any] = {"decision": current.name, "reason": why, "probed": False, "probe_s": 0.0}
    report.update(steps_left=None if math.isinf(left) else left, step_s={}, rejected={}, dropped=[], trials=[])
    if not pays:
        return report
    with TrialSession(trainer, steps, warmup) as session:
        batches = session.batches_per_epoch()
        if batches is not None and batches < steps:
            raise ValueError(
                f"`probe_steps` must not be longer than the train loader: got {steps}, the loader has {batches}"
                " batches per epoch."
            )
        first = [session.run(setting) for setting in settings]
        medians = {r.setting: r.median_step_s for r in first}
        dropped = clearly_slower(medians, current.name, margin) if rounds > 1 else []
        later = [s for s in settings if s.name not in dropped]
        later = later if len(later) > 1 else []  # every candidate dropped: the decision is made
        results = first + [session.run(setting) for _ in range(rounds - 1) for setting in later]
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
    report.update(decision=decision, reason=reason, probed=True, probe_s=session.elapsed_s, dropped=dropped)
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
    if not decision.get("probed"):
        return
    step_s = decision.get("step_s") or {}
    metrics = {f"speedkit/{area}/{name}_step_ms": 1e3 * s for name, s in step_s.items() if s is not None}
    metrics[f"speedkit/{area}/probe_s"] = float(decision.get("probe_s", 0.0))
    log_rank_zero(trainer, metrics)


class RemembersDecision:
    """Mixin for a lever Callback whose decision, once made, is checkpointed, so a resumed fit does not probe again.

    List it before ``Callback`` in the bases. The decision is the plain dict in ``self._decision``; it is saved under
    ``state_name`` (``"report"`` for levers whose checkpoints already used that key). A checkpoint's state is checked
    before anything is restored (`lightning_speedkit.restore`); a lever that overrides ``setup`` calls
    `~lightning_speedkit.restore.check_checkpoints` itself.
    """

    state_name = "decision"
    _decision: dict[str, Any]

    @property
    def state_spec(self) -> StateSpec:
        """What a checkpoint may hold for this lever: its decision, a dict."""
        return {self.state_name: (dict, None)}

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Check every checkpoint the fit loads before anything is restored from it."""
        check_checkpoints(trainer)

    def state_dict(self) -> dict[str, Any]:
        """The decision, for the checkpoint."""
        return {self.state_name: self._decision}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """The decision, from a checkpoint (empty if it holds none)."""
        self._decision = dict(state_dict.get(self.state_name) or {})
