"""Trials on steps that count: the fit's own first training steps, in blocks that alternate the settings, timed.

A setting that does not change what a step computes (the memory layout, the loader's workers, compile) needs no
restored trial: its steps train the model exactly as the run would, so they can simply be the run's first steps. The
settings take turns in blocks of ``steps`` training steps, ``rounds`` times (the setting in place first), every block
timed step by step; then the fastest setting is kept when it beats the setting in place by the margin
(`lightning_speedkit.decisions.choose_setting`), as `lightning_speedkit.trials.measure` would decide; a switch whose
gain is under `CONSISTENT` margins must also have won the paired blocks of every round it ran, or of all but a
quarter of many short rounds (`round_wins`: a load change on a shared machine hits one block, not a round); one that
lost one round too many gets up to `EXTRA_ROUNDS` more rounds to show it, when the steps are free. A candidate gets
no more blocks only once it lost `DROP_AFTER` rounds clearly, or once three in four steps of its first block took
over `GROSSLY` times three in four of the setting in place's around it (`grossly_slower`); that first block itself
ends after `CUT_AFTER` timed steps when each of them is that slow (`cut_short`). Nothing is restored and
nothing is thrown away: the number of optimizer steps, the epochs, the LR schedule and the sample order are those of
the run without the probe. The probe's cost is only the extra seconds of the blocks that ran slower than the setting
kept (``probe_s``), so blocks can be longer, or more, than a restored trial's: steadier on a noisy machine.

Every rank switches at the same step; rank zero's timings decide (broadcast), so every rank keeps the same setting.

Levers probe one at a time: two counted probes in the same steps would each time the other's switches (a loader's
workers starting while the layout is timed). Each joins its Trainer's queue (`CountedTrials.join`) and starts on the
step after the one before it has decided; `queued_steps` tells a lever how many steps the probes before it can take.
"""

from __future__ import annotations

import statistics
import time
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from lightning_speedkit.decisions import (
    CUT_AFTER,
    DROP_AFTER,
    GROSSLY,
    block_medians,
    choose_setting,
    clearly_slower,
    counted_cost,
    cut_short,
    fitted_block,
    grossly_slower,
    may_lose,
    round_wins,
    weigh_by_rounds,
)
from lightning_speedkit.timing import StepClock
from lightning_speedkit.trials.lever import Decision
from lightning_speedkit.trials.measure import steps_left

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_speedkit.trials.settings import Setting

__all__ = [
    "CONSISTENT",
    "COUNTED_ROUNDS",
    "DROP_AFTER",
    "EXTRA_ROUNDS",
    "CountedTrials",
    "counted_cost",
    "fitted_block",
    "queued_steps",
]

COUNTED_ROUNDS = 3
"""Rounds of counted blocks: one more than a restored probe's (`PROBE_ROUNDS`), since their steps are not wasted.

A lever whose switch is cheap runs more of shorter blocks (`lightning_speedkit.channels_last.ChannelsLast`: 12 of 6
steps): a burst of load then spans both blocks of a round, and the many rounds outvote the few it splits."""


CONSISTENT = 3.0
"""A switch whose pooled gain is under this many margins must also win the paired blocks of every round it ran.

On a shared 2-core machine the noise of a block's median is several percent: a 5-15% pooled gain of loader workers
came and went from probe to probe of one demo seed (one probe in four kept 2 workers that then trained slower),
while the demo's channels-last gain (12-30%, 17.5% over 250 steps a layout) lost a round to noise in one probe of
four. A large gain is kept on the pooled median; a small one must be consistent."""


EXTRA_ROUNDS = 2
"""Rounds a probe may add when a small gain (under `CONSISTENT` margins) lost exactly one round.

Such a probe used to keep the setting in place (the same run: "channels_last 6.2% faster ..., but faster in 2 of 3
rounds only"). Up to this many more rounds of the setting in place and the leading candidate run instead, while no
probe queued behind needs the steps; the switch is then made when the candidate lost no other round. A second lost
round ends the extension and keeps the setting in place."""


_QUEUES: weakref.WeakKeyDictionary[Any, list[CountedTrials]] = weakref.WeakKeyDictionary()
"""Per Trainer, the counted probes not yet decided, in the order they joined: the first one runs."""


def queued_steps(trainer: pl.Trainer, bound: bool = False) -> int:
    """The most training steps the counted probes queued on ``trainer`` can still take (their windows).

    ``bound``: only those an epoch-bound probe joining now would wait for (`CountedTrials.join`).
    """
    return sum(trials.window for trials in _QUEUES.get(trainer, []) if not bound or trials._holds_its_place())


class CountedTrials:
    """The probe of one lever on the fit's first training steps; ``step_started``/``step_ended`` from its hooks.

    Args:
        current: The setting in place (the reference, and the first block).
        candidates: The other settings.
        steps: Training steps per block.
        margin: How much faster a candidate must be than ``current`` to be kept.
        warmup: Leading steps of each block left out of its median (a new layout's first step, a loader's workers
            starting).
        rounds: Blocks per setting.
    """

    EPOCH_BOUND = False
    """Whether every block must run inside the first epoch (a loader's probe); then no round is added after others."""
    extra_rounds = EXTRA_ROUNDS
    """Rounds a small gain that lost one round may add (`EXTRA_ROUNDS`; 0 for a probe concluded by its own rules)."""
    cuts_short = True
    """Whether a candidate's first block ends after `CUT_AFTER` timed steps that are all grossly slower (`cut_short`),
    which in effect drops it: a setting slow for more first steps than ``warmup`` needs a longer ``warmup``, or False
    here, as where its first steps may still be ramping up (a loader's workers) or a block is one unit (compile)."""

    def __init__(
        self,
        current: Setting,
        candidates: Sequence[Setting],
        steps: int,
        margin: float,
        warmup: int = 1,
        rounds: int = COUNTED_ROUNDS,
    ) -> None:
        self.current, self.settings = current, (current, *candidates)
        self.steps, self.margin, self.warmup, self.rounds = steps, margin, warmup, rounds
        self.times: dict[str, list[float]] = {s.name: [] for s in self.settings}
        self.blocks: list[tuple[str, list[float]]] = []
        self.waits: list[list[float]] = []  # per block, each step's wait for its batch (`StepClock.last_wait`)
        self.notes: list[str] = []  # what `drop` left untried, and why: added to the decision's reason
        self._queue: list[Setting] = list(self.settings)
        self._active: Setting | None = None
        self._clock = StepClock()
        self._left, self._round, self._began = 0, 1, 0.0
        self._dropped: list[str] = []

    @property
    def window(self) -> int:
        """The most training steps this probe claims: every setting's blocks, every planned round.

        An extension (`EXTRA_ROUNDS`) takes only steps beyond the windows of the probes queued behind.
        """
        return len(self.settings) * self.steps * self.rounds

    def join(self, trainer: pl.Trainer) -> None:
        """Queue on ``trainer``: this probe starts once the counted probes that joined before have decided.

        An epoch-bound probe (a loader's, whose blocks must all run in the first epoch) goes ahead of the probes that
        are not and have not started: theirs can run after the first epoch, its cannot; and the settings it keeps (a
        faster loader) serve the rest of that epoch.
        """
        queue = _QUEUES.setdefault(trainer, [])
        ahead = [trials._holds_its_place() for trials in queue]
        at = ahead.index(False) if self.EPOCH_BOUND and False in ahead else len(queue)
        queue.insert(at, self)

    def _holds_its_place(self) -> bool:
        """Whether an epoch-bound probe joining now queues behind this one: bound itself, or already started."""
        return self.EPOCH_BOUND or bool(self.blocks)

    def _leave(self, trainer: pl.Trainer) -> None:
        queue = _QUEUES.get(trainer, [])
        if self in queue:
            queue.remove(self)

    def _waiting(self, trainer: pl.Trainer) -> bool:
        queue = _QUEUES.get(trainer) or []
        return self in queue and queue[0] is not self

    @property
    def active(self) -> Setting | None:
        """The setting whose block is running (None before the first block)."""
        return self._active

    def step_started(self, trainer: pl.Trainer) -> None:
        """Before a training step: start the next block when the last one is over, then start the clock."""
        if self._waiting(trainer):
            return
        if self._active is None or trainer.fit_loop.epoch_loop.batch_progress.current.ready <= 1:
            self._clock.reset()  # after a pause (`_go_last`) or validation: no part of this step
        if self._left == 0:
            if self._active is not None:
                self._active.revert(trainer)
            self._active = self._queue.pop(0)
            self.block_starting(trainer, self._active)
            self._active.apply(trainer)
            self._left = self.steps
            self.blocks.append((self._active.name, []))
            self.waits.append([])
            self._began = self._began or time.perf_counter()
        self._clock.start()

    def step_ended(self, trainer: pl.Trainer, outputs: Any = None) -> Decision | None:
        """After a training step (``outputs``: what it returned): its time; after the last block, the decision."""
        if self._active is None or self._waiting(trainer):
            return None
        self.blocks[-1][1].append(self._clock.stop())
        self.waits[-1].append(self._clock.last_wait)
        self.step_recorded(trainer, outputs)
        self._left -= 1
        if self._left > 0 and not self._ends_early(trainer):
            return None
        self._left = 0
        name, times = self.blocks[-1]
        self.times[name].extend(times[self.warmup :])
        ended = self.block_ended(trainer)
        if ended is not None:
            self.stop(trainer)
            return ended
        if name == self.current.name and sum(1 for n, _ in self.blocks if n == name) == 2:
            slow = trainer.strategy.broadcast(grossly_slower(self.blocks, name, self.warmup), src=0)
            self.drop(slow, f"its first block's steps mostly over {GROSSLY:g}x {name}'s around it", note="dropped")
        if not self._queue:
            self._next_round(trainer)
        if self._queue:
            return None
        return self._decide(trainer)

    def _ends_early(self, trainer: pl.Trainer) -> bool:
        """Whether a candidate's first block ends now, `CUT_AFTER` timed steps in (`cut_short`; rank zero decides)."""
        name, times = self.blocks[-1]
        if not self.cuts_short or name == self.current.name or len(times) != self.warmup + CUT_AFTER:
            return False
        if sum(1 for n, _ in self.blocks if n == name) > 1:
            return False
        before = next(t for n, t in reversed(self.blocks) if n == self.current.name)
        return bool(trainer.strategy.broadcast(cut_short(times, before, self.warmup), src=0))

    def block_starting(self, trainer: pl.Trainer, setting: Setting) -> None:
        """Before a block's first step, ``setting`` not yet applied: the seam for what a lever keeps per block."""

    def step_recorded(self, trainer: pl.Trainer, outputs: Any) -> None:
        """After each timed step of a block, its time recorded: the seam for what a lever keeps per step."""

    def block_ended(self, trainer: pl.Trainer) -> Decision | None:
        """After each block, on every rank at the same step: a decision that ends the probe early, or None to go on.

        The seam for a lever whose probe can stop before its last block (`lightning_speedkit.compile.Compile`: after
        the first block, when no speed-up could repay a compile; after a block that failed to compile).
        """
        return None

    def drop(self, names: Sequence[str], why: str, note: str = "not tried") -> None:
        """Leave the settings ``names`` out of every block still to come (called on every rank alike), noting ``why``.

        The seam for a lever that learns from one block that other settings cannot win
        (`lightning_speedkit.dataloader.counted.LoaderTrials`: more workers, after fewer lost without waiting for data).
        """
        names = [n for n in names if n not in self._dropped and n != self.current.name]
        if not names:
            return
        self._dropped.extend(names)
        self._queue = [s for s in self._queue if s.name not in names]
        self.notes.append(f"{', '.join(names)} {note}: {why}")

    def _next_round(self, trainer: pl.Trainer) -> None:
        """Queue the next round's blocks, or none when the probe is over.

        A candidate clearly slower in each of the first `DROP_AFTER` rounds gets no more blocks. After the last round,
        a small gain that lost one round gets another round against the setting in place (`EXTRA_ROUNDS`): now, when
        the steps are free; else after the probes queued behind, when the run has the steps (`_extension_room`).
        """
        if self._round >= self.rounds:
            leader = trainer.strategy.broadcast(self._to_confirm(), src=0)  # rank zero's timings decide
            where = trainer.strategy.broadcast(self._extension_room(trainer), src=0) if leader else None
            if leader is not None and where is not None:
                self._round += 1
                self._queue = [s for s in self.settings if s.name in (self.current.name, leader)]
                if where == "later":
                    self._go_last(trainer)
            return
        if self._round == DROP_AFTER:
            slower = trainer.strategy.broadcast(self._slower_every_round(), src=0)
            self._dropped += [name for name in slower if name not in self._dropped]
        self._round += 1
        kept = [s for s in self.settings if s.name not in self._dropped]
        self._queue = kept if len(kept) > 1 else []

    def _extension_room(self, trainer: pl.Trainer) -> str | None:
        """Where an added round fits: ``"now"``, ``"later"`` (after the probes queued behind) or None.

        A probe queued behind was promised its window at fit start, and a loader's must run inside the first epoch
        (``EPOCH_BOUND``, `lightning_speedkit.dataloader.counted.CountedLoader`): a round runs now only in the steps
        they leave free in this epoch; else, unless this probe is itself bound to the epoch, after them, when the
        run has the steps. Meanwhile the setting in place trains. For a probe bound to the epoch, the probes behind
        that are not bound can wait past the epoch: only the bound ones' windows count against the epoch's steps.
        """
        queue = _QUEUES.get(trainer, [])
        behind = queue[queue.index(self) + 1 :] if self in queue else []
        need, claimed = 2 * self.steps, sum(t.window for t in behind)
        in_epoch = sum(t.window for t in behind if t.EPOCH_BOUND) if self.EPOCH_BOUND else claimed
        run_left = steps_left(trainer)
        epoch_left = trainer.num_training_batches - trainer.fit_loop.epoch_loop.batch_progress.current.ready
        if epoch_left - in_epoch >= need and run_left - claimed >= need:
            return "now"
        if behind and not self.EPOCH_BOUND and run_left - claimed >= need:
            return "later"
        return None

    def _go_last(self, trainer: pl.Trainer) -> None:
        """Put the setting in place back and let the probes queued behind run first; this one resumes after them."""
        if self._active is not None:
            self._active.revert(trainer)
            self._active = None
        self._leave(trainer)
        self.join(trainer)

    def _slower_every_round(self) -> list[str]:
        """The candidates `clearly_slower` than the setting in place in each of the first `DROP_AFTER` rounds."""
        medians = block_medians(self.blocks, self.warmup)
        slower: set[str] | None = None
        for k in range(DROP_AFTER):
            this_round = {name: m[k] if len(m) > k else None for name, m in medians.items()}
            found = set(clearly_slower(this_round, self.current.name, self.margin))
            slower = found if slower is None else slower & found
        return sorted(slower or ())

    def _medians(self) -> dict[str, float | None]:
        """Each setting's median timed step over all its blocks (None before it has one): what the decision reports."""
        return {name: statistics.median(times) if times else None for name, times in self.times.items()}

    def _estimates(self) -> dict[str, float | None]:
        """Each setting's step time as the decision weighs it, round by round (`decisions.weigh_by_rounds`)."""
        return weigh_by_rounds(self._medians(), self.blocks, self.current.name, self.warmup)

    def _to_confirm(self) -> str | None:
        """The candidate to give another round: a small gain that lost one round too many (`EXTRA_ROUNDS`)."""
        if self._round >= self.rounds + self.extra_rounds:
            return None
        step_s = self._estimates()
        leader, _ = choose_setting(step_s, self.current.name, self.margin)
        if leader == self.current.name:
            return None
        if 1.0 - (step_s[leader] or 0.0) / (step_s[self.current.name] or 1.0) >= CONSISTENT * self.margin:
            return None
        wins, rounds = round_wins(self.blocks, self.current.name, leader, self.warmup)
        return leader if rounds - wins == may_lose(self.rounds) + 1 else None

    def stop(self, trainer: pl.Trainer) -> None:
        """Put the setting in place back (the caller then applies the decision, or keeps it); leave the queue."""
        self._leave(trainer)
        if self._active is not None:
            self._active.revert(trainer)
            self._active = None

    def _decide(self, trainer: pl.Trainer) -> Decision:
        self.stop(trainer)
        step_s: dict[str, float | None]
        step_s, weighed = trainer.strategy.broadcast((self._medians(), self._estimates()), src=0)
        decision, reason = choose_setting(weighed, self.current.name, self.margin)
        gain = 1.0 - (weighed.get(decision) or 0.0) / (weighed.get(self.current.name) or 1.0)
        if decision != self.current.name and gain < CONSISTENT * self.margin:  # a small gain must hold round by round
            wins, rounds = trainer.strategy.broadcast(
                round_wins(self.blocks, self.current.name, decision, self.warmup), 0
            )
            extended = self.extra_rounds > 0 and rounds >= self.rounds + self.extra_rounds
            lost, allowed = rounds - wins, may_lose(self.rounds)
            confirmed = lost <= allowed or (lost == allowed + 1 and extended)
            if not confirmed:
                reason = f"{reason}, but faster in {wins} of {rounds} rounds only: kept {self.current.name}"
                decision = self.current.name
            elif wins < rounds:
                reason = f"{reason}, in {wins} of {rounds} rounds"
        added = self._round - self.rounds
        if added > 0:
            over = may_lose(self.rounds) + 1  # the lost rounds that asked for more
            reason += f" ({added} round{'s' * (added > 1)} added: it had lost {over if over > 1 else 'one'})"
        reason = "; ".join([reason, *self.notes])
        probe_s = self.extra_s(trainer, step_s.get(decision))
        extra = self.counted_fields()
        return Decision(decision, f"{reason}; counted trials", True, probe_s, step_s, {}, "measured", extra)

    def counted_fields(self) -> dict[str, Any]:
        """The probe's own fields for a decision's ``extra``: its blocks, steps, dropped candidates, wall seconds."""
        blocks = [
            {"setting": name, "step_s": times, "wait_s": waits}
            for (name, times), waits in zip(self.blocks, self.waits, strict=True)
        ]
        extra: dict[str, Any] = {"counted": True, "steps": sum(len(t) for _, t in self.blocks), "blocks": blocks}
        extra.update(dropped=list(self._dropped), probe_wall_s=time.perf_counter() - self._began)
        return extra

    def extra_s(self, trainer: pl.Trainer, kept_step_s: float | None) -> float:
        """The probe's cost: the seconds its blocks took beyond the kept setting's median step (rank zero's)."""
        kept = kept_step_s or 0.0
        extra = sum(max(0.0, sum(times) - kept * len(times)) for _, times in self.blocks)
        return float(trainer.strategy.broadcast(extra, src=0))
