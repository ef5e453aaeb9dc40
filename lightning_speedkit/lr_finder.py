"""LRFinder: an LR range test at fit start, through the trial mechanism, and the user's LRs scaled to its suggestion."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_speedkit import trials
from lightning_speedkit.checks import check_number, check_probe_steps
from lightning_speedkit.lr import (
    MIN_SIGNAL,
    diverged,
    param_group_lrs,
    range_test_factors,
    rescale_run_lrs,
    smooth_losses,
    suggest_lr,
)
from lightning_speedkit.report import log_rank_zero
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


class LRFinder(trials.RemembersDecision, Callback):
    """Choose the peak LR by an LR range test at fit start, and scale the user's LRs to it.

    At ``on_fit_start`` one trial (`lightning_speedkit.trials.TrialSession`: real steps, everything restored
    afterwards) trains ``steps`` steps while the LR grows exponentially from ``start_factor`` to ``end_factor`` times
    the user's LR; it stops early once the smoothed loss exceeds ``divergence`` times its minimum. The suggestion is
    fastai's "valley" rule on the smoothed curve (`lightning_speedkit.lr.suggest_lr`), which an early spike cannot
    fool the way Lightning's steepest-slope rule can. Every LR of the run is then scaled by ``suggested / user LR``
    (clamped to [``min_scale``, ``max_scale``]) through `lightning_speedkit.lr.rescale_run_lrs`, so a
    `WarmupScheduler` ramps to the new peak and a later rescale (the batch-size finder's) composes with it. Rank
    zero's losses decide (they are broadcast), so every rank applies the same scale. The result is in
    ``state_dict``: a resumed fit does not search again (its LRs come back with the optimizer state).

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

    Raises:
        ValueError: For ``steps`` below 5 or over 100,000, non-positive factors or scales, ``end_factor <= start_factor``,
            ``max_scale < min_scale``, ``divergence <= 1``, ``smoothing`` outside [0, 1), ``max_fraction`` outside
            (0, 1] or a negative ``min_signal``.

    Logged metrics: ``speedkit/lr_finder/scale``, ``speedkit/lr_finder/suggested_lr``, ``speedkit/lr_finder/probe_s``.

    Example:
        >>> import lightning as L
        >>> trainer = L.Trainer(logger=False, callbacks=[LRFinder(steps=50)])
    """

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
    ) -> None:
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
        self._decision: dict[str, Any] = {}

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(steps=self.steps, start_factor=self.factors[0], end_factor=self.factors[-1])

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._decision:
            rank_zero_info(f"LRFinder: resumed with LR x{self._decision['scale']:.4g} (saved result, no search).")
            return
        if not trainer.optimizers:
            self._decision = {"scale": 1.0, "reason": "no optimizer", "probed": False, "probe_s": 0.0}
            return
        left = trials.steps_left(trainer)
        if left * self.max_fraction < self.steps:
            self._decision = {"scale": 1.0, "probed": False, "probe_s": 0.0, "steps": 0}
            self._decision["reason"] = (
                f"skipped: a {self.steps}-step range test is more than {self.max_fraction:.0%} of the {left:.0f}"
                " steps left"
            )
            rank_zero_info(f"LRFinder: {self._decision['reason']}; the LR is left as it is.")
            return
        self._decision = self._search(trainer)
        if self._decision["scale"] != 1.0:
            rescale_run_lrs(trainer, self._decision["scale"])
        rank_zero_info(f"LRFinder: LR x{self._decision['scale']:.4g} ({self._decision['reason']}).")
        metrics = {f"speedkit/lr_finder/{k}": float(self._decision[k]) for k in ("scale", "probe_s")}
        if self._decision.get("suggested_lr") is not None:
            metrics["speedkit/lr_finder/suggested_lr"] = float(self._decision["suggested_lr"])
        log_rank_zero(trainer, metrics)

    def report(self) -> dict[str, Any]:
        """The search as a plain dict (empty before fit start).

        Keys: ``user_lr`` and ``suggested_lr`` (the first param group's), ``chosen_lr``, ``scale``, ``reason``,
        ``steps`` (range-test steps run), ``probe_s``, ``probed`` and ``curve`` (``lrs``, ``losses``, ``smoothed``).
        """
        return dict(self._decision)

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
