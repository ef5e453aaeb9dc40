"""Speed decisions: when a probe can pay back, which measured setting to keep, and whether its numerics are sound.

The rules every lever follows, in one place (the trials themselves run in `lightning_speedkit.trials`):

- **A probe runs only when it can pay back.** A probe costs about ``probe_steps`` training steps (each trial step is
  a real step whose work is thrown away). A lever can at best save ``max_gain`` of each remaining step, so it probes
  only when ``max_gain * steps_left >= payback * probe_steps`` (`probe_pays_back`; ``payback=4``, since the best
  case is rarely met). Otherwise the probe is skipped, and the reason is in the lever's ``report()``. The steps left
  come from `lightning_speedkit.trials.steps_left`. Every probe's seconds are in its lever's report. So a job of
  tens of steps is never slowed by probing; a candidate grossly slower stops early (`cut_short`, `grossly_slower`).
- **A candidate is kept only when it wins by a margin** over the setting in place, measured in the same run
  (`choose_setting`), so noise never flips a decision and "without it" is always the reference.
- **A faster candidate must also train alike:** a finite loss, not clearly worse than the reference's (`loss_is_sound`).

Arguments are checked with `lightning_speedkit.checks` (`check_margin` and `check_probe_steps` re-exported here).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence

from lightning_speedkit.checks import check_margin, check_probe_steps

__all__ = [
    "CUT_AFTER",
    "DROP_AFTER",
    "GROSSLY",
    "NOISE_Z",
    "PAYBACK",
    "block_medians",
    "check_margin",
    "check_probe_steps",
    "choose_setting",
    "clearly_slower",
    "clearly_slower_bound",
    "counted_cost",
    "cut_short",
    "fitted_block",
    "grossly_slower",
    "loss_is_sound",
    "may_lose",
    "outside_band",
    "paired_ratios",
    "probe_pays_back",
    "round_ratios",
    "round_wins",
    "weigh_by_rounds",
]


PAYBACK = 4.0
"""How many times over the best case of a lever must repay its probe (`probe_pays_back`)."""


def probe_pays_back(
    probe_steps: float, steps_left: float, max_gain: float, payback: float = PAYBACK
) -> tuple[bool, str]:
    """Whether a probe of ``probe_steps`` training steps can pay itself back within ``steps_left`` steps.

    The best a lever can do is save ``max_gain`` of every remaining step (0.5: each step twice as fast), so the probe
    runs only when that best case repays it ``payback`` times over. Everything is counted in training steps, so no
    step has to be timed before deciding whether to time any.

    Example:
        >>> probe_pays_back(probe_steps=8, steps_left=1000, max_gain=0.3)
        (True, 'the probe (8 steps) can pay back: at best 300 of 1000 steps saved')
        >>> probe_pays_back(probe_steps=8, steps_left=40, max_gain=0.3)[1]
        'skipped: the probe (8 steps) cannot pay back in 40 steps left (at best 12 saved, 32 needed)'
    """
    saved = max_gain * steps_left
    needed = payback * probe_steps
    if math.isinf(steps_left) or saved >= needed:
        shown = "an unbounded run" if math.isinf(steps_left) else f"{saved:.0f} of {steps_left:.0f} steps saved"
        return True, f"the probe ({probe_steps:.0f} steps) can pay back: at best {shown}"
    return False, (
        f"skipped: the probe ({probe_steps:.0f} steps) cannot pay back in {steps_left:.0f} steps left"
        f" (at best {saved:.0f} saved, {needed:.0f} needed)"
    )


def choose_setting(step_s: Mapping[str, float | None], current: str, margin: float) -> tuple[str, str]:
    """The fastest setting if it beats ``current`` by ``margin`` (relative step time), else ``current``; and why.

    Settings whose time is None (failed, or rejected) are not candidates.

    Example:
        >>> choose_setting({"nchw": 0.020, "nhwc": 0.015}, current="nchw", margin=0.03)
        ('nhwc', 'nhwc 25.0% faster than nchw (margin 3%)')
        >>> choose_setting({"nchw": 0.020, "nhwc": 0.0198}, current="nchw", margin=0.03)
        ('nchw', 'nhwc only 1.0% faster than nchw (margin 3%): kept nchw')
    """
    base = step_s.get(current)
    timed = {name: s for name, s in step_s.items() if s is not None and name != current}
    if base is None or not timed:
        return current, f"nothing to compare with {current}: kept it"
    best = min(timed, key=lambda name: timed[name])
    gain = 1.0 - timed[best] / base
    if gain >= margin and gain > 0:
        return best, f"{best} {100 * gain:.1f}% faster than {current} (margin {100 * margin:.0f}%)"
    if gain <= 0:
        return current, f"{best} not faster than {current} ({100 * -gain:.1f}% slower): kept {current}"
    return current, f"{best} only {100 * gain:.1f}% faster than {current} (margin {100 * margin:.0f}%): kept {current}"


def clearly_slower_bound(margin: float, factor: float = 3.0) -> float:
    """How much slower than the setting in place a candidate must be to be `clearly_slower` (at least 10%).

    Example:
        >>> clearly_slower_bound(0.03), clearly_slower_bound(0.05), clearly_slower_bound(0.1)
        (0.1, 0.15000000000000002, 0.30000000000000004)
    """
    return max(factor * margin, 0.1)


def clearly_slower(step_s: Mapping[str, float | None], current: str, margin: float, factor: float = 3.0) -> list[str]:
    """The candidates so much slower than ``current`` after one round that they are not timed again.

    A candidate whose median step is more than ``factor`` times the margin (and at least 10%) slower than the setting
    in place cannot plausibly win by ``margin`` in a second round; dropping it halves what it costs. On the demo the
    loader tuner's two worker settings lost their first round by about 30% and each still ran a second one.

    Example:
        >>> clearly_slower({"as is": 0.010, "2 workers": 0.013, "1 worker": 0.0105, "failed": None}, "as is", 0.05)
        ['2 workers']
    """
    base = step_s.get(current)
    if base is None:
        return []
    bound = base * (1.0 + clearly_slower_bound(margin, factor))
    return [name for name, s in step_s.items() if name != current and s is not None and s > bound]


def paired_ratios(blocks: Sequence[tuple[str, list[float]]], current: str, warmup: int) -> dict[str, float]:
    """Each candidate's step time relative to ``current``'s, round by round: the median over rounds of the ratio.

    A round's ratio is the candidate's block median over ``current``'s block median in the same round (the k-th block
    of each setting is its k-th round; each block's first ``warmup`` steps are left out).
    The rounds are the pairs: a load change on a shared machine between rounds moves both blocks of a round alike, so
    the ratio of a round keeps the settings' own difference, where medians pooled over rounds mix quiet and loaded
    rounds. In the AVX-512 demo's bf16 steps, rounds of 21 and 29 ms a step followed each other in one probe.

    Example:
        >>> ms = lambda *t: [x / 1000 for x in t]
        >>> blocks = [("a", ms(20, 20)), ("b", ms(18, 18)), ("a", ms(30, 30)), ("b", ms(27, 27)), ("a", ms(20, 20))]
        >>> {name: round(r, 3) for name, r in paired_ratios(blocks, "a", warmup=0).items()}
        {'b': 0.9}
    """
    return {name: statistics.median(ratios) for name, ratios in round_ratios(blocks, current, warmup).items()}


def block_medians(blocks: Sequence[tuple[str, list[float]]], warmup: int) -> dict[str, list[float]]:
    """Each setting's block medians in the order its blocks ran: its k-th is its k-th round.

    Each block's first ``warmup`` steps are left out; a block with no step after them has no median.

    Example:
        >>> block_medians([("a", [9.0, 2.0, 4.0]), ("b", [9.0]), ("a", [9.0, 6.0])], warmup=1)
        {'a': [3.0, 6.0]}
    """
    own: dict[str, list[float]] = {}
    for name, times in blocks:
        if times[warmup:]:
            own.setdefault(name, []).append(statistics.median(times[warmup:]))
    return own


def weigh_by_rounds(
    step_s: Mapping[str, float | None], blocks: Sequence[tuple[str, list[float]]], current: str, warmup: int
) -> dict[str, float | None]:
    """``step_s`` as a decision weighs it: each timed candidate's replaced by ``current``'s times its `paired_ratios`.

    Example:
        >>> blocks = [("a", [2.0]), ("b", [1.0]), ("a", [4.0]), ("b", [3.0])]
        >>> weigh_by_rounds({"a": 3.0, "b": 2.0, "c": None}, blocks, "a", warmup=0)
        {'a': 3.0, 'b': 1.875, 'c': None}
    """
    ratios, reference = paired_ratios(blocks, current, warmup), step_s.get(current)
    return {
        name: reference * ratios[name] if s is not None and reference is not None and name in ratios else s
        for name, s in step_s.items()
    }


def round_ratios(blocks: Sequence[tuple[str, list[float]]], current: str, warmup: int) -> dict[str, list[float]]:
    """Each candidate's ratio to ``current`` in every round both ran (`paired_ratios` takes their median).

    Example:
        >>> blocks = [("a", [2.0]), ("b", [1.0]), ("a", [2.0]), ("b", [3.0])]
        >>> round_ratios(blocks, "a", warmup=0)
        {'b': [0.5, 1.5]}
    """
    own = block_medians(blocks, warmup)
    reference = own.get(current, [])
    return {
        name: [m / r for m, r in zip(medians, reference, strict=False)]
        for name, medians in own.items()
        if name != current and reference and medians
    }


GROSSLY = 1.5
"""A candidate whose first block's steps mostly took over this many times most of the setting in place's steps in
its first two blocks is not timed again (`grossly_slower`)."""


def grossly_slower(
    blocks: Sequence[tuple[str, list[float]]], current: str, warmup: int, ratio: float = GROSSLY
) -> list[str]:
    """The candidates whose first block's steps mostly took over ``ratio`` times most of ``current``'s first two.

    "Mostly": the candidate block's lower quartile step against the upper quartile of ``current``'s steps.
    A counted probe runs ``current``'s second block right after the candidates' first ones. A load change on a shared
    machine that hits one block (`trials.counted.DROP_AFTER` rounds are the rule for that) slows some of its steps,
    or the blocks beside it too; three in four of a candidate's steps far behind three in four of the steps on both
    sides of it is the setting's own slowness (bf16 autocast on a small transformer: 2.1-2.8x fp32's on an AVX-512
    CPU). The quartiles leave out the odd slow step (a GC, a page fault); each block's first ``warmup`` steps too.

    Example:
        >>> blocks = [("a", [1.0, 1.1, 1.0]), ("b", [2.5, 2.4, 2.6]), ("c", [1.2, 3.0, 3.1]), ("a", [1.0, 3.0, 1.0])]
        >>> grossly_slower(blocks, "a", warmup=0)
        ['b']
        >>> grossly_slower(blocks[:3], "a", warmup=0)
        []
    """
    timed: dict[str, list[list[float]]] = {}
    for name, times in ((name, times[warmup:]) for name, times in blocks if times[warmup:]):
        timed.setdefault(name, []).append(times)
    if len(reference := timed.get(current, [])) < 2:
        return []
    bound = ratio * _quartiles(reference[0] + reference[1])[1]
    return [name for name, own in timed.items() if name != current and _quartiles(own[0])[0] > bound]


CUT_AFTER = 3  # timed steps of a candidate's first block after which `cut_short` may end it


def cut_short(times: Sequence[float], reference: Sequence[float], warmup: int, ratio: float = GROSSLY) -> bool:
    """Whether a candidate's first block (``times`` so far) can end: `CUT_AFTER` timed steps, each over ``ratio`` x.

    "x": the upper quartile of ``reference`` (the block in place before it); the first ``warmup`` steps left out. Then
    `grossly_slower` weighs those steps: unless the next block in place is slow too, it drops the candidate.

    Example:
        >>> cut_short([9.0, 2.6, 2.5, 2.7], [1.0, 1.1, 1.0, 1.2], 1), cut_short([9.0, 2.6, 1.2, 2.7], [1.0, 1.1], 1)
        (True, False)
    """
    own, ref = times[warmup:], reference[warmup:]
    return len(own) >= CUT_AFTER and bool(ref) and min(own) > ratio * _quartiles(ref)[1]


def _quartiles(values: Sequence[float]) -> tuple[float, float]:
    """The lower and upper quartiles of ``values`` (the value itself for one)."""
    if len(values) < 2:
        return values[0], values[0]
    lower, _, upper = statistics.quantiles(values, n=4)
    return lower, upper


def round_wins(blocks: Sequence[tuple[str, list[float]]], current: str, candidate: str, warmup: int) -> tuple[int, int]:
    """In how many rounds ``candidate``'s block median beat the block of ``current`` in the same round; and of how many.

    Blocks of one round run back to back, so a change of load on a shared machine slows both alike: a candidate that
    is faster on the pooled median because one round of ``current`` ran under load loses a round here. The k-th
    block of each setting is its k-th round; each block's first ``warmup`` steps are left out.

    Example:
        >>> ms = lambda *t: [x / 1000 for x in t]
        >>> blocks = [("a", ms(10, 10)), ("b", ms(5, 5)), ("a", ms(10, 10)), ("b", ms(12, 12))]
        >>> round_wins(blocks, "a", "b", warmup=0)
        (1, 2)
    """
    ratios = round_ratios(blocks, current, warmup).get(candidate, [])
    return sum(1 for ratio in ratios if ratio < 1.0), len(ratios)


def may_lose(rounds: int) -> int:
    """How many of ``rounds`` paired rounds a small gain may lose and still be kept: a quarter, rounded down.

    None of the usual three rounds; with many short rounds (`lightning_speedkit.channels_last.ChannelsLast`: 12 of 6
    steps) a load burst on a shared machine can split a few rounds by itself, and a win in every one of them would
    reject a real gain. Replayed on demo steps recorded under bursts of load on the 2-core AVX-512 EPYC
    (`benchmarks/probe_replay.py`), 12 rounds of 6 steps kept a 10% gain in 88% of probes, a 5% loss in 0.2%.

    Example:
        >>> [may_lose(rounds) for rounds in (3, 5, 8, 12)]
        [0, 1, 2, 3]
    """
    return rounds // 4


NOISE_Z = 3.0  # standard errors a counted block's loss must be over its reference's to be worse (`loss_is_sound`)


def loss_is_sound(
    losses: Sequence[float | None], reference: Sequence[float | None], tolerance: float = 0.1, noise_z: float = 0.0
) -> str:
    """An empty string when a trial's losses are finite and not clearly worse than the reference's; else why not.

    Restored trials start from the same weights and see the same batches, so their mean losses should agree closely;
    "clearly worse" is a mean more than ``tolerance`` (relative) above the reference's. Blocks of counted steps see
    other batches, whose losses differ by themselves: with ``noise_z`` the excess must also be more than that many
    standard errors of the difference of the two means.

    Example:
        >>> loss_is_sound([2.30, 2.25], [2.30, 2.24])
        ''
        >>> loss_is_sound([2.30, float("nan")], [2.30, 2.24])
        'non-finite loss'
        >>> loss_is_sound([3.0, 3.1], [2.30, 2.24])
        'mean loss 3.05 vs 2.27 (more than 10% worse)'
        >>> loss_is_sound([1.2, 1.8], [1.1, 1.5], noise_z=3.0)  # 1.5 vs 1.3: within the batches' noise
        ''
    """
    values = [v for v in losses if v is not None]
    if any(not math.isfinite(v) for v in values):
        return "non-finite loss"
    ref = [v for v in reference if v is not None and math.isfinite(v)]
    if not values or not ref:
        return ""
    mean, ref_mean = statistics.fmean(values), statistics.fmean(ref)
    if mean <= ref_mean + tolerance * abs(ref_mean):
        return ""
    if noise_z > 0 and len(values) > 1 and len(ref) > 1:
        error = math.sqrt(statistics.variance(values) / len(values) + statistics.variance(ref) / len(ref))
        if mean - ref_mean <= noise_z * error:
            return ""
    return f"mean loss {mean:.3g} vs {ref_mean:.3g} (more than {100 * tolerance:.0f}% worse)"


def outside_band(live: float, remembered: float, band: float) -> bool:
    """Whether a run's live step time is more than ``band`` times off the remembered one, either way.

    Example:
        >>> outside_band(0.030, 0.020, 1.5), outside_band(0.012, 0.020, 1.5), outside_band(0.012, 0.020, 2.0)
        (False, True, False)
    """
    ratio = live / remembered
    return not 1 / band <= ratio <= band


DROP_AFTER = 2
"""Rounds in each of which a candidate must be clearly slower (`clearly_slower`) before it gets no more blocks.

A load spike can hit one block of ten steps (`benchmarks/results/avx512/layout_stability.json`: channels_last lost its
first block by 18.5%, 12% faster over a long timing); a slower candidate's block costs only its extra seconds."""


def counted_cost(settings: int, steps: int, rounds: int, margin: float) -> int:
    """The steps a counted probe can cost at worst, for the payback rule, priced by the rules that drop a candidate.

    A restored probe costs every trial step (`trials.measure.PROBE_ROUNDS` rounds of every setting); a counted one
    (`trials.counted`) only the extra time of the slower blocks. A candidate block twice as slow as the setting in
    place costs its length; such a candidate is dropped after its first block (`grossly_slower`), one `clearly_slower`
    in each of its first `DROP_AFTER` rounds after those; one not dropped is at most that bound (`clearly_slower_bound`
    of ``margin``) slower in most rounds. So the worst case is `DROP_AFTER` full blocks, and the bound's share of each
    later round's block (every round at full length priced `ChannelsLast`'s 12 short rounds at 4x their cost).

    Example:
        >>> counted_cost(settings=2, steps=10, rounds=3, margin=0.05)
        22
        >>> counted_cost(settings=3, steps=8, rounds=3, margin=0.05)
        35
        >>> counted_cost(settings=2, steps=4, rounds=12, margin=0.03)  # ChannelsLast's short rounds
        12
        >>> counted_cost(settings=2, steps=10, rounds=1, margin=0.05)
        10
    """
    blocks = min(rounds, DROP_AFTER) + max(0, rounds - DROP_AFTER) * clearly_slower_bound(margin)
    return math.ceil(round((settings - 1) * steps * blocks, 6))


def fitted_block(
    longest: int, shortest: int, settings: int, steps_left: float, max_gain: float, rounds: int, margin: float
) -> int:
    """The longest block in [``shortest``, ``longest``] steps whose counted probe (`counted_cost`) the run repays.

    Longer blocks give steadier medians on a shared machine; ``shortest`` when even those cannot pay back.

    Example:
        >>> fitted_block(25, 10, settings=2, steps_left=1000, max_gain=0.4, rounds=3, margin=0.05)
        25
        >>> fitted_block(25, 10, settings=2, steps_left=400, max_gain=0.4, rounds=3, margin=0.05)
        18
        >>> fitted_block(25, 10, settings=2, steps_left=40, max_gain=0.4, rounds=3, margin=0.05)
        10

        The block is checked against the rule itself, its cost rounded up as the rule sees it: 12 steps here, where
        13 would cost 28 steps, 112 needed of the 110 the run can save.

        >>> fitted_block(20, 5, settings=2, steps_left=441, max_gain=0.25, rounds=3, margin=0.03)
        12
    """
    if math.isinf(steps_left):
        return longest
    for block in range(longest, shortest, -1):
        if probe_pays_back(counted_cost(settings, block, rounds, margin), steps_left, max_gain)[0]:
            return block
    return shortest
