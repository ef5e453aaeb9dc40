"""The cool-down check of `lightning_speedkit.WarmupScheduler`: hold the LR to the end when the run is limited by it.

Warmup-stable-decay cools down over the last part of the budget because, at a constant LR, the loss ends up
limited by the noise of the updates, which a lower LR takes out (Hägele et al. 2024). A run whose LR is too low is
not there yet: its loss still falls at the peak LR, and cooling down only slows it (on `benchmarks/lr_tasks.py`'s
MLP at 10x too low an LR, the plain loop reached the target in its last epoch and `preset()` missed it). Two ways
to tell: the **trial** (`run_trial`, `trial_holds`; preset's way) trains `TRIAL_STEPS` steps at the peak LR and
the same batches at `TRIAL_COOLED` of it from the same state, and holds when the peak's loss is clearly lower; the
**loss check** (`CooldownCheck.watch`, `lightning_speedkit.schedule.still_falling`) holds when the training loss
still falls over as many steps as the cool-down takes. Held, the run at the user's LR is exactly the constant-LR
run; otherwise the cool-down runs as planned.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from torch import Tensor
from typing_extensions import override

from lightning_speedkit.budget import schedule_step
from lightning_speedkit.lr_search import scored
from lightning_speedkit.schedule import cooldown_start, still_falling
from lightning_speedkit.trials import Setting, TrialSession

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = [
    "CHECKS",
    "MIN_STEPS",
    "TRIAL_COOLED",
    "TRIAL_STEPS",
    "TRIAL_Z",
    "CooldownCheck",
    "check_method",
    "check_window",
    "describe",
    "paired_gap",
    "run_trial",
    "trial_holds",
    "trial_plan",
]

CHECKS = ("loss", "trial")
"""How `lightning_speedkit.WarmupScheduler` may decide its cool-down: from the loss before it, or by a trial."""

MIN_STEPS = 16
"""The fewest steps the check watches: with fewer, the cool-down runs as planned."""


TRIAL_COOLED = 1.0 / 3.0
"""A cool-down trial's lower LR, as a share of the peak: the mean factor of the ``1 - sqrt`` cool-down."""
TRIAL_Z = 3.0
"""A cool-down trial holds the LR when the held LR's loss is lower by more than this many standard errors."""
TRIAL_STEPS = 32
"""Training steps of each side of a cool-down trial (the held LR, then the cooled one, from the same state)."""


def check_method(value: object) -> str | None:
    """The cool-down check asked for: ``"loss"`` (``True`` too), ``"trial"``, or None (``False``: no check).

    Example:
        >>> check_method(True), check_method("trial"), check_method(False)
        ('loss', 'trial', None)
        >>> check_method("yes")
        Traceback (most recent call last):
        ...
        ValueError: `cooldown_check` must be False, True, 'loss' or 'trial', got 'yes'.
    """
    if value is False or value is True:
        return "loss" if value else None
    if isinstance(value, str) and value in CHECKS:
        return value
    raise ValueError(f"`cooldown_check` must be False, True, 'loss' or 'trial', got {value!r}.")


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


def check_window(warmup_steps: int, total_steps: int, cooldown: float, trial: bool = False) -> tuple[int, int] | None:
    """``(first, begin)``: the check watches steps ``first`` to ``begin - 1`` and decides at ``begin``.

    ``begin`` is the cool-down's first step; the check watches as many steps as the cool-down takes, none inside the
    warmup. None when that is fewer than `MIN_STEPS`. For a ``trial``, ``first`` is the warmup's end, however short
    the window (`trial_plan` says why a trial does not run), and None means no cool-down step.

    Example:
        >>> check_window(0, 900, 0.2), check_window(600, 900, 0.2), check_window(0, 50, 0.2)
        ((540, 720), (600, 720), None)
        >>> check_window(0, 50, 0.2, trial=True), check_window(0, 50, 0.0, trial=True)
        ((0, 40), None)
    """
    begin = cooldown_start(warmup_steps, total_steps, cooldown)
    if trial:
        return (warmup_steps, begin) if begin < total_steps else None
    first = max(warmup_steps, begin - (total_steps - begin))
    return (first, begin) if begin - first >= MIN_STEPS else None


def trial_plan(warmup_steps: int, total_steps: int, cooldown: float, done: int, epoch_steps: int | None) -> str | None:
    """At an epoch's start, ``done`` schedule steps in: ``""`` to run the cool-down trial now, None to wait, or why not.

    The trial runs at the start of the epoch in which the cool-down begins (a trial needs an epoch's start), when
    that start is past the warmup and no further before the cool-down than the cool-down is long (so the state it
    starts from is the run's at the cool-down), and when its two sides cost at most half the cool-down's steps, the
    steps whose LR it decides. ``epoch_steps`` is the epoch's optimizer steps (None when unknown).

    Example:
        >>> trial_plan(0, 900, 0.2, 450, 150), trial_plan(0, 900, 0.2, 600, 150)  # the cool-down starts at step 720
        (None, '')
        >>> trial_plan(0, 300, 0.2, 0, 300)
        'its two sides (2 x 32 steps) would cost more than half of the 60 cool-down steps'
    """
    begin = cooldown_start(warmup_steps, total_steps, cooldown)
    steps = total_steps - begin
    if steps < 4 * TRIAL_STEPS:
        return f"its two sides (2 x {TRIAL_STEPS} steps) would cost more than half of the {steps} cool-down steps"
    if done > begin:
        return f"the cool-down began at step {begin}, before an epoch started"
    if epoch_steps is None:
        return "the epochs' length is unknown (an iterable dataset), so no epoch is known to hold the cool-down's start"
    if done + epoch_steps <= begin:
        return None
    if done < max(warmup_steps, begin - steps):
        return (
            f"the epoch holding the cool-down's start (step {begin}) begins at step {done}: further before it than the"
            f" cool-down's {steps} steps (or inside the warmup), and a trial needs an epoch's start"
        )
    return ""


class _Factor(Setting):
    """The schedule's multiplier pinned at ``factor`` for one trial (through ``pin``; None unpins it)."""

    def __init__(self, name: str, factor: float, pin: Callable[[float | None], None]) -> None:
        self.name, self.factor, self._pin = name, factor, pin

    @override
    def apply(self, trainer: pl.Trainer) -> None:
        self._pin(self.factor)

    @override
    def revert(self, trainer: pl.Trainer) -> None:
        self._pin(None)


def run_trial(
    trainer: pl.Trainer, pin: Callable[[float | None], None], steps: int = TRIAL_STEPS
) -> tuple[list[float], list[float], float] | str:
    """The cool-down trial: ``steps`` real steps at the held LR, then the same batches at `TRIAL_COOLED` of it.

    Both sides start from the run's state at this epoch's start and everything is put back afterwards
    (`lightning_speedkit.trials.TrialSession`); ``pin`` fixes the schedule's multiplier for a side. Returns each
    side's losses and the seconds both took, or why there is no verdict (a side failed, a loss was not a finite
    scalar). A batch the ``training_step`` skips (no loss in the held side) is left out of both (`scored`).
    """
    with TrialSession(trainer, steps, warmup=0, replay=True) as session:
        batches = session.batches_per_epoch()
        sides = [
            session.run(_Factor(name, f, pin), max_batches=batches)
            for name, f in (("held", 1.0), ("cooled", TRIAL_COOLED))
        ]
    failed = next((side for side in sides if not side.fits), None)
    if failed is not None:
        return f"its {failed.setting} side failed ({failed.error})"
    held, cooled = (scored(sides[0].losses, side.losses) for side in sides)  # a batch the step skips: left out
    if len(held) < 2 or len(cooled) != len(held) or not all(map(math.isfinite, held + cooled)):
        return "a trial step gave no finite scalar loss"
    return held, cooled, session.elapsed_s


def describe(check: dict[str, Any], cooldown: float) -> str:
    """The ``"wsd"`` schedule as its cool-down check decided (``check``: `CooldownCheck.report`), in a few words.

    Example:
        >>> describe({"held": True, "step": 600}, 0.2)
        'wsd (LR held: a trial at step 600 found the peak LR still lowering the loss faster)'
        >>> describe({"held": False, "step": 600}, 0.2), describe({}, 0.2)
        ('wsd (cool-down 20%, chosen by a trial at step 600)', 'wsd (cool-down 20%)')
    """
    step = check.get("step")
    if check.get("held"):
        if step is not None:
            return f"wsd (LR held: a trial at step {step} found the peak LR still lowering the loss faster)"
        return f"wsd (LR held: the loss still fell before the {cooldown:.0%} cool-down)"
    chosen = f", chosen by a trial at step {step}" if step is not None else ""
    return f"wsd (cool-down {cooldown:.0%}{chosen})"


@dataclasses.dataclass
class CooldownCheck:
    """What the check watched or tried, and what it decided (every rank alike).

    ``held`` is None until decided, then whether the LR is held to the end. The loss check keeps the training losses
    it watched (reduced over ranks) and ``drop``, the relative fall of their mean from the first half to the second;
    the trial keeps ``gap`` and ``z`` (`paired_gap`), ``probe_s`` (both sides' seconds) and ``step`` (where it ran).
    ``reason`` says why the cool-down ran as planned without a verdict.
    """

    losses: list[float] = dataclasses.field(default_factory=list)
    held: bool | None = None
    drop: float | None = None
    gap: float | None = None
    z: float | None = None
    probe_s: float = 0.0
    step: int | None = None
    reason: str = ""

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

    def decide_trial(self, held: Sequence[float], cooled: Sequence[float], probe_s: float, step: int) -> str:
        """Decide from a trial's two sides (`trial_holds`); the line that says what was found."""
        self.gap, self.z = paired_gap(held, cooled)
        self.held, self.probe_s, self.step = self.z < -TRIAL_Z, probe_s, step
        verdict = "lower: the LR is held to the end" if self.held else "not clearly lower: cooling down"
        return (
            f"a trial at step {step} ({len(held)} steps at the peak LR, then at {TRIAL_COOLED:.2g} of it, {probe_s:.2f}"
            f" s): the peak LR's loss is {verdict} (gap {self.gap:+.4g}, z {self.z:+.1f}, {TRIAL_Z:g} needed)"
        )

    def try_at_epoch_start(
        self, trainer: pl.Trainer, schedule: tuple[int, int, int], cooldown: float, pin: Callable[[float | None], None]
    ) -> str | None:
        """At an epoch's start: run the trial if this is its epoch (`trial_plan`) and decide; the line, or None.

        ``schedule`` is ``(warmup_steps, total_steps, start_step)``; None means nothing was decided yet (a later epoch
        holds the cool-down's start).
        """
        warmup_steps, total_steps, start = schedule
        batches = trainer.num_training_batches
        epoch_steps = None if math.isinf(batches) else math.ceil(batches / trainer.accumulate_grad_batches)
        done = schedule_step(trainer) - start
        plan = trial_plan(warmup_steps, total_steps, cooldown, done, epoch_steps)
        if plan is None:
            return None
        if plan:
            return self.skip(plan)
        outcome = run_trial(trainer, pin)
        if isinstance(outcome, str):
            return self.skip(outcome)
        return self.decide_trial(*outcome, step=schedule_step(trainer))

    def skip(self, reason: str) -> str:
        """No verdict: the cool-down runs as planned; the line that says why."""
        self.held, self.reason = False, reason
        return f"no cool-down trial, cooling down as planned: {reason}"

    def state(self) -> dict[str, Any]:
        """The check as saved in a checkpoint."""
        return dataclasses.asdict(self)

    @classmethod
    def from_state(cls, state: dict[str, Any] | None) -> CooldownCheck:
        """The check saved by `state` (a fresh one for None; a key an older version did not save takes its default)."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in (state or {}).items() if k in names})

    def report(self, method: str | None) -> dict[str, Any]:
        """``enabled``, ``method``, ``held``, ``drop``, ``steps`` (losses watched) and the trial's fields."""
        trial = {"gap": self.gap, "z": self.z, "probe_s": self.probe_s, "step": self.step, "reason": self.reason}
        return {
            "enabled": method is not None,
            "method": method,
            "held": self.held,
            "drop": self.drop,
            "steps": len(self.losses),
            **trial,
        }
