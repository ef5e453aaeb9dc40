"""The cool-down check of `lightning_speedkit.WarmupScheduler`: the LR is held when the loss still falls before it.

Warmup-stable-decay cools down over the last part of the budget because, at a constant LR, the loss ends up
limited by the noise of the updates, which a lower LR takes out (Hägele et al. 2024). A run whose LR is too low is
not there yet: its loss still falls at the peak LR, and cooling down only slows it (on `benchmarks/lr_tasks.py`'s
MLP at 10x too low an LR, the plain loop reached the target in its last epoch and `preset()` missed it). So before
the cool-down the scheduler watches the training loss over as many steps as the cool-down takes, and
`lightning_speedkit.schedule.still_falling` decides: still falling, the LR is held to the end (the run at the
user's LR is then exactly the constant-LR run); flat, the cool-down runs as planned.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from torch import Tensor

from lightning_speedkit.schedule import cooldown_start, still_falling

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["MIN_STEPS", "TRIAL_COOLED", "TRIAL_Z", "CooldownCheck", "check_window", "paired_gap", "trial_holds"]

MIN_STEPS = 16
"""The fewest steps the check watches: with fewer, the cool-down runs as planned."""


TRIAL_COOLED = 1.0 / 3.0
"""A cool-down trial's lower LR, as a share of the peak: the mean factor of the ``1 - sqrt`` cool-down."""
TRIAL_Z = 3.0
"""A cool-down trial holds the LR when the held LR's loss is lower by more than this many standard errors."""


def paired_gap(held: Sequence[float], cooled: Sequence[float]) -> tuple[float, float]:
    """``(mean, z)`` of ``held[i] - cooled[i]`` over the second half: negative when the held LR's loss is lower.

    ``held`` and ``cooled`` are the losses of two trials on the same batches from the same state (each batch's loss
    before its update), so the differences carry no batch noise; the first half, where the two LRs have barely moved
    the weights apart, is left out. The z is the mean over its standard error (0 without spread).

    Example:
        >>> paired_gap([9.0, 9.0, 1.0, 1.1, 1.0, 1.1], [9.0, 9.0, 1.2, 1.2, 1.2, 1.3])
        (-0.1667, -5.0)
    """
    diffs = [h - c for h, c in zip(held[len(held) // 2 :], cooled[len(cooled) // 2 :], strict=True)]
    mean = statistics.fmean(diffs)
    spread = statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else 0.0
    return round(mean, 4), round(mean / spread, 1) if spread > 0 else 0.0


def trial_holds(held: Sequence[float], cooled: Sequence[float], z: float = TRIAL_Z) -> bool:
    """Whether a cool-down trial says to hold the LR: the held LR's loss clearly below the cooled one's.

    A run still limited by its LR learns faster at the peak; one limited by the noise of its updates gets a lower
    loss at once from a lower LR (`benchmarks/cooldown_trial.py` measures the verdict against both continuations).

    Example:
        >>> trial_holds([9.0, 9.0, 1.0, 1.1, 1.0, 1.1], [9.0, 9.0, 1.2, 1.2, 1.2, 1.3])
        True
        >>> trial_holds([1.0, 1.0, 1.3, 1.2], [1.0, 1.0, 1.0, 1.1])
        False
    """
    return paired_gap(held, cooled)[1] < -z


def check_window(warmup_steps: int, total_steps: int, cooldown: float) -> tuple[int, int] | None:
    """``(first, begin)``: the check watches steps ``first`` to ``begin - 1`` and decides at ``begin``.

    ``begin`` is the cool-down's first step; the check watches as many steps as the cool-down takes, none inside the
    warmup. None when that is fewer than `MIN_STEPS`.

    Example:
        >>> check_window(0, 900, 0.2), check_window(600, 900, 0.2), check_window(0, 50, 0.2)
        ((540, 720), (600, 720), None)
    """
    begin = cooldown_start(warmup_steps, total_steps, cooldown)
    first = max(warmup_steps, begin - (total_steps - begin))
    return (first, begin) if begin - first >= MIN_STEPS else None


@dataclasses.dataclass
class CooldownCheck:
    """What the check watched (training losses, reduced over ranks, so every rank decides alike) and decided.

    ``held`` is None until the cool-down's first step, then whether the LR is held to the end; ``drop`` is the
    relative fall of the mean loss from the first half of the steps watched to the second.
    """

    losses: list[float] = dataclasses.field(default_factory=list)
    held: bool | None = None
    drop: float | None = None

    def watch(self, trainer: pl.Trainer, outputs: Any) -> None:
        """Keep this batch's loss (from ``training_step``'s output: a scalar tensor or a dict with one as ``loss``)."""
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if isinstance(loss, Tensor) and loss.numel() == 1:
            self.losses.append(float(trainer.strategy.reduce(loss.detach().float(), reduce_op="mean")))

    def decide(self) -> str:
        """Decide from the losses watched; the line that says what was found."""
        self.held, self.drop = still_falling(self.losses)
        verdict = "still falls: the LR is held to the end" if self.held else "has flattened: cooling down"
        return (
            f"the loss over the {len(self.losses)} steps before the cool-down {verdict} (mean {-self.drop:+.1%} from"
            " their first half to their second)"
        )

    def state(self) -> dict[str, Any]:
        """The check as saved in a checkpoint."""
        return {"losses": list(self.losses), "held": self.held, "drop": self.drop}

    @classmethod
    def from_state(cls, state: dict[str, Any] | None) -> CooldownCheck:
        """The check saved by `state` (a fresh one for None)."""
        state = state or {}
        return cls(list(state.get("losses", [])), state.get("held"), state.get("drop"))

    def report(self, enabled: bool) -> dict[str, Any]:
        """``enabled``, ``held``, ``drop`` and ``steps`` (how many losses were watched)."""
        return {"enabled": enabled, "held": self.held, "drop": self.drop, "steps": len(self.losses)}
