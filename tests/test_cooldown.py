"""The cool-down check: the verdict on a window of losses, which steps it watches, and its trial on real steps."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

import lightning as L
import pytest
from conftest import TinyClassifier, load_benchmark, tiny_trainer

from lightning_speedkit.cooldown import (
    MIN_STEPS,
    TRIAL_STEPS,
    CooldownCheck,
    check_method,
    check_window,
    paired_gap,
    run_trial,
    trial_holds,
    trial_plan,
)
from lightning_speedkit.schedule import still_falling


def noisy(start: float, slope: float, steps: int, noise: float, seed: int = 0) -> list[float]:
    """A loss that moves by ``slope`` a step, with Gaussian noise of ``noise`` (a training loss at a constant LR)."""
    rng = random.Random(seed)
    return [start + slope * k + rng.gauss(0, noise) for k in range(steps)]


@pytest.mark.parametrize("seed", range(5))
def test_a_loss_falling_by_a_fifth_over_the_window_is_still_falling(seed: int) -> None:
    """A loss 20% lower at the end of 180 steps than at their start, under per-step noise of 5%, still falls."""
    falling, drop = still_falling(noisy(1.0, -0.2 / 180, 180, 0.05, seed))
    assert falling
    assert 0.07 < drop < 0.14  # the half means are 90 steps apart: about half the fall


@pytest.mark.parametrize("seed", range(5))
def test_a_flat_noisy_loss_is_not_falling(seed: int) -> None:
    """A loss that only wanders around its level (a run limited by its noise) does not count as falling."""
    assert not still_falling(noisy(0.4, 0.0, 180, 0.05, seed))[0]


def test_a_small_steady_fall_below_the_minimum_drop_is_flat() -> None:
    """A noiseless fall of 1% over the window is clearly there, but below the minimum drop: the cool-down runs."""
    falling, drop = still_falling([1.0 - 0.01 * k / 100 for k in range(100)])
    assert not falling
    assert 0 < drop < 0.01


@pytest.mark.parametrize(
    "losses", [[], [1.0] * 7, [1.0, 0.9, math.nan, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3], [math.inf] + [1.0] * 20]
)
def test_too_few_or_non_finite_losses_are_not_falling(losses: list[float]) -> None:
    """Fewer than 8 losses, or a non-finite one, give no verdict to hold the LR on: the cool-down runs as planned."""
    assert still_falling(losses) == (False, 0.0)


def test_the_window_is_as_long_as_the_cool_down_and_outside_the_warmup() -> None:
    """The check watches as many steps as the cool-down takes, just before it, and never inside the warmup."""
    assert check_window(0, 900, 0.2) == (540, 720)
    assert check_window(100, 900, 0.5) == (100, 450)  # the warmup ends inside the window: it starts after it
    assert check_window(0, 70, 0.2) is None  # a cool-down of 14 steps, under MIN_STEPS: nothing to watch
    assert MIN_STEPS == 16
    assert check_window(0, 1000, 0.0) is None  # no cool-down at all


def test_the_check_state_round_trips_and_reports() -> None:
    """The check's losses and verdict survive a checkpoint's state; its report counts the steps watched."""
    check = CooldownCheck([1.0 - 0.01 * k for k in range(20)])
    assert "still falls" in check.decide()
    clone = CooldownCheck.from_state(check.state())
    assert clone == check
    assert clone.held is True
    report = clone.report("loss")
    assert (report["enabled"], report["method"], report["held"], report["steps"]) == (True, "loss", True, 20)
    assert report["drop"] == check.drop
    assert CooldownCheck.from_state(None) == CooldownCheck()


def test_the_trial_runs_at_the_start_of_the_epoch_holding_the_cool_downs_start() -> None:
    """The trial waits for the epoch in which the cool-down begins and runs at its start, when that start is near.

    900 steps, a 20% cool-down from step 720: epochs of 150 steps wait until step 600 (720 lies in 600-749); one
    that begins 180 or fewer steps before the cool-down (its length) is near enough; one that begins further back,
    or inside the warmup, cannot start from the run's state at the cool-down; an epoch's start after the cool-down's
    is too late. A cool-down shorter than 4 x `TRIAL_STEPS` is not worth the two sides' steps.
    """
    assert TRIAL_STEPS == 32
    assert trial_plan(0, 900, 0.2, 450, 150) is None
    assert trial_plan(0, 900, 0.2, 600, 150) == ""
    assert trial_plan(0, 900, 0.2, 720, 150) == ""
    assert trial_plan(0, 900, 0.2, 540, 200) == ""  # 180 steps before the cool-down: its length
    assert "further before it" in str(trial_plan(0, 900, 0.2, 500, 300))
    assert "inside the warmup" in str(trial_plan(650, 900, 0.2, 600, 300))
    assert "began at step 720" in str(trial_plan(0, 900, 0.2, 750, 150))
    assert "unknown" in str(trial_plan(0, 900, 0.2, 600, None))
    assert "more than half of the 127 cool-down steps" in str(trial_plan(0, 635, 0.2, 500, 100))
    assert trial_plan(0, 640, 0.2, 500, 100) == ""  # 128 cool-down steps: twice the trial's


def test_a_trial_verdict_is_kept_and_an_older_state_still_loads() -> None:
    """A trial's verdict round-trips through a checkpoint's state; a state saved before the trial existed loads too."""
    check = CooldownCheck()
    line = check.decide_trial([2.0] * 8 + [1.0, 1.1] * 4, [2.0] * 8 + [1.3, 1.35] * 4, probe_s=0.5, step=600)
    assert "held to the end" in line
    assert (check.held, check.step, check.probe_s) == (True, 600, 0.5)
    assert CooldownCheck.from_state(check.state()) == check
    old = CooldownCheck.from_state({"losses": [1.0], "held": False, "drop": 0.01})
    assert (old.held, old.gap, old.z, old.step, old.reason) == (False, None, None, None, "")
    skipped = CooldownCheck()
    assert "as planned: why" in skipped.skip("why")
    assert (skipped.held, skipped.reason) == (False, "why")


@pytest.mark.parametrize("value", ["yes", 1, None, "Trial"])
def test_a_bad_cooldown_check_is_named(value: object) -> None:
    """Anything but False, True, "loss" or "trial" raises a ValueError naming `cooldown_check` and the value."""
    with pytest.raises(ValueError, match=f"`cooldown_check` must be False, True, 'loss' or 'trial', got {value!r}"):
        check_method(value)


def test_the_benchmark_judges_each_fits_window_as_the_scheduler_would(tmp_path: Path) -> None:
    """``benchmarks/cooldown_check.py --quick``: one row per task, each with the check's window, verdict and drop."""
    out = tmp_path / "cooldown_check.json"
    result = load_benchmark("cooldown_check").main(["--quick", "--out", str(out)])
    assert json.loads(out.read_text()) == result
    assert [row["task"] for row in result["rows"]] == ["mlp", "conv", "transformer"]
    for row in result["rows"]:
        assert row["window"] == (None if (w := check_window(0, row["steps"], 0.2)) is None else list(w))
        assert isinstance(row["held"], bool)
        assert isinstance(row["drop"], float)


def test_the_trials_paired_gap_compares_the_second_half_batch_by_batch() -> None:
    """Only the second half counts; the same batches make the differences paired, so a steady gap is a large z."""
    held = [5.0, 0.0, 1.0, 1.1, 1.0, 1.1]
    assert paired_gap(held, [0.0, 5.0, 1.2, 1.2, 1.2, 1.3]) == (-0.1667, -5.0)  # the held LR's loss is lower
    assert trial_holds(held, [0.0, 5.0, 1.2, 1.2, 1.2, 1.3])
    assert paired_gap(held, held) == (0.0, 0.0)  # no spread: no z
    assert not trial_holds(held, held)
    mean, z = paired_gap([1.0, 1.0, 1.3, 1.2], [1.0, 1.0, 1.0, 1.1])
    assert mean > 0
    assert z > 0  # the cooled LR's loss is lower: cool down
    assert not trial_holds([1.0, 1.0, 1.3, 1.2], [1.0, 1.0, 1.0, 1.1])
    assert trial_holds([1.0, 1.0, 1.0, 1.1, 1.0], [1.0, 1.0, 1.05, 1.2, 1.2], z=1.0)  # a lower bar holds sooner


class _SkipsSome(TinyClassifier):
    """Skips one batch in four: its ``training_step`` returns None there (Lightning's way to skip a batch)."""

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        loss = super().training_step(batch, batch_idx)
        return None if batch_idx % 4 == 1 else loss


class _Trial(L.Callback):
    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.result = run_trial(trainer, lambda factor: None, steps=8)


def test_the_trial_leaves_the_batches_the_step_skips_out_of_both_sides(tmp_path: Path) -> None:
    """A step that skips a batch in four still gets a verdict: its 8 steps give 6 losses a side, none missing."""
    trial = _Trial()
    trainer = tiny_trainer(tmp_path, callbacks=[trial], max_epochs=1, limit_val_batches=0)
    trainer.fit(_SkipsSome(num_samples=128, batch_size=8))
    assert not isinstance(trial.result, str), trial.result
    held, cooled, _ = trial.result
    assert len(held) == len(cooled) == 6
    assert all(math.isfinite(v) for v in held + cooled)
