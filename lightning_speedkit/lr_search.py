"""The maths of an LR search by short trials: which LR to try next, and which to keep.

Each trial trains the same k steps on the same batches from the same weights at the user's LR times a scale on a
grid of decades (x10), beside one reference trial of the same steps at LR 0 (the weights never move).
Because the batches are the same, the difference between two trials' losses at each step carries no batch noise:
`paired_gain` compares them step by step, which sees an LR move the loss by a fraction of its noise, where a range
test's single curve on a plateau shows nothing (the demo's ResNet sits at its chance loss for its first hundred
steps; a range test's ``curve_signal`` there is 0.3-2.0). A trial's progress is how much lower it ends than the
reference. The user's LR is kept unless another does at least three times its progress, with the difference clear of the
noise (`choose_scale`): a raise that only looks better over k steps is the one that can make a long run miss its
target.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

__all__ = [
    "BROKE",
    "GRID",
    "REFERENCE",
    "broke",
    "broke_ceiling",
    "choose_scale",
    "grid_scale",
    "moved",
    "next_scale",
    "paired_gain",
    "plateau",
    "progress_of",
    "scored",
    "walk",
]

GRID = 10.0
"""The ratio between neighbouring LRs the search tries: a decade, so three trials (a reference, the user's LR and
ten times it) already tell an LR 10x or 100x too low from one about right, at the least cost."""

REFERENCE = 0.0
"""The scale of the reference trial: the same steps at LR 0, the loss the weights have if they do not move."""

CLEAR = 2.0
"""How many standard errors a paired gain must be above zero to count."""

KEEP = 1 / 3
"""The user's LR is kept while its progress is at least this share of the best LR's: a third, the share a 3.16x
higher LR leaves when progress still grows in proportion to the LR (the LR is far too low)."""

Curves = Mapping[float, Sequence[float]]
"""Each trial's losses, by scale of the user's LR (`REFERENCE` for the reference trial)."""


def _finite(losses: Sequence[float]) -> bool:
    return bool(losses) and all(math.isfinite(v) for v in losses)


def paired_gain(base: Sequence[float], other: Sequence[float]) -> tuple[float, float]:
    """How much lower ``other`` ends than ``base`` on the same batches, and that figure's standard error.

    Both trials start from the same weights, so their difference ``d[t] = base[t] - other[t]`` starts at 0 and,
    while the LRs are small next to what the loss can take, grows about linearly with the step. The gain is the
    least-squares line through the origin fitted to ``d``, read at the last step: every step contributes, weighted
    by how far the trials have had to drift apart. A trial that broke (a non-finite loss) gains ``-inf``; against a
    broken base, a finite trial gains ``inf``.

    Example:
        >>> paired_gain([2.0, 1.9, 1.8, 1.7], [2.0, 1.8, 1.6, 1.4])
        (0.3, 0.0)
        >>> paired_gain([2.0, 2.0], [2.0, float("nan")])
        (-inf, 0.0)
    """
    if not _finite(other):
        return -math.inf, 0.0
    if not _finite(base):
        return math.inf, 0.0
    n = min(len(base), len(other))
    if n < 3:
        return (base[n - 1] - other[n - 1] if n else 0.0), math.inf
    diffs = [base[t] - other[t] for t in range(n)]
    weight = sum(t * t for t in range(n))
    slope = sum(t * d for t, d in enumerate(diffs)) / weight
    residual = sum((d - slope * t) ** 2 for t, d in enumerate(diffs)) / (n - 1)
    return round(slope * (n - 1), 12), round(math.sqrt(residual / weight) * (n - 1), 12)


def scored(reference: Sequence[float | None], losses: Sequence[float | None]) -> list[float]:
    """A trial's losses at the steps where the reference trial has one, NaN where only the reference has one.

    The trials run the same batches in the same order, so a batch the user's ``training_step`` skips (it returns no
    loss: Lightning's way to skip a batch) is skipped in every trial and is left out of each. A loss missing where the
    reference has one is NaN: the trial broke there (a step that skips a non-finite loss). A trial that stopped early
    (it broke) is as long as it ran.

    Example:
        >>> scored([2.0, None, 1.9, 1.8], [2.0, None, 1.7, None])
        [2.0, 1.7, nan]
        >>> scored([2.0, None, 1.9], [2.0, 1.8])
        [2.0]
    """
    return [math.nan if v is None else float(v) for r, v in zip(reference, losses, strict=False) if r is not None]


def progress_of(curves: Curves) -> dict[float, float]:
    """Each LR trial's progress: how much lower it ends than the reference trial (`paired_gain`); -inf if it broke.

    Example:
        >>> progress_of({0.0: [2.0, 2.0, 2.1, 2.0], 1.0: [2.0, 1.9, 1.9, 1.7], 3.0: [2.0, 1.8, 1.5, 1.3]})
        {1.0: 0.3, 3.0: 0.75}
    """
    reference = curves[REFERENCE]
    return {scale: paired_gain(reference, curve)[0] for scale, curve in curves.items() if scale != REFERENCE}


def _better(curves: Curves, better: float, than: float) -> bool:
    """Whether ``better`` ends clearly lower than ``than``, or ``than`` broke (`broke`) and ``better`` did not."""
    if broke(curves, than):
        return not broke(curves, better)
    return _clear(curves, better, than)


def _clear(curves: Curves, better: float, than: float) -> bool:
    """Whether trial ``better`` ends clearly lower than trial ``than`` (gain over `CLEAR` standard errors)."""
    gain, error = paired_gain(curves[than], curves[better])
    return gain > 0 and (math.isinf(gain) or gain > CLEAR * error)


def moved(curves: Curves, scale: float = 1.0) -> bool:
    """Whether the trial at ``scale`` ends clearly lower than the reference: its LR moved the loss.

    Example:
        >>> moved({0.0: [2.0, 2.1, 2.0, 2.1], 1.0: [2.0, 2.0, 1.9, 2.0]})
        True
        >>> moved({0.0: [2.0, 2.1, 2.0, 2.1], 1.0: [2.0, 2.2, 1.9, 2.2]})
        False
    """
    return _clear(curves, scale, REFERENCE)


BROKE = 0.5
"""A trial broke when a loss after its first step is this share above the reference's highest (or one is not
finite): the LR blew the loss up, even if it then fell back (dead units often leave it at chance)."""


def broke(curves: Curves, scale: float) -> bool:
    """Whether the trial at ``scale`` blew the loss up (`BROKE`), however it ended.

    Example:
        >>> ref = [2.0, 2.1, 2.0, 2.1]
        >>> broke({0.0: ref, 10.0: [2.0, 9.5, 2.4, 2.1]}, 10.0), broke({0.0: ref, 10.0: [2.0, 2.2, 2.1, 2.3]}, 10.0)
        (True, False)
    """
    losses = curves[scale]
    if not _finite(losses):
        return True
    return max(losses[1:], default=-math.inf) > broke_ceiling(curves[REFERENCE])


def broke_ceiling(reference: Sequence[float]) -> float:
    """The loss over which a trial broke (`BROKE`), from the reference trial's losses.

    A trial can stop at the first step over it (`lightning_speedkit.lr_trial.broke_after`): it has broken however
    it ends.

    Example:
        >>> broke_ceiling([2.0, 2.5, 2.0])
        3.75
    """
    highest = max(reference)
    return highest + BROKE * abs(highest)


def plateau(curves: Curves) -> bool:
    """Whether no LR trial moved the loss clearly (`moved`): nothing to tell the LRs apart by at this length."""
    return not any(moved(curves, scale) for scale in curves if scale != REFERENCE)


def next_scale(curves: Curves, low: float, high: float) -> float | None:
    """The next scale to try, or None when the search is done.

    Up first (x `GRID`), while each step up ends clearly lower than the one before and the user's LR does under
    `KEEP` of its progress (at a third or more, progress no longer grows in proportion to the LR: the user's LR is
    kept, and a trial further up would only cost its steps). Down only when the user's LR itself blew the loss up
    (`broke`), then one decade at a time while every LR from the user's down broke. Neither an LR that ends a few
    steps higher without breaking nor ten times breaking is evidence: the demo's ResNet at its right LR ends its
    first 6 steps above the reference on some seeds (a transient), and a tenth of it, which barely moves the weights,
    ends lower; a conv net with BatchNorm and SGD at its best LR has ten times blow up on every seed (an SGD net's
    best LR sits near the edge of stability) while its own LR, through a first transient, did not clearly move the
    loss over 7 steps on 3 seeds of 10; a tenth of it, far lower there, was chosen, and `preset()` at that tenth
    misses the target on seed 0 and takes 2.50 s against 1.43 s on seed 2.
    So the walk never goes below the first LR that did not blow up. ``low``/``high`` bound the scales.

    Example:
        >>> ref = [2.0, 2.1, 2.0, 2.1, 2.0, 2.1, 2.0, 2.1]
        >>> mine = [2.0, 2.0, 1.9, 1.9, 1.8, 1.9, 1.7, 1.8]
        >>> next_scale({0.0: ref, 1.0: mine}, 0.01, 100)
        10.0
        >>> next_scale({0.0: ref, 1.0: mine, 10.0: [2.0, 2.0, 1.9, 1.9, 1.8, 1.89, 1.71, 1.8]}, 0.01, 100) is None
        True
        >>> next_scale({0.0: ref, 1.0: [2.0, 9.0, 9.0, 9.0]}, 0.01, 100)  # your LR blew up: down
        0.1
        >>> next_scale({0.0: ref, 1.0: ref, 10.0: [2.0, 2.3, 2.5, 2.9, 3.3, 3.5, 3.7, 4.1]}, 0.01, 100) is None
        True
        >>> next_scale({0.0: ref, 1.0: mine, 10.0: [2.0, 1.7, 1.5, 1.3, 1.1, 1.0, 0.8, 0.7]}, 0.01, 100)
        100.0
        >>> next_scale({0.0: ref, 1.0: mine, 10.0: [2.0, 1.9, 1.8, 1.7, 1.6, 1.6, 1.5, 1.5]}, 0.01, 100) is None
        True
    """
    scales = sorted(scale for scale in curves if scale != REFERENCE)
    top, bottom = scales[-1], scales[0]
    if top == 1.0 and bottom == 1.0:
        return _down(1.0, low) if broke(curves, 1.0) else _up(1.0, high)
    if bottom == 1.0:
        below = max(s for s in scales if s < top)
        if _better(curves, top, below):
            progress = progress_of(curves)
            return None if math.isfinite(progress[1.0]) and progress[1.0] >= KEEP * progress[top] else _up(top, high)
    return _down(bottom, low) if all(broke(curves, s) for s in scales if s <= 1.0) else None


def walk(trial: Callable[[float], Sequence[float]], trials: float, low: float, high: float) -> dict[float, list[float]]:
    """Run the search's trials in order, as many as ``trials`` allows: the reference, the user's LR, `next_scale`'s.

    ``trial(scale)`` trains the same steps at ``scale`` times the user's LR and gives their losses; ``trials`` is how
    many fit in the search's share of the run (fractional, or ``inf`` for a run with no step limit). The LR finder walks
    once, and on a plateau again with trials four times as long: the second walk goes on up (or down) like the first,
    so it can find an LR the short trials could not tell apart.

    Example:
        >>> def trial(scale):  # progress grows with the LR up to x100; above it, the loss blows up
        ...     return [2.0 - (0.01 * scale * t if scale <= 100 else -t) for t in range(4)]
        >>> curves = walk(trial, 9, 0.01, 1000)
        >>> sorted(curves), choose_scale(curves)[0]
        ([0.0, 1.0, 10.0, 100.0, 1000.0], 10.0)
        >>> sorted(walk(trial, 3.9, 0.01, 1000)), sorted(walk(trial, float("inf"), 0.01, 10))
        ([0.0, 1.0, 10.0], [0.0, 1.0, 10.0])
    """
    curves: dict[float, list[float]] = {}
    scale: float | None = REFERENCE
    while scale is not None and len(curves) + 1 <= trials:
        curves[scale] = list(trial(scale))
        scale = 1.0 if len(curves) == 1 else next_scale(curves, low, high)
    return curves


def grid_scale(index: int) -> float:
    """The ``index``-th scale of the decade grid, rounded so that steps up and down meet exactly.

    Example:
        >>> [grid_scale(k) for k in (-1, 0, 1, 2)]
        [0.1, 1.0, 10.0, 100.0]
    """
    return round(GRID**index, 8)


def _index(scale: float) -> int:
    return round(math.log(scale, GRID))


def _up(scale: float, high: float) -> float | None:
    nxt = grid_scale(_index(scale) + 1)
    return nxt if nxt <= high * 1.0001 else None


def _down(scale: float, low: float) -> float | None:
    nxt = grid_scale(_index(scale) - 1)
    return nxt if nxt >= low * 0.9999 else None


def choose_scale(curves: Curves) -> tuple[float, str]:
    """The scale of the user's LR to keep, and why (1.0 unless another LR is clearly and much better).

    Another LR is chosen only when it ends clearly lower than the user's on the same batches and does at least three
    times the user's progress (`KEEP`); the best is the one with the most progress of those clearly lower (a higher
    trial whose noise hides whether it beat the user's does not hide one below it that did). Down (only when the user's
    LR blew the loss up), the first LR below the user's that did not break (`_step_down`), never a lower one that ends
    lower than it: over a few steps a lower LR can look better on noise or through a higher one's first transient, and
    it is the one that learns ten times slower for the whole run (the conv net at 10x too high, on a plateau over 7
    steps, took x0.01 on noise and missed its target; the demo's ResNet at 10x too high took x0.01 for ending 0.008
    below the reference, where its right LR, whose 6 steps rose first, ended 0.044 above it, and missed too). Up, one
    decade below the edge: the highest LR that still ended clearly lower than the one below it. Over a few steps a
    higher LR nearly always looks better (early progress grows with the LR, for SGD in proportion), so the edge is where
    the short trials stop telling, and a run at the edge is the run that can miss its target; a decade below it is what
    a range test's rule of thumb picks too (a tenth of the divergence), also when the search stopped before trying the
    LR above it. The edge itself when the LR tried above it did not blow the loss up (`broke`: no loss half again over
    the reference's highest, though it may end higher than the edge): the divergence is taken to be above that LR, so a
    tenth of it is above the edge (the MLP's right SGD LR has x100 blow up on every seed and stays; the transformer at
    10x too low has x100 end not clearly lower than x10, and is raised to its right LR).

    Example:
        >>> ref = [2.0, 2.0, 2.0, 2.0]
        >>> choose_scale({0.0: ref, 1.0: [2.0, 1.9, 1.8, 1.7], 10.0: [2.0, 1.88, 1.78, 1.66]})
        (1.0, 'your LR does 89% of the best progress (x10): kept')
        >>> slow = [2.0, 2.0, 1.99, 1.99]
        >>> choose_scale({0.0: ref, 1.0: slow, 10.0: [2.0, 1.9, 1.8, 1.7], 100.0: [2.0, 9.0, 9.0, 9.0]})
        (1.0, 'x10 is the highest LR that helped (x100 blew the loss up): one decade below it is yours, kept')
        >>> choose_scale({0.0: ref, 1.0: slow, 10.0: [2.0, 1.9, 1.8, 1.7], 100.0: [2.0, 1.95, 1.85, 1.75]})[0]
        10.0
        >>> choose_scale({0.0: ref, 1.0: slow, 10.0: [2.0, 1.9, 1.8, 1.7], 100.0: [2.0, 1.7, 1.5, 1.4]})
        (10.0, 'x10 lowers the loss by 0.3 in 4 steps, your LR by 0.011; x100 helped more, but is the edge')
        >>> flat = [2.0, 2.01, 1.99, 2.0]  # x0.1 did not move the loss, but it stopped the blow-up
        >>> choose_scale({0.0: ref, 1.0: [2.0, 9.0], 0.1: flat})
        (0.1, 'x0.1 is the highest LR below yours that did not blow the loss up')
    """
    progress = progress_of(curves)
    mine = progress[1.0]
    steps = max(len(losses) for losses in curves.values())  # a trial's length (one that broke may have stopped)
    mine_text = "nothing (it broke)" if broke(curves, 1.0) else f"{mine:.2g}"
    down = _step_down(curves)
    if down is not None:
        return _choose_down(curves, down, progress, f"in {steps} steps, your LR by {mine_text}")
    better = [scale for scale in progress if scale > 1.0 and _better(curves, scale, 1.0) and progress[scale] > 0]
    if not better:
        return 1.0, f"no LR clearly better than yours (tried {_scales(curves)})"
    best = max(better, key=lambda s: (progress[s], -s))
    if math.isfinite(mine) and mine >= KEEP * progress[best]:
        share = mine / progress[best]
        return 1.0, f"your LR does {share:.0%} of the best progress (x{best:.4g}): kept"
    edge, higher = _edge(curves)
    blew = higher is not None and broke(curves, higher)
    if edge > 1.0 and higher is not None and not blew:  # the divergence is above `higher`; a tenth of it, above `edge`
        return edge, (
            f"x{edge:.4g} lowers the loss by {progress[edge]:.2g} in {steps} steps, your LR by {mine_text};"
            f" x{higher:.4g} was not clearly better and did not blow the loss up"
        )
    chosen = max(1.0, grid_scale(_index(edge) - 1))
    if chosen == 1.0:
        after = "" if higher is None else f" (x{higher:.4g} {'blew the loss up' if blew else 'did not'})"
        return 1.0, f"x{edge:.4g} is the highest LR that helped{after}: one decade below it is yours, kept"
    return chosen, (
        f"x{chosen:.4g} lowers the loss by {progress[chosen]:.2g} in {steps} steps, your LR by {mine_text};"
        f" x{edge:.4g} helped more, but is the edge"
    )


def _choose_down(curves: Curves, chosen: float, progress: Mapping[float, float], tail: str) -> tuple[float, str]:
    """`choose_scale` below the user's LR, which broke, at ``chosen`` (`_step_down`; ``tail``: the trials' length)."""
    if not moved(curves, chosen):
        return chosen, f"x{chosen:.4g} is the highest LR below yours that did not blow the loss up"
    return chosen, f"x{chosen:.4g} lowers the loss by {progress[chosen]:.2g} {tail}"


def _step_down(curves: Curves) -> float | None:
    """The LR below the user's that the walk down reached: the first that did not break (`broke`), or None.

    Only when the user's LR blew the loss up (`next_scale`), so every LR from the user's down to it broke.
    """
    if not broke(curves, 1.0):
        return None
    below = sorted((s for s in curves if REFERENCE < s < 1.0), reverse=True)
    return next((scale for scale in below if not broke(curves, scale)), None)


def _edge(curves: Curves) -> tuple[float, float | None]:
    """The edge of the search up: the last LR that ended clearly lower than the one below it, and the next one tried.

    The next one is None when the search stopped at its bound.
    """
    ups = sorted(s for s in curves if s > 1.0)
    edge = 1.0
    for scale in ups:
        if not _better(curves, scale, edge):
            return edge, scale
        edge = scale
    return edge, None


def _scales(curves: Curves) -> str:
    return ", ".join(f"x{s:.3g}" for s in sorted(curves) if s != REFERENCE)
