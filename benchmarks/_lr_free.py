"""The LR-free and schedule-free optimizers the LR benchmark measures beside ``preset(lr="auto")``.

Issue 26 named three other ways out of a wrong LR: Prodigy (Mishchenko & Defazio 2023, which estimates the step size
itself: ``lr=1.0`` multiplies its estimate), Schedule-Free AdamW / SGD (Defazio et al. 2024, winner of AlgoPerf's
self-tuning track: no schedule, but the user's LR) and D-Adaptation (Defazio & Mishchenko 2023, Prodigy's
predecessor). The pack never swaps a user's optimizer on its own; these variants are what a user who opts in by hand
would run, so `lr_tasks` can say whether the LR trials are worth keeping against them. The packages are the authors'
own (``pip install prodigyopt schedulefree dadaptation``, the ``lrfree`` extra).

- ``preset_prodigy``: ``preset()`` (its WSD schedule multiplies Prodigy's ``lr=1.0``) with the task's optimizer
  replaced by ``Prodigy(lr=1.0)``; the user's LR is not used at all.
- ``preset_dadapt``: the same with D-Adaptation at ``lr=1.0``: ``DAdaptAdam`` (decoupled weight decay for an AdamW
  task) or, for an SGD task, ``DAdaptSGD`` with the task's momentum (0.9).
- ``preset_schedulefree``: ``preset(warmup=False)`` (a schedule-free optimizer wants none) with ``AdamWScheduleFree``
  (``SGDScheduleFree`` with the task's momentum, 0.9, for an SGD task) at the user's LR, its own warmup over 5% of
  the steps (the authors' examples warm up), and `ScheduleFreeModes` switching it between its training and its
  evaluation point.

Each keeps the weight decay of the optimizer the model's own ``configure_optimizers`` builds (the demo's AdamW
1e-4, the other AdamW tasks torch's 0.01, none for Adam and SGD).
"""

from __future__ import annotations

import math

import lightning as L
import torch
from typing_extensions import override

VARIANTS = ("preset_prodigy", "preset_dadapt", "preset_schedulefree")
"""The opt-in variants of ``lr_tasks --lr-free``."""

WARMUP_SHARE = 0.05
"""The schedule-free optimizer's own warmup, as a share of the fit's optimizer steps."""


def weight_decay(optimizer: torch.optim.Optimizer) -> float:
    """The weight decay of ``optimizer``'s first param group (0.0 when it has none).

    Example:
        >>> weight_decay(torch.optim.AdamW([torch.zeros(1, requires_grad=True)], weight_decay=1e-4))
        0.0001
    """
    return float(optimizer.param_groups[0].get("weight_decay", 0.0))


def swap_optimizer(model: L.LightningModule, variant: str) -> None:
    """Make ``model.configure_optimizers`` build ``variant``'s optimizer instead of its own.

    What the swap keeps comes from the optimizer the model's own ``configure_optimizers`` returns: its weight decay,
    whether it is SGD (then ``SGDScheduleFree`` or ``DAdaptSGD`` with its momentum), for D-Adaptation whether it is
    AdamW (decoupled decay), and for the schedule-free one its LR (the user's). The schedule-free optimizer is built
    in training mode, its warmup sized from ``trainer.estimated_stepping_batches``.
    """
    if variant not in VARIANTS:
        raise ValueError(f"`variant` must be one of {', '.join(VARIANTS)}, got {variant!r}.")
    own = model.configure_optimizers

    def build() -> torch.optim.Optimizer:
        mine = own()
        if not isinstance(mine, torch.optim.Optimizer):
            raise TypeError(f"the model's `configure_optimizers` must return one optimizer here, got {mine!r}.")
        decay, group = weight_decay(mine), mine.param_groups[0]
        if variant == "preset_prodigy":
            from prodigyopt import Prodigy  # type: ignore[import-untyped]

            built: torch.optim.Optimizer = Prodigy(model.parameters(), lr=1.0, weight_decay=decay)
            return built
        if variant == "preset_dadapt":
            import dadaptation  # type: ignore[import-untyped]

            if isinstance(mine, torch.optim.SGD):
                return dadaptation.DAdaptSGD(  # type: ignore[no-any-return]
                    model.parameters(), lr=1.0, momentum=group["momentum"], weight_decay=decay
                )
            decouple = isinstance(mine, torch.optim.AdamW)
            return dadaptation.DAdaptAdam(  # type: ignore[no-any-return]
                model.parameters(), lr=1.0, weight_decay=decay, decouple=decouple
            )
        import schedulefree  # type: ignore[import-untyped]

        steps = model.trainer.estimated_stepping_batches
        warmup = 0 if math.isinf(steps) else math.ceil(WARMUP_SHARE * steps)
        lr = group["lr"]
        if isinstance(mine, torch.optim.SGD):
            built = schedulefree.SGDScheduleFree(
                model.parameters(), lr=lr, momentum=group["momentum"], weight_decay=decay, warmup_steps=warmup
            )
        else:
            built = schedulefree.AdamWScheduleFree(model.parameters(), lr=lr, weight_decay=decay, warmup_steps=warmup)
        built.train()  # type: ignore[attr-defined]
        return built

    model.configure_optimizers = build  # type: ignore[method-assign]


class ScheduleFreeModes(L.Callback):
    """A schedule-free optimizer's two points: ``train()`` for training steps, ``eval()`` for validation and after.

    The optimizer trains at one sequence of weights and keeps another (its average): validation, and the weights the
    fit leaves, use the average. Optimizers without ``train``/``eval`` are left alone. Batch-norm statistics are
    the ones gathered at the training point (the authors recompute them for a final model; a run validated every
    epoch here does not).
    """

    @staticmethod
    def _switch(trainer: L.Trainer, mode: str) -> None:
        for optimizer in trainer.optimizers:
            switch = getattr(optimizer, mode, None)
            if callable(switch):
                switch()

    @override
    def on_validation_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._switch(trainer, "eval")

    @override
    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.state.fn == "fit":
            self._switch(trainer, "train")

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._switch(trainer, "eval")
