"""The LR search's maths: paired trials see through a plateau, the user's LR is kept unless clearly and much worse."""

from __future__ import annotations

import math
import random

from lightning_speedkit.lr import MIN_SIGNAL, curve_signal
from lightning_speedkit.lr_search import REFERENCE, broke, choose_scale, moved, next_scale, paired_gain, plateau


def _plateau_curves(drift_per_lr: float, scales: tuple[float, ...], steps: int = 16) -> dict[float, list[float]]:
    """Losses at chance (2.3) with batch noise far above the LRs' effect, the same batches (noise) for every trial."""
    rng = random.Random(0)
    batch_noise = [rng.gauss(0.0, 0.15) for _ in range(steps)]
    jitter = random.Random(1)
    curves = {}
    for scale in (REFERENCE, *scales):
        curves[scale] = [
            2.3 + batch_noise[t] - drift_per_lr * scale * t + jitter.gauss(0.0, 0.002) for t in range(steps)
        ]
    return curves


def test_paired_trials_see_an_lr_through_a_plateau_a_range_test_cannot() -> None:
    """On a plateau, one curve's fall is noise (curve_signal < 3), but paired trials tell a higher LR is better."""
    curves = _plateau_curves(drift_per_lr=0.001, scales=(1.0, 10.0, 100.0))
    assert curve_signal(curves[10.0], beta=0.0) < MIN_SIGNAL  # a range test would see nothing here
    assert moved(curves, 10.0)
    assert next_scale({s: curves[s] for s in (REFERENCE, 1.0, 10.0)}, 0.01, 100) == 100.0
    scale, why = choose_scale(curves)
    assert scale == 10.0, why  # x100 is the edge (the search's bound): one decade below it


def test_a_raise_stops_a_decade_below_the_edge() -> None:
    """Ten times the LR helps much (early progress grows with the LR) but a hundred times blows up: kept, not raised."""
    steps = 12
    reference = [2.0] * steps
    curves = {
        REFERENCE: reference,
        1.0: [2.0 - 0.01 * t for t in range(steps)],
        10.0: [2.0 - 0.1 * t for t in range(steps)],
        100.0: [2.0 + (5.0 if t else 0.0) for t in range(steps)],
    }
    assert next_scale({s: curves[s] for s in (REFERENCE, 1.0, 10.0)}, 0.01, 100) == 100.0
    assert next_scale(curves, 0.01, 100) is None
    scale, why = choose_scale(curves)
    assert scale == 1.0
    assert why.startswith("x10 is the highest LR that helped (x100 did not)")


def test_an_lr_about_right_is_kept() -> None:
    """Ten times the LR does less than three times the progress: the user's LR is kept, and the walk goes no higher."""
    steps = 12
    reference = [2.0] * steps
    mine = [2.0 - 0.05 * t for t in range(steps)]
    faster = [2.0 - 0.09 * t for t in range(steps)]  # 1.8x the progress: more, but not KEEP's 3x
    curves = {REFERENCE: reference, 1.0: mine, 10.0: faster}
    assert next_scale(curves, 0.01, 100) is None  # no trial at x100: its steps would not change the choice here
    scale, why = choose_scale(curves)
    assert scale == 1.0
    assert why == f"your LR does {0.05 / 0.09:.0%} of the best progress (x10): kept"


def test_an_lr_that_blows_the_loss_up_is_lowered() -> None:
    """The user's LR spikes the loss: the search goes down, and picks the LR that learns."""
    reference = [2.0, 2.1, 2.0, 2.1, 2.0, 2.1, 2.0, 2.1]
    mine = [2.0, 9.0, 4.0, 2.5, 2.2, 2.1, 2.1, 2.1]
    assert broke({REFERENCE: reference, 1.0: mine}, 1.0)
    curves: dict[float, list[float]] = {REFERENCE: reference, 1.0: mine}
    assert next_scale(curves, 0.01, 100) == 0.1
    curves[0.1] = [2.0 - 0.05 * t for t in range(8)]
    assert next_scale(curves, 0.01, 100) == 0.01
    curves[0.01] = [2.0 - 0.01 * t for t in range(8)]
    assert next_scale(curves, 0.01, 100) is None
    assert choose_scale(curves)[0] == 0.1


def test_going_down_stops_where_the_evidence_does() -> None:
    """A lower LR is chosen over a higher one only when it ended clearly lower: not on noise.

    The losses are the conv net's at 10x too high (seed 2 of `benchmarks/lr_tasks.py`, 7-step trials on its chance
    plateau): the user's LR blew the loss up, x0.1 and x0.01 did not move it; x0.01 ended 0.002 lower on noise, and
    choosing it left the run ten times too slow to reach its target.
    """
    curves = {
        REFERENCE: [1.39, 1.389, 1.38, 1.411, 1.407, 1.399, 1.369],
        1.0: [1.39, 2.684],
        0.1: [1.39, 1.399, 1.386, 1.411, 1.386, 1.392, 1.398],
        0.01: [1.39, 1.389, 1.381, 1.412, 1.4, 1.388, 1.377],
    }
    assert next_scale(curves, 0.01, 100) is None
    scale, why = choose_scale(curves)
    assert scale == 0.1
    assert why == "x0.1 is the highest LR below yours that did not blow the loss up; no lower LR ended clearly lower"
    curves[0.01] = [1.39 - 0.05 * t for t in range(7)]  # clearly lower than x0.1: the descent goes on to it
    assert choose_scale(curves)[0] == 0.01


def _noisy(reference: list[float], drift: float, phase: int) -> list[float]:
    """``reference`` lowered by ``drift`` a step, with a small noise of its own (0.001, a pattern set by ``phase``)."""
    return [r - drift * t + 0.001 * ((t * phase) % 3 - 1) for t, r in enumerate(reference)]


def test_going_down_the_choice_and_its_checks_come_from_the_descent() -> None:
    """The LR below yours that the descent reaches is the one checked and chosen, not a lower one ahead on noise.

    Your LR neither moves the loss nor breaks, ten times breaks: x0.1 ends clearly lower than yours, x0.01 a little
    lower than x0.1 but not clearly. x0.1 is chosen (the check against yours is x0.1's, not x0.01's); and an LR below
    yours must do three times your progress to be chosen, as one above must.
    """
    reference = [2.0 + 0.01 * (-1) ** t for t in range(8)]
    curves = {REFERENCE: reference, 1.0: _noisy(reference, 0.0, 7), 10.0: [2.01, 9.0]}
    curves[0.1] = _noisy(reference, 0.003, 5)
    assert next_scale(curves, 0.01, 100) == 0.01
    curves[0.01] = _noisy(reference, 0.0031, 7)
    assert next_scale(curves, 0.01, 100) is None
    assert choose_scale(curves) == (0.1, "x0.1 lowers the loss by 0.021 in 8 steps, your LR by 0.0001")
    curves = {REFERENCE: reference, 1.0: _noisy(reference, 0.001, 7), 10.0: [2.01, 9.0]}
    curves[0.1] = _noisy(reference, 0.002, 5)  # twice your progress: not three times
    assert choose_scale(curves) == (1.0, "your LR does 51% of the progress of x0.1, the best below it: kept")


def test_a_trial_that_broke_is_not_a_step_down() -> None:
    """A lower LR that blew the loss up (and came back lower) ends the descent: neither it nor any below is chosen.

    Your LR neither moves the loss nor breaks, ten times breaks; x0.1 spikes past the reference, then ends far
    lower than yours (clearly lower, so only its breaking keeps it out).
    """
    reference = [2.0] * 8
    curves = {
        REFERENCE: reference,
        1.0: [2.0, 2.01, 1.99, 2.0, 2.01, 1.99, 2.0, 2.0],
        10.0: [2.0, 9.0],
        0.1: [2.0, 3.5, 1.5, 1.0, 0.6, 0.4, 0.3, 0.2],
        0.01: [2.0 - 0.05 * t for t in range(8)],
    }
    assert broke(curves, 0.1)
    assert not broke(curves, 1.0)
    assert choose_scale(curves)[0] == 1.0


def test_a_nan_trial_is_broken_and_never_chosen() -> None:
    """A trial with a non-finite loss gains -inf against anything and is not chosen."""
    reference = [2.0, 2.0, 2.0, 2.0]
    curves = {REFERENCE: reference, 1.0: [2.0, 1.9, 1.8, 1.7], 10.0: [2.0, math.nan, math.nan, math.nan]}
    assert paired_gain(curves[1.0], curves[10.0]) == (-math.inf, 0.0)
    assert broke(curves, 10.0)
    assert next_scale(curves, 0.01, 100) is None  # the user's LR learns: no need to go down
    assert choose_scale(curves)[0] == 1.0


def test_the_search_stays_within_its_bounds() -> None:
    """Going up stops at ``high``; going down stops at ``low``."""
    reference = [2.0] * 8
    better = {REFERENCE: reference, 1.0: [2.0 - 0.01 * t for t in range(8)], 10.0: [2.0 - 0.1 * t for t in range(8)]}
    assert next_scale(better, 0.01, 10) is None
    assert next_scale(better, 0.01, 100) == 100.0


def test_nothing_moved_is_a_plateau() -> None:
    """No trial ends clearly below the reference: `plateau` says so (the finder may then try longer trials)."""
    curves = _plateau_curves(drift_per_lr=0.0, scales=(1.0, 10.0))
    assert plateau(curves)
    assert choose_scale(curves)[0] == 1.0
