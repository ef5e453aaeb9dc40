"""LRFinder: an LR range test at fit start, through the trial mechanism, and the user's LRs scaled to its suggestion."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, ClassVar

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lightning_speedkit import trials
from lightning_speedkit.checks import check_bool, check_number, check_probe_steps
from lightning_speedkit.lr import (
    MIN_SIGNAL,
    diverged,
    param_group_lrs,
    range_test_factors,
    rescale_run_lrs,
    smooth_losses,
    suggest_lr,
)
from lightning_speedkit.restore import ListOf, StateSpec
from lightning_speedkit.trials import TrialSession

__all__ = ["LRFinder"]


class _RangeSteps(Callback):
    """Sets each trial step's LR (the user's LR times the next factor) and stops once the smoothed loss blows up."""

    def __init__(self, factors: Sequence[float], beta: float, divergence: float) -> None:
        self.factors, self.beta, self.divergence = list(factors), beta, divergence
        self.base: list[list[float]] = []
        self.losses: list[float] = []

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if not self.base:
            self.base = param_group_lrs(trainer.optimizers)
        factor = self.factors[min(len(self.losses), len(self.factors) - 1)]
        for optimizer, lrs in zip(trainer.optimizers, self.base, strict=True):
            for group, lr in zip(optimizer.param_groups, lrs, strict=True):
                group["lr"] = lr * factor

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        loss = trials.loss_of(outputs)
        self.losses.append(math.nan if loss is None else loss)
        stop = diverged(smooth_losses(self.losses, self.beta), self.divergence)
        if trainer.strategy.reduce_boolean_decision(stop, all=False):  # every rank stops at the same step
            trainer.should_stop = True


class _RangeTest(trials.Setting):
    """The LR schedule of a range test, for one trial."""

    name = "lr range test"

    def __init__(self, steps: _RangeSteps) -> None:
        self.steps = steps

    @override
    def callbacks(self) -> Sequence[Callback]:
        return (self.steps,)


_MAX_STEPS = 100_000


class LRFinder(trials.Lever):
    """Choose the peak LR by an LR range test at fit start, and scale the user's LRs to it.

    At ``on_fit_start`` one trial (`lightning_speedkit.trials.TrialSession`: real steps, everything restored
    afterwards) trains ``steps`` steps while the LR grows exponentially from ``start_factor`` to ``end_factor`` times
    the user's LR; it stops early once the smoothed loss exceeds ``divergence`` times its minimum. The suggestion is
    fastai's "valley" rule on the smoothed curve (`lightning_speedkit.lr.suggest_lr`), which an early spike cannot
    fool the way Lightning's steepest-slope rule can. Every LR of the run is then scaled by ``suggested / user LR``
    (clamped to [``min_scale``, ``max_scale``]) through `lightning_speedkit.lr.rescale_run_lrs`, so a
    `WarmupScheduler` ramps to the new peak and a later rescale (the batch-size finder's) composes with it. Rank
    zero's losses decide (they are broadcast), so every rank applies the same scale. The result is in
    ``state_dict``: a resumed fit does not search again (its LRs come back with the optimizer state); the life cycle
    is `lightning_speedkit.trials.Lever`'s.

    The test is skipped, with the reason in `report`, when it would take more than ``max_fraction`` of the steps
    left in the run.

    Args:
        steps: Steps of the range test.
        start_factor: First LR of the test, as a multiple of the user's LR.
        end_factor: Last LR of the test, as a multiple of the user's LR.
        min_scale: Lowest multiple of the user's LR that may be chosen.
        max_scale: Highest multiple of the user's LR that may be chosen.
        divergence: The test stops when the smoothed loss exceeds this multiple of its minimum.
        smoothing: The loss's exponential smoothing factor, in [0, 1).
        max_fraction: Skip the test when it would take more than this fraction of the steps left, in (0, 1].
        min_signal: Suggest nothing (keep the user's LR) unless the loss fell by at least this many times its noise
            during the test (`lightning_speedkit.lr.curve_signal`); 0 follows any valley, as fastai does.
        remember: Remember the decision across runs (`lightning_speedkit.trials.memory`): a later run with the same
            fingerprint (model, batch, loader, devices, hardware, versions, arguments) applies it without probing.

    Raises:
        ValueError: For ``steps`` below 5 or over 100,000, non-positive factors or scales, ``end_factor <=
            start_factor``, ``max_scale < min_scale``, ``divergence <= 1``, ``smoothing`` outside [0, 1),
            ``max_fraction`` outside (0, 1] or a negative ``min_signal``.

    Logged metrics: ``speedkit/lr_finder/scale``, ``speedkit/lr_finder/suggested_lr``, ``speedkit/lr_finder/probe_s``.

    Example:
        >>> import lightning as L
        >>> trainer = L.Trainer(logger=False, callbacks=[LRFinder(steps=50)])
    """

    AREA = "lr_finder"
    EXTRA_SPEC: ClassVar[StateSpec] = {
        "scale": float,
        "user_lr": float,
        "chosen_lr": float,
        "suggested_lr": (float, None),
        "steps": int,
        "curve": {"lrs": ListOf(float), "losses": ListOf(float), "smoothed": ListOf(float)},
    }

    def __init__(
        self,
        steps: int = 60,
        start_factor: float = 0.01,
        end_factor: float = 100.0,
        min_scale: float = 0.01,
        max_scale: float = 10.0,
        divergence: float = 4.0,
        smoothing: float = 0.9,
        max_fraction: float = 0.15,
        min_signal: float = MIN_SIGNAL,
        remember: bool = True,
    ) -> None:
        self.remember = check_bool("remember", remember)
        self.steps = check_probe_steps("steps", steps, low=5)
        if self.steps > _MAX_STEPS:  # its LR grid is built here: a careless 10**9 would hang the constructor
            raise ValueError(f"`steps` must be at most {_MAX_STEPS} (a range test, not a run), got {steps!r}.")
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
        """The range test, unless there is no optimizer, the fit resumes, or the test is too long for the run."""
        if not trainer.optimizers:
            return trials.Decision.skipped("x1", "no optimizer", scale=1.0)
        resumed = self.resumed_without_decision(trainer)
        if resumed:
            return trials.Decision.skipped("x1", resumed, scale=1.0)
        left = trials.steps_left(trainer)
        if left * self.max_fraction < self.steps:
            reason = (
                f"skipped: a {self.steps}-step range test is more than {self.max_fraction:.0%} of the {left:.0f}"
                " steps left"
            )
            return trials.Decision.skipped("x1", reason, scale=1.0, steps=0)
        report = self._search(trainer)
        extra = {k: v for k, v in report.items() if k not in ("reason", "probed", "probe_s")}
        return trials.Decision(
            f"x{report['scale']:.4g}", report["reason"], True, report["probe_s"], source="measured", extra=extra
        )

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

        The decision: ``decision`` (``"x<scale>"``), ``reason``, ``source``, ``user_lr`` and ``suggested_lr`` (the
        first param group's), ``chosen_lr``, ``scale``, ``steps`` (range-test steps run), ``probe_s``, ``probed``
        and ``curve`` (``lrs``, ``losses``, ``smoothed``).
        """
        return {}

    def _search(self, trainer: pl.Trainer) -> dict[str, Any]:
        user_lr = param_group_lrs(trainer.optimizers)[0][0]
        steps = _RangeSteps(self.factors, self.smoothing, self.divergence)
        with TrialSession(trainer, self.steps, warmup=0) as session:
            batches = session.batches_per_epoch()
            result = session.run(_RangeTest(steps), max_batches=batches)
        losses = [math.nan if v is None else v for v in result.losses]
        lrs = [user_lr * f for f in self.factors[: len(losses)]]
        report: dict[str, Any] = {"user_lr": user_lr, "steps": len(losses), "probed": True}
        report["probe_s"] = session.elapsed_s
        report["curve"] = {"lrs": lrs, "losses": losses, "smoothed": smooth_losses(losses, self.smoothing)}
        if not result.fits:
            report.update(suggested_lr=None, chosen_lr=user_lr, scale=1.0, reason=f"the test failed: {result.error}")
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
