"""LRFinder: short LR trials (or a range test) at fit start, through the trial mechanism, and the run's LRs scaled."""

from __future__ import annotations

import contextlib
import math
from typing import Any, ClassVar

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lightning_speedkit import trials
from lightning_speedkit.checks import check_bool, check_choice, check_number, check_probe_steps
from lightning_speedkit.lr import (
    MIN_SIGNAL,
    cyclic,
    range_test_factors,
    rescale_run_lrs,
    rises,
    smooth_losses,
    suggest_lr,
    warmup_start,
)
from lightning_speedkit.lr_search import GRID, REFERENCE, broke_ceiling, choose_scale, next_scale, plateau, scored, walk
from lightning_speedkit.lr_trial import RangeTest, Scaled, lead_lr
from lightning_speedkit.restore import ListOf, StateSpec
from lightning_speedkit.trials import TrialSession

__all__ = ["METHODS", "LRFinder"]


_MAX_STEPS = 100_000
_PLATEAU_SHARE = 0.1
"""A plateau's longer trials run only when they take at most this share of the steps left (a long run)."""
METHODS = ("trials", "range")
"""``"trials"``: short trials at decade multiples of the user's LR (`lightning_speedkit.lr_search`);
``"range"``: a range test (fastai's valley rule on one sweep, `lightning_speedkit.lr.suggest_lr`)."""


class LRFinder(trials.Lever):
    """Choose the peak LR at fit start by short trials (or a range test), and scale the user's LRs to it.

    ``method="trials"`` (the default): trials of ``trial_steps`` real steps each (`lightning_speedkit.trials`: the same
    batches from the same weights, everything restored afterwards): a reference at LR 0, the user's LR, ten times it; up
    by decades (to one over ``max_scale``) while each ends clearly lower on the same batches and the user's LR does
    under a third of its progress; down a decade only when the user's LR breaks (lower only past LRs that broke: neither
    a loss that ends higher without breaking nor ten times breaking is evidence,
    `lightning_speedkit.lr_search.next_scale`). A trial that breaks (a loss half again over the reference's highest,
    `lightning_speedkit.lr_search.broke`) stops at that step: it has broken however it ends. The user's LR is kept
    unless another does at least three times its progress (`lightning_speedkit.lr_search.choose_scale`). Because the
    trials see the same batches, their step-by-step difference carries no batch noise, so the search tells LRs apart on
    a plateau where a range test's single curve shows only noise; when no LR moved the loss at all and the run is long
    enough (the longer trials take at most 10% of it), the search runs again with trials four times as long, walking up
    (or down) as far as that share allows.
    ``method="range"``: an LR range test over ``steps`` steps from ``start_factor`` to ``end_factor`` times the
    user's LR, fastai's "valley" rule on the smoothed
    curve (`lightning_speedkit.lr.suggest_lr`).

    It runs whenever a wrong LR could cost the run more than the search does: the search may take up to ``max_fraction``
    of the steps left (a wrong LR can waste all of them); the first three trials (two when ``max_scale`` is under 10)
    must fit in it, or it is skipped with the reason in `report`. Every LR of the run is then scaled by the chosen
    multiple (clamped to [``min_scale``, ``max_scale``]) through `lightning_speedkit.lr.rescale_run_lrs`, so a
    `WarmupScheduler` ramps to the new peak (its warmup lengthened when the LR grows) and a `TrainingGuard` rolls a
    raise back at half the LR if the loss breaks. Rank zero's losses decide (they are broadcast), so every rank applies
    the same scale. The result is in ``state_dict``: a resumed fit does not search again (its LRs come back with the
    optimizer state); the life cycle is `lightning_speedkit.trials.Lever`'s. An optimizer without an ``lr`` in its param
    groups (an LR-free one) is left as it is, and the report says so. So is a run whose own scheduler starts below the
    LR it was given (a warmup: `lightning_speedkit.lr.warmup_start`), with no search, or raises the LR under the trial
    at the user's LR (``OneCycleLR``, ``CyclicLR``: `lightning_speedkit.lr.rises`), where the walk stops (a range test,
    which sets every step's LR itself, skips such a cycle: `lightning_speedkit.lr.cyclic`): trials at fit start would
    measure the schedule's first, lowest LRs, and a scale of them would multiply the whole schedule, its peak too.

    Args:
        method: ``"trials"`` or ``"range"`` (`METHODS`).
        trial_steps: Steps per trial (``"trials"``); None for 1.5% of the steps left, within [6, 16].
        steps: Steps of the range test (``"range"``).
        start_factor: First LR of the range test, as a multiple of the user's LR.
        end_factor: Last LR of the range test, as a multiple of the user's LR.
        min_scale: Lowest multiple of the user's LR that may be chosen (or tried).
        max_scale: Highest multiple of the user's LR that may be chosen. From 10 up, the trials go one decade higher:
            whether ``max_scale`` is the edge of the search up is told by the LR above it
            (`lightning_speedkit.lr_search.choose_scale`), which is never chosen. Under 10, no LR over the user's is
            tried (only x1 could be chosen there), and the search only keeps or lowers the LR.
        divergence: The range test stops when the smoothed loss exceeds this multiple of its minimum.
        smoothing: The range test's exponential smoothing of the loss, in [0, 1).
        max_fraction: The most of the steps left the search may take, in (0, 1].
        min_signal: The range test suggests nothing (keeps the user's LR) unless the loss fell by at least this many
            times its noise (`lightning_speedkit.lr.curve_signal`); 0 follows any valley, as fastai does.
        remember: Remember the decision across runs (`lightning_speedkit.trials.memory`): a later run with the same
            fingerprint (model, batch, loader, devices, hardware, versions, arguments) applies it without probing.

    Raises:
        ValueError: For an unknown ``method``, ``trial_steps`` below 3, ``steps`` below 5 or over 100,000,
            non-positive factors or scales, ``end_factor <= start_factor``, ``max_scale < min_scale``,
            ``divergence <= 1``, ``smoothing`` outside [0, 1), ``max_fraction`` outside (0, 1] or a negative
            ``min_signal``.

    Logged metrics: ``speedkit/lr_finder/scale``, ``speedkit/lr_finder/suggested_lr``, ``speedkit/lr_finder/probe_s``.

    Example:
        >>> import lightning as L
        >>> trainer = L.Trainer(logger=False, callbacks=[LRFinder()])
    """

    AREA = "lr_finder"
    EXTRA_SPEC: ClassVar[StateSpec] = {
        "scale": float,
        "user_lr": float,
        "chosen_lr": float,
        "suggested_lr": (float, None),
        "steps": int,
        "method": str,
        "curve": {"lrs": ListOf(float), "losses": ListOf(float), "smoothed": ListOf(float)},
        "trials": {"scales": ListOf(float), "losses": ListOf(ListOf(float))},
    }

    def __init__(
        self,
        method: str = "trials",
        trial_steps: int | None = None,
        steps: int = 60,
        start_factor: float = 0.01,
        end_factor: float = 100.0,
        min_scale: float = 0.01,
        max_scale: float = 100.0,
        divergence: float = 4.0,
        smoothing: float = 0.9,
        max_fraction: float = 0.25,
        min_signal: float = MIN_SIGNAL,
        remember: bool = True,
    ) -> None:
        self.remember = check_bool("remember", remember)
        self.method = check_choice("method", method, METHODS)
        self.trial_steps = None if trial_steps is None else check_probe_steps("trial_steps", trial_steps, low=3)
        self.steps = check_probe_steps("steps", steps, low=5)
        if self.steps > _MAX_STEPS:  # its LR grid is built here: a careless 10**9 would hang the constructor
            raise ValueError(f"`steps` must be at most {_MAX_STEPS} (a range test, not a run), got {steps!r}.")
        if self.trial_steps is not None and self.trial_steps > _MAX_STEPS:
            raise ValueError(f"`trial_steps` must be at most {_MAX_STEPS} (a trial, not a run), got {trial_steps!r}.")
        start = check_number("start_factor", start_factor, 0, open_low=True)
        self.factors = range_test_factors(steps, start, end_factor)
        self.min_scale = check_number("min_scale", min_scale, 0, open_low=True)
        self.max_scale = check_number("max_scale", max_scale, 0, open_low=True)
        if self.max_scale < self.min_scale:
            raise ValueError(f"`max_scale` must be >= `min_scale` ({min_scale}), got {max_scale!r}.")
        check_number("divergence", divergence, 1, open_low=True)
        check_number("smoothing", smoothing, 0, 1, open_high=True)
        check_number("max_fraction", max_fraction, 0, 1, open_low=True)
        self.min_signal = check_number("min_signal", min_signal, 0)
        self.divergence, self.smoothing, self.max_fraction = float(divergence), float(smoothing), float(max_fraction)

    @override
    def decide(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> trials.Decision:
        """The search, unless there is no optimizer or LR, the fit resumes, or the search is too long for the run."""
        if not trainer.optimizers:
            return trials.Decision.skipped("x1", "no optimizer", scale=1.0)
        if not all("lr" in group for optimizer in trainer.optimizers for group in optimizer.param_groups):
            names = ", ".join(type(optimizer).__name__ for optimizer in trainer.optimizers)
            reason = f"skipped: the optimizer ({names}) has no `lr` in its param groups; the run is left as it is"
            rank_zero_warn(f"LRFinder: {reason}.")
            return trials.Decision.skipped("x1", reason, scale=1.0)
        resumed = self.resumed_without_decision(trainer)
        if resumed:
            return trials.Decision.skipped("x1", resumed, scale=1.0)
        reason = _schedule_rules_out(trainer, self.method)  # a warmup of the user's from 0 is named as such
        if not reason and lead_lr(trainer.optimizers) == 0.0:
            reason = "skipped: every param group's LR is 0, which no scale changes; the run is left as it is"
        if reason:
            rank_zero_warn(f"LRFinder: {reason}.")
            return trials.Decision.skipped("x1", reason, scale=1.0, steps=0)
        left = trials.steps_left(trainer)
        price, what = self._price(left)
        if left * self.max_fraction < price:
            reason = f"skipped: {what} is more than {self.max_fraction:.0%} of the {left:.0f} steps left"
            return trials.Decision.skipped("x1", reason, scale=1.0, steps=0)
        report = self._search(trainer) if self.method == "range" else self._trials(trainer, left)
        extra = {k: v for k, v in report.items() if k not in ("reason", "probed", "probe_s")}
        return trials.Decision(
            f"x{report['scale']:.4g}", report["reason"], True, report["probe_s"], source="measured", extra=extra
        )

    def _trial_steps(self, left: float) -> int:
        """Steps per trial: ``trial_steps``, or 1.5% of the steps left within [6, 16]."""
        if self.trial_steps is not None:
            return self.trial_steps
        return 16 if math.isinf(left) else max(6, min(16, round(0.015 * left)))

    def _price(self, left: float) -> tuple[int, str]:
        """The least the search costs, in steps, and what it is (for the skip reason)."""
        if self.method == "range":
            return self.steps, f"a {self.steps}-step range test"
        k = self._trial_steps(left)
        if self._highest_tried < GRID:
            return 2 * k, f"two {k}-step LR trials (a reference, your LR)"
        return 3 * k, f"three {k}-step LR trials (a reference, your LR, ten times it)"

    @override
    def holds(self, trainer: pl.Trainer, decision: trials.Decision) -> bool:
        """A scale holds for the LR it was found from: another LR (a second fit, a later run) is searched again."""
        found_for = decision.extra.get("user_lr")
        same_lr = found_for is None or math.isclose(lead_lr(trainer.optimizers), float(found_for), rel_tol=1e-9)
        return same_lr and super().holds(trainer, decision)

    @override
    def apply(self, trainer: pl.Trainer, pl_module: pl.LightningModule, decision: trials.Decision) -> None:
        scale = float(decision.extra.get("scale", 1.0))
        if scale != 1.0 and decision.source not in ("resumed",):  # a resume's LRs come back with the optimizer
            rescale_run_lrs(trainer, scale)

    @override
    def metrics(self, decision: trials.Decision) -> dict[str, float]:
        if not decision.probed:
            return {}
        metrics = {"speedkit/lr_finder/scale": float(decision.extra["scale"])}
        metrics["speedkit/lr_finder/probe_s"] = decision.probe_s
        if decision.extra.get("suggested_lr") is not None:
            metrics["speedkit/lr_finder/suggested_lr"] = float(decision.extra["suggested_lr"])
        return metrics

    @override
    def status(self) -> dict[str, Any]:
        """Nothing beside the decision.

        The decision: ``decision`` (``"x<scale>"``), ``reason``, ``source``, ``method``, ``user_lr`` and
        ``suggested_lr`` (the first non-zero param group's: `lightning_speedkit.lr_trial.lead_lr`), ``chosen_lr``,
        ``scale``, ``steps`` (search steps run), ``probe_s``, ``probed``, and ``trials`` (``scales`` and each trial's
        ``losses``) or, for a range test, ``curve`` (``lrs``, ``losses``, ``smoothed``).
        """
        return {}

    def _trials(self, trainer: pl.Trainer, left: float) -> dict[str, Any]:
        user_lr = lead_lr(trainer.optimizers)
        k = self._trial_steps(left)
        budget = self.max_fraction * left
        curves, probe_s, rise, used = self._walk(trainer, k, _fits(budget, k))
        room = min(budget - used, _PLATEAU_SHARE * left)
        retry = not rise and plateau(curves) and any(s > 1.0 for s in curves) and 12 * k <= room
        if retry:
            curves, seconds, rise, steps = self._walk(trainer, 4 * k, _fits(room, 4 * k))  # a plateau: 4 times as long
            used, probe_s = used + steps, probe_s + seconds
        if not curves[REFERENCE]:  # no step gave a loss (the walk stopped after the reference): nothing to compare
            chosen, why, curves = 1.0, _NO_LOSS, {}
            rank_zero_warn(f"LRFinder: {why}.")
        elif rise:
            chosen, why = 1.0, _rise_reason(rise)
            rank_zero_warn(f"LRFinder: {why}.")
        else:
            chosen, why = choose_scale(curves)
            why += f" (tried again over {4 * k} steps: no LR moved the loss in {k})" if retry else ""
            unwalked = next_scale(curves, self.min_scale, self._highest_tried)
            if unwalked is not None:  # the walk stopped at its share of the run, not where the losses stopped it
                why += f" (x{unwalked:.4g} not tried: the search's share of the run was spent)"
        scale_kept = min(self.max_scale, max(self.min_scale, chosen))
        tried = sorted(curves)
        return {
            "method": "trials",
            "user_lr": user_lr,
            "steps": used,
            "probed": True,
            "probe_s": probe_s,
            "trials": {"scales": tried, "losses": [curves[s] for s in tried]},
            "suggested_lr": None if chosen == 1.0 else user_lr * chosen,
            "chosen_lr": user_lr * scale_kept,
            "scale": scale_kept,
            "reason": why,
        }

    @property
    def _highest_tried(self) -> float:
        """The highest scale tried: a decade over ``max_scale``, to tell whether it is the edge.

        ``max_scale`` itself when it is under a decade: only x1 can be chosen up there, and x10 could not change that.
        """
        return self.max_scale * GRID if self.max_scale >= GRID else self.max_scale

    def _walk(
        self, trainer: pl.Trainer, steps: int, most: float
    ) -> tuple[dict[float, list[float]], float, list[float], int]:
        """`lightning_speedkit.lr_search.walk` over at most ``most`` trials of ``steps`` real steps; their seconds.

        The third item is the step LRs of the trial at the user's LR when the user's schedule rose under it
        (`lightning_speedkit.lr.rises`): the walk stops there, with the trials run so far; else empty. The fourth is
        the steps run. Each trial's losses are those at the steps the reference scored (`scored`: a batch the
        ``training_step`` skips is left out); a reference with no loss at all stops the walk with no other trial.
        """
        curves: dict[float, list[float]] = {}
        rise: list[float] = []
        ran, reference = [0], list[float | None]()  # the steps run; the reference's losses (None: a step gave none)
        with TrialSession(trainer, steps, warmup=0, replay=True) as session:
            batches = session.batches_per_epoch()
            ceiling = [math.inf]  # once the reference ran: a trial over it has broken, and stops there (`Scaled`)

            def trial(scale: float) -> list[float]:
                setting = Scaled(scale, ceiling[0])
                result = session.run(setting, max_batches=batches)
                ran[0] += len(result.losses)
                if scale == REFERENCE and result.fits:
                    reference.extend(result.losses)
                curves[scale] = scored(reference or result.losses, result.losses) if result.fits else [math.nan]
                if scale == REFERENCE:
                    if not curves[scale]:  # no step gave a loss: nothing to compare LRs by
                        raise _Stop
                    ceiling[0] = broke_ceiling(curves[scale])
                elif scale == 1.0 and rises(setting.lrs):
                    rise.extend(setting.lrs)
                    raise _Stop
                return curves[scale]

            with contextlib.suppress(_Stop):
                walk(trial, most, self.min_scale, self._highest_tried)
        return curves, session.elapsed_s, rise, ran[0]

    def _search(self, trainer: pl.Trainer) -> dict[str, Any]:
        user_lr = lead_lr(trainer.optimizers)
        with TrialSession(trainer, self.steps, warmup=0) as session:
            batches = session.batches_per_epoch()
            result = session.run(RangeTest(self.factors, self.smoothing, self.divergence), max_batches=batches)
        steps = list(zip(self.factors, result.losses, strict=False))  # a step with no loss (skipped) is left out
        lrs, losses = [user_lr * f for f, v in steps if v is not None], [float(v) for _, v in steps if v is not None]
        report: dict[str, Any] = {"method": "range", "user_lr": user_lr, "steps": len(steps), "probed": True}
        report["probe_s"] = session.elapsed_s
        report["curve"] = {"lrs": lrs, "losses": losses, "smoothed": smooth_losses(losses, self.smoothing)}
        if not result.fits:
            report.update(suggested_lr=None, chosen_lr=user_lr, scale=1.0, reason=f"the test failed: {result.error}")
            return report
        if not losses:
            rank_zero_warn(f"LRFinder: {_NO_LOSS}.")
            report.update(suggested_lr=None, chosen_lr=user_lr, scale=1.0, reason=_NO_LOSS)
            return report
        suggested, why = suggest_lr(lrs, losses, self.smoothing, self.min_signal)
        if suggested is None:
            report.update(suggested_lr=None, chosen_lr=user_lr, scale=1.0, reason=f"no suggestion: {why}")
            rank_zero_warn(f"LRFinder: no LR suggested ({why}); the LR is left as it is.")
            return report
        raw = suggested / user_lr
        scale = min(self.max_scale, max(self.min_scale, raw))
        clamp = "" if scale == raw else f"; clamped from x{raw:.3g} to [{self.min_scale:g}, {self.max_scale:g}]"
        report.update(suggested_lr=suggested, chosen_lr=user_lr * scale, scale=scale, reason=why + clamp)
        return report


class _Stop(Exception):
    """The walk stops (`LRFinder._walk`): the schedule rose under the user's LR, or the reference had no loss."""


_NO_LOSS = (
    "`training_step` returned no loss at any step of the search (manual optimization that returns none?): nothing to"
    " compare LRs by; your LR is kept (return the loss to have it searched)"
)


def _schedule_rules_out(trainer: pl.Trainer, method: str) -> str:
    """Why the user's own LR schedule rules a search at fit start out ("" when it does not).

    A warmup's first LR (`lightning_speedkit.lr.warmup_start`) is not the user's, and a scale chosen there multiplies
    the whole schedule; so does a range test's under a cycle (`lightning_speedkit.lr.cyclic`), whose rise the trials
    see under their steps (`lightning_speedkit.lr.rises`) and a range test, setting every step's LR, does not.
    """
    start = warmup_start(trainer.optimizers)
    if start is not None:
        return (
            f"skipped: your LR scheduler starts the LR at {start[0]:.3g}, below the {start[1]:.3g} it was given (a"
            " warmup): a search now would try the warmup's LR, and its scale would multiply your whole schedule; the"
            " run is left as it is"
        )
    cycle = cyclic(config.scheduler for config in trainer.lr_scheduler_configs) if method == "range" else None
    if cycle:
        return (
            f"skipped: your LR scheduler {cycle} raises the LR after fit start, which a range test (it sets every"
            " step's LR) cannot see, and its scale would multiply your whole cycle; the run is left as it is"
        )
    return ""


def _rise_reason(lrs: list[float]) -> str:
    """Why the LR is kept when the user's schedule rose under the trial at their LR (``lrs``: its step LRs)."""
    return (
        f"your LR scheduler raised the LR from {lrs[0]:.3g} to {max(lrs):.3g} over the {len(lrs)} steps of the trial"
        " at your LR (a warmup or a cycle): the trials measured its rise, not your LR; kept"
    )


def _fits(budget: float, steps: int) -> float:
    """How many trials of ``steps`` fit in ``budget`` steps: whole ones, or ``inf`` for a run with no step limit."""
    return math.inf if math.isinf(budget) else float(budget // steps)
