"""Deciding by trials: how many steps are left, what a probe costs, and one `measure` for every lever."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from lightning_speedkit.budget import estimated_budget
from lightning_speedkit.decisions import (
    choose_setting,
    clearly_slower,
    loss_is_sound,
    probe_pays_back,
    round_ratios,
    weigh_by_rounds,
)
from lightning_speedkit.trials.lever import Decision
from lightning_speedkit.trials.loaders import peek_train_loader
from lightning_speedkit.trials.session import TrialSession
from lightning_speedkit.trials.settings import LeaveOut, Setting, TrialResult

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["DETERMINISTIC", "PROBE_ROUNDS", "estimated_steps", "measure", "probe_cost", "steps_done", "steps_left"]


def _estimated(trainer: pl.Trainer) -> float:
    return estimated_budget(trainer)


def estimated_steps(trainer: pl.Trainer) -> float:
    """``trainer.estimated_stepping_batches``, read as `steps_left` reads it: the run unchanged, the read kept."""
    return peek_train_loader(trainer, _estimated)


def steps_left(trainer: pl.Trainer) -> float:
    """Training batches left in this fit (``inf`` for an unbounded one), from ``trainer.estimated_stepping_batches``.

    Estimating builds the train loader and its iterator, which draws from the global RNG; a fit that has not built
    them yet gets them back unbuilt and the global RNG untouched, so asking changes nothing about the run
    (`lightning_speedkit.trials.loaders.peek_train_loader`, which also keeps the estimate for the next lever).
    """
    estimated = estimated_steps(trainer)
    if math.isinf(estimated):
        return math.inf
    return max(0.0, float(estimated) - steps_done(trainer)) * trainer.accumulate_grad_batches


def steps_done(trainer: pl.Trainer) -> int:
    """``trainer.global_step``; on a resume before Lightning restores the loops (``on_fit_start``), the checkpoint's.

    Lightning loads the checkpoint before ``on_fit_start`` but restores the loops' progress after it, so a lever
    deciding there would read 0 and weigh its probe against the whole budget, not the steps left.
    """
    loaded = getattr(getattr(trainer, "_checkpoint_connector", None), "_loaded_checkpoint", None)
    restored = loaded.get("global_step", 0) if isinstance(loaded, dict) and trainer.ckpt_path else 0
    return max(trainer.global_step, int(restored or 0))


PROBE_ROUNDS = 2
"""Rounds of one trial per setting that `measure` interleaves (a probe costs ``steps * rounds * settings`` steps)."""


DETERMINISTIC = (
    "skipped: deterministic algorithms are on (`Trainer(deterministic=True)`): a setting chosen by timing steps"
    " could differ from run to run with the machine's load, so the setting in place is kept"
)
"""Why no timed probe runs in a deterministic run (nor is a remembered decision recalled: `trials.memory`)."""


def probe_cost(trainer: pl.Trainer, probe_steps: float, max_gain: float) -> tuple[bool, str, float]:
    """Whether a probe of ``probe_steps`` training steps can pay back in this run: ``(pays, why, steps_left)``.

    The one place a lever weighs its probe: the steps left (`steps_left`) against the best case of ``max_gain``
    (`lightning_speedkit.decisions.probe_pays_back`). A run with deterministic algorithms on probes nothing
    (`DETERMINISTIC`): a timed choice of layout, precision, loader or compile would make its result depend on the
    machine's load, which is what ``Trainer(deterministic=True)`` asks to rule out.
    """
    left = steps_left(trainer)
    if torch.are_deterministic_algorithms_enabled():
        return False, DETERMINISTIC, left
    pays, why = probe_pays_back(probe_steps, left, max_gain)
    return pays, why, left


def measure(
    trainer: pl.Trainer,
    current: Setting,
    candidates: Sequence[Setting],
    steps: int,
    margin: float,
    max_gain: float,
    warmup: int = 1,
    rounds: int = PROBE_ROUNDS,
    loss_tolerance: float | None = None,
    after_reference: Callable[[TrialResult, list[float], float], str | LeaveOut] | None = None,
) -> Decision:
    """Decide between the setting in place and ``candidates`` by real training steps.

    Follows the rules of `lightning_speedkit.decisions`: no probe when it cannot pay back within the run (`probe_cost`;
    the decision says so); otherwise, in one `TrialSession`, ``rounds`` rounds of one trial per setting (the setting in
    place first), interleaved so that drift on a shared machine hits every setting alike; each setting's time is the
    median of its timed steps over all rounds, and the decision weighs a candidate's against it round by round
    (`lightning_speedkit.decisions.weigh_by_rounds`: a load change between rounds cancels). A candidate that the first
    round shows clearly slower (`clearly_slower`: by over three margins, at least 10%) is not timed again, and when all
    are, no second round runs. When the leading candidate was faster in one round and not in another, one more round
    of it and the setting in place runs, if the probe still pays back (`_split_leader`). The fastest candidate is
    chosen only if it beats the setting in place by ``margin``.
    With ``loss_tolerance``, a candidate whose first-round losses are non-finite or clearly worse than the setting in
    place's is rejected. Every rank returns the same decision; the caller applies it. ``after_reference`` (given the
    setting in place's first trial, each of its steps' wait for data, the same on every rank, and the steps left
    before the probe) can end the probe there with a reason: the setting in place is kept, no candidate tried
    (`lightning_speedkit.dataloader.DataLoaderTuner`: a wait too short to repay the probe); or leave some candidates
    out with a `LeaveOut` (the tuner: worker start-ups the wait cannot repay), which the reason then names.

    Returns:
        The `Decision`; its ``extra`` holds ``steps_left``, ``left_out`` (candidates not tried, by `LeaveOut`),
        ``dropped`` (candidates timed in the first round only),
        ``added_rounds`` (0 or 1) and ``trials`` (each `TrialResult` as a dict).

    Raises:
        ValueError: If the train loader has fewer batches per epoch than ``steps``.
    """
    settings = (current, *candidates)
    pays, why, left = probe_cost(trainer, steps * rounds * len(settings), max_gain)
    extra: dict[str, Any] = {"steps_left": None if math.isinf(left) else left, "dropped": [], "trials": []}
    if not pays:
        return Decision(current.name, why, source="skipped", extra=extra)
    with TrialSession(trainer, steps, warmup) as session:
        session.require_steps("probe_steps")
        first = [session.run(current)]
        verdict = after_reference(first[0], session.waits.get(current.name, []), left) if after_reference else ""
        stop, left_out = (verdict, None) if isinstance(verdict, str) else ("", verdict)
        if left_out is not None:
            candidates = [c for c in candidates if c.name not in left_out.names]
            settings = (current, *candidates)
        results, dropped, added = first, [], 0
        if not stop:
            first += [session.run(setting) for setting in candidates]
            medians = {r.setting: r.median_step_s for r in first}
            dropped = clearly_slower(medians, current.name, margin) if rounds > 1 else []
            later = [s for s in settings if s.name not in dropped]
            later = later if len(later) > 1 else []  # every candidate dropped: the decision is made
            results = first + [session.run(setting) for _ in range(rounds - 1) for setting in later]
            split = _split_leader(results, settings, warmup) if rounds > 1 else None
            if split is not None and probe_pays_back(steps * (len(results) + 2), left, max_gain)[0]:
                results += [session.run(current), session.run(split)]
                added = 1
    if stop:  # the setting in place kept after its own trial
        extra.update(trials=[result.as_dict() for result in results])
        step = {current.name: first[0].median_step_s}
        return Decision(current.name, stop, True, session.elapsed_s, step, {}, "measured", extra)
    step_s: dict[str, float | None] = {}
    rejected: dict[str, str] = {}
    for setting, result in zip(settings, first, strict=True):
        problem = result.error if not result.fits else ""
        if not problem and loss_tolerance is not None and result is not first[0]:
            problem = loss_is_sound(result.losses, first[0].losses, loss_tolerance)
        own = [r for r in results if r.setting == setting.name]
        timed = [t for r in own if r.fits for t in r.step_s[r.warmup :]]
        if problem or not all(r.fits for r in own):
            rejected[setting.name] = problem or next(r.error for r in own if not r.fits)
        step_s[setting.name] = statistics.median(timed) if timed and not problem else None
    weighed = weigh_by_rounds(step_s, [(r.setting, r.step_s) for r in results if r.fits], current.name, warmup)
    decision, reason = choose_setting(weighed, current.name, margin)
    if added:
        reason += " (a round added: the leading candidate's rounds disagreed)"
    if left_out is not None:
        reason += f"; {', '.join(left_out.names)} not tried: {left_out.why}"
    extra.update(
        left_out=list(left_out.names) if left_out else [],
        dropped=dropped,
        added_rounds=added,
        trials=[result.as_dict() for result in results],
    )
    return Decision(decision, reason, True, session.elapsed_s, step_s, rejected, "measured", extra)


def _split_leader(results: Sequence[TrialResult], settings: Sequence[Setting], warmup: int) -> Setting | None:
    """The leading candidate (the lowest `paired_ratios`) when it was faster in one round and not in another, else None.

    Such a probe is one load change away from the other decision: `measure` then runs one more round of the setting
    in place and that candidate (when the probe still pays back), and the median of three rounds decides. In the
    AVX-512 demo two 2-round precision probes of the same job found bf16 2.9% and 23.4% faster.
    """
    current = settings[0].name
    blocks = [(r.setting, r.step_s) for r in results if r.fits]
    ratios = round_ratios(blocks, current, warmup)
    if not ratios:
        return None
    leader = min(ratios, key=lambda name: statistics.median(ratios[name]))
    split = min(ratios[leader]) < 1.0 <= max(ratios[leader])
    return next((s for s in settings if s.name == leader), None) if split else None
