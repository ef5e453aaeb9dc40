"""The loader tuner's counted trials: the first epoch's batches, in the user's order, served by each setting in turn.

Loader settings change how batches arrive, never which: their trials can be the fit's first training steps
(`lightning_speedkit.trials.counted`). `CountedLoader` takes over the first epoch's iterator: the batches of indices
the fit's own loader drew (the run's sample order), served by a loader rebuilt with the settings in force
(`LiveSettings`), rebuilt over the batches left at each switch. After the decision the epoch is served with the
settings kept, later epochs by the rebuilt loaders. `LoaderTrials` is the probe: the lever contract's counted trials,
which stop after the loader in place's block when its wait for data cannot repay the probe, and leave out more
workers once fewer lost while their steps hardly waited for data.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Callable, Generator, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.utilities.seed import isolate_rng
from torch.utils.data import DataLoader, Sampler
from torch.utils.data.dataloader import _SingleProcessDataLoaderIter
from typing_extensions import override

from lightning_speedkit.data.build import WORKER_START_S
from lightning_speedkit.dataloader.rebuild import rebuild_dataloader, settings_name
from lightning_speedkit.decisions import probe_pays_back
from lightning_speedkit.trials import Decision, LeaveOut, Setting, steps_left
from lightning_speedkit.trials.counted import CountedTrials, counted_cost

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = [
    "CountedBlock",
    "CountedLoader",
    "LiveSettings",
    "LoaderTrials",
    "more_workers_cannot_win",
    "steady_bound",
    "wait_can_repay",
    "wait_too_short",
    "worth_trying",
]


class _Epoch:
    """The epoch's batches of indices, drawn from its sampler iterator as loaders ask for them.

    Drawn lazily, as the fit's own iterator would draw them, so an epoch of millions of batches is never held;
    batches served are dropped, and those a loader prefetched but did not serve stay for the next loader.
    """

    def __init__(self, source: Iterator[Any]) -> None:
        self._source = source
        self._held: deque[list[int]] = deque()
        self._first = 0  # the position of _held[0]

    def batch(self, position: int) -> list[int] | None:
        """The batch at ``position`` in the epoch (None past its end)."""
        while position >= self._first + len(self._held):
            drawn = next(self._source, None)
            if drawn is None:
                return None
            self._held.append(list(drawn))
        return self._held[position - self._first]

    def served(self, position: int) -> None:
        """The batches before ``position`` are served: no loader asks for them again."""
        while self._first < position and self._held:
            self._held.popleft()
            self._first += 1


def _block_seed(run_seed: int, block: int) -> int:
    """The seed a block's loader draws its workers' seeds from: the run's, mixed with the block's number.

    From the run's RNG put back, every block's workers and the next epoch's got one seed: one random stream, twice.
    """
    return (run_seed * 0x9E3779B97F4A7C15 + 0x5EED * (block + 1)) % 2**63


class _Batches(Sampler[list[int]]):
    """A batch sampler over the epoch's batches from ``start`` on."""

    def __init__(self, epoch: _Epoch, start: int) -> None:
        self.epoch, self.start = epoch, start

    def __iter__(self) -> Iterator[list[int]]:
        position = self.start
        while (batch := self.epoch.batch(position)) is not None:
            yield batch
            position += 1


class LiveSettings:
    """The loader settings in force during the first epoch: the counted trials' block's, then the decision's."""

    def __init__(self, baseline: dict[str, Any]) -> None:
        self.settings = dict(baseline)


class CountedBlock(Setting):
    """A loader setting for a counted block: it only changes which settings `CountedLoader` serves with."""

    changes_math = False

    def __init__(self, live: LiveSettings, settings: dict[str, Any], name: str | None = None) -> None:
        self.live, self.settings = live, dict(settings)
        self.name = name or settings_name(settings)
        self._was: dict[str, Any] = {}

    @override
    def apply(self, trainer: pl.Trainer) -> None:
        self._was, self.live.settings = self.live.settings, dict(self.settings)

    @override
    def revert(self, trainer: pl.Trainer) -> None:
        self.live.settings = self._was


def steady_bound(step_s: float, wait_s: float, workers: int) -> float:
    """The shortest step ``workers`` loader processes can sustain, from an in-process loader's step and its wait.

    The step's own part (``step_s - wait_s``) stays, and ``workers`` processes, each loading a batch no faster than
    this process did, deliver one every ``wait_s / workers`` at best. A worker block's first timed steps are served
    from the batches its workers prefetched while starting, so they time the step's own part alone: with 3 ms
    samples, batches of 8 and 4 workers, 10.4x faster than in process, against 3.8x over the rest of the run.

    Example:
        >>> round(steady_bound(0.0278, 0.0243, 4), 4)  # data-bound: the workers' delivery
        0.0061
        >>> round(steady_bound(0.030, 0.002, 2), 4)  # compute-bound: the step's own part
        0.028
    """
    return max(step_s - wait_s, wait_s / workers)


def more_workers_cannot_win(reference_s: float, step_s: float, wait_s: float, margin: float) -> bool:
    """Whether settings with more workers than one that trained at ``step_s`` cannot beat ``reference_s`` by ``margin``.

    Workers only take the loading off the training process: more of them can at best remove the ``wait_s`` each step
    still spent waiting for its batch, while the step's own part (``step_s - wait_s``) stays, or grows as more
    processes share the cores. When that part alone is not ``margin`` faster than the setting in place, no count of
    workers can be. On the demo (2 cores, batches from a packed cache), one worker's steps took 35 ms against 22 ms in
    the training process and hardly waited: the worker took a core from the step, and two workers cost 0.3 s more.

    Example:
        >>> more_workers_cannot_win(reference_s=0.022, step_s=0.035, wait_s=0.001, margin=0.05)
        True
        >>> more_workers_cannot_win(reference_s=0.022, step_s=0.035, wait_s=0.020, margin=0.05)  # it waited: try more
        False
    """
    return step_s - wait_s > reference_s * (1.0 - margin)


def wait_can_repay(
    step_s: float,
    wait_s: float,
    steps_left: float,
    counted_steps: float,
    start_ups: int,
    start_s: float = WORKER_START_S,
) -> tuple[bool, str]:
    """Whether other loader settings can repay their counted probe, when at best they save each step's ``wait_s``.

    Every loader setting (workers, prefetch, pinning) changes only how a batch reaches the step, so none can save
    more than the time the step in place waits for its batch. That measured wait is the best case
    (`lightning_speedkit.decisions.probe_pays_back`'s ``max_gain``, as a fraction of ``step_s``); the probe's price is
    its worst case in steps (``counted_steps``, `lightning_speedkit.trials.counted.counted_cost`) plus the start-up
    of each candidate's workers (``start_ups`` of ``start_s`` seconds), in steps of ``step_s``.

    Example:
        >>> wait_can_repay(step_s=0.026, wait_s=0.0042, steps_left=934, counted_steps=36, start_ups=2)
        (False, 'the probe (51 steps) cannot pay back in 934 steps left (at best 151 saved, 206 needed)')
        >>> wait_can_repay(step_s=0.026, wait_s=0.0042, steps_left=50_000, counted_steps=36, start_ups=2)[0]
        True
    """
    cost = counted_steps + start_ups * start_s / step_s
    pays, why = probe_pays_back(cost, steps_left, max_gain=wait_s / step_s)
    return pays, why.removeprefix("skipped: ")


def wait_too_short(
    name: str, step_s: float, wait_s: float, steps_left: float, probe_steps: float, start_ups: int
) -> str:
    """Why the loader ``name`` is kept without trying others (`wait_can_repay` says no), or "" when they may repay.

    Example:
        >>> wait_too_short("as built", step_s=0.026, wait_s=0.0042, steps_left=934, probe_steps=36, start_ups=2)[:74]
        'kept as built: its steps wait 4.2 ms of 26.0 ms for data, the most another'
        >>> wait_too_short("as built", step_s=0.026, wait_s=0.02, steps_left=934, probe_steps=36, start_ups=2)
        ''
    """
    pays, why = wait_can_repay(step_s, wait_s, steps_left, probe_steps, start_ups)
    if pays:
        return ""
    return (
        f"kept {name}: its steps wait {1e3 * wait_s:.1f} ms of {1e3 * step_s:.1f} ms for data, the most another loader"
        f" setting can save, and {why}"
    )


def worth_trying(
    name: str,
    step_s: float,
    wait_s: float,
    steps_left: float,
    candidates: Sequence[tuple[str, dict[str, Any]]],
    price: Callable[[int], float],
) -> tuple[str, LeaveOut | None]:
    """After the loader in place's block: which of ``candidates`` (name, settings) are worth trying.

    ``price(n)`` is the probe's cost in steps with ``n`` candidates, without their workers' start-up. Returns why
    the loader ``name`` is kept with none tried (`wait_too_short`), or "" and the candidates to leave out: those
    with workers, when their start-up is what the wait cannot repay and the candidates without workers (a batch
    fetched at once) can repay their own probe; or none left out.

    Example:
        >>> tried = [("fetched at once", {"num_workers": 0}), ("num_workers=1", {"num_workers": 1})]
        >>> keep, out = worth_trying("as built", 0.0017, 0.0006, 900, tried, price=lambda n: 18 * n)
        >>> keep, out.names
        ('', ('num_workers=1',))
        >>> worth_trying("as built", 0.0017, 0.0006, 900_000, tried, price=lambda n: 18 * n)
        ('', None)
        >>> worth_trying("as built", 0.0017, 0.00001, 900, tried, price=lambda n: 18 * n)[0][:41]
        'kept as built: its steps wait 0.0 ms of 1'
    """
    start_ups = sum(1 for _, settings in candidates if settings["num_workers"] > 0)
    keep = wait_too_short(name, step_s, wait_s, steps_left, price(len(candidates)), start_ups)
    if not keep:
        return "", None
    cheap = [n for n, settings in candidates if settings["num_workers"] == 0]
    if (
        not cheap
        or len(cheap) == len(candidates)
        or wait_too_short(name, step_s, wait_s, steps_left, price(len(cheap)), 0)
    ):
        return keep, None
    out = tuple(n for n, settings in candidates if settings["num_workers"] > 0)
    return "", LeaveOut(out, f"their workers' start-up cannot pay back in {steps_left:.0f} steps left")


class LoaderTrials(CountedTrials):
    """The loader tuner's counted trials (`lightning_speedkit.trials.counted.CountedTrials`), with two rules more.

    - After the first block (the loader in place), the probe goes on only when what that block's steps waited for
      data can repay it (`wait_can_repay`): otherwise the loader is kept, no candidate tried.
    - After a worker candidate's first block, the candidates with more workers (and the same pinning) are left out
      when `more_workers_cannot_win`.

    Rank zero's timings decide; every rank keeps or drops the same settings. Its blocks are served by `CountedLoader`
    over the first epoch, so a round it adds must fit there (``EPOCH_BOUND``).
    """

    EPOCH_BOUND = True
    cuts_short = False  # a worker candidate's first steps wait for its workers to start

    @override
    def block_ended(self, trainer: pl.Trainer) -> Decision | None:
        self._at_most_as_fast_as_workers_deliver()
        name, times = self.blocks[-1]
        if self._round != 1 or not times[self.warmup :]:
            return None
        step_s = statistics.median(times[self.warmup :])
        wait_s = statistics.median(self.waits[-1][self.warmup :])
        if name == self.current.name:
            return self._worth_trying(trainer, step_s, wait_s)
        settings = {s.name: s for s in self.settings if isinstance(s, CountedBlock)}
        drop: list[str] = []
        tried = settings.get(name)
        if tried is not None and more_workers_cannot_win(
            statistics.median(self.times[self.current.name]), step_s, wait_s, self.margin
        ):
            workers, pinned = tried.settings["num_workers"], tried.settings.get("pin_memory")
            drop = [
                n
                for n, s in settings.items()
                if s.settings["num_workers"] > workers and s.settings.get("pin_memory") == pinned
            ]
        drop = trainer.strategy.broadcast(drop, src=0)
        if drop:
            self.drop(drop, f"{name} lost without waiting for data, and more workers only shorten that wait")
        return None

    def _at_most_as_fast_as_workers_deliver(self) -> None:
        """Raise a worker block's timed steps to `steady_bound` of the in-process loader in place, from its blocks."""
        name, times = self.blocks[-1]
        setting = next(s for s in self.settings if s.name == name)
        workers = setting.settings.get("num_workers", 0) if isinstance(setting, CountedBlock) else 0
        in_process = isinstance(self.current, CountedBlock) and not self.current.settings.get("num_workers", 0)
        timed, reference = len(times) - self.warmup, self.times[self.current.name]
        if not workers or not in_process or timed <= 0 or not reference:
            return
        own = (ws[self.warmup :] for (n, _), ws in zip(self.blocks, self.waits, strict=True) if n == self.current.name)
        bound = steady_bound(statistics.median(reference), statistics.median(w for ws in own for w in ws), workers)
        times[self.warmup :] = [max(t, bound) for t in times[self.warmup :]]
        self.times[name][-timed:] = times[self.warmup :]

    def _worth_trying(self, trainer: pl.Trainer, step_s: float, wait_s: float) -> Decision | None:
        """After the loader in place's block: None to go on (maybe fewer candidates), or the decision to keep it."""
        candidates = [(s.name, s.settings) for s in self.settings[1:] if isinstance(s, CountedBlock)]
        left = steps_left(trainer)
        step_s, wait_s = trainer.strategy.broadcast((step_s, wait_s), src=0)
        reason, out = worth_trying(
            self.current.name,
            step_s,
            wait_s,
            left,
            candidates,
            lambda n: counted_cost(1 + n, self.steps, self.rounds, self.margin),
        )
        if out is not None:
            self.drop(list(out.names), out.why)
        if not reason:
            return None
        reason += "; counted trials"
        extra = {**self.counted_fields(), "steps_left": None if math.isinf(left) else left}
        return Decision(self.current.name, reason, True, 0.0, {self.current.name: step_s}, {}, "measured", extra)


class CountedLoader:
    """Serves the rest of the first epoch's batches, in the fit's own order, through the settings in force.

    `take_over` replaces the single-process iterator the fit built for the epoch: its batches of indices still to
    come are drawn from its own sampler iterator (already seeded for the epoch, so the order is the run's), and
    served through a loader rebuilt with the settings in force, rebuilt again over the batches left whenever the
    counted trials switch.

    Args:
        base: The train loader as the fit built it (its sampler already injected for DDP).
        live: The settings in force, switched by the counted trials.
    """

    def __init__(self, base: DataLoader[Any], live: LiveSettings) -> None:
        self.base, self.live = base, live
        self.loaders_built = 0
        self._served: Generator[Any, None, None] | None = None

    def take_over(self, iterator: Any) -> Iterator[Any] | None:
        """The generator to put in place of the epoch's ``iterator`` (None when it is not a single-process one)."""
        if not isinstance(iterator, _SingleProcessDataLoaderIter):
            return None
        self._served = self._serve(_Epoch(iterator._sampler_iter))
        return self._served

    def close(self) -> None:
        """End the serving (and its workers) at the epoch's end."""
        if self._served is not None:
            self._served.close()
            self._served = None

    def _serve(self, epoch: _Epoch) -> Generator[Any, None, None]:
        position, switched = 0, True
        kept: dict[str, tuple[DataLoader[Any], _Batches]] = {}  # loaders whose persistent workers outlive a block
        try:
            while switched:
                settings = dict(self.live.settings)
                name = settings_name(settings)
                if name in kept:  # its workers wait, alive: the next iterator resumes them from ``position``
                    loader, batches = kept[name]
                    batches.start = position
                else:
                    batches = _Batches(epoch, position)
                    loader = rebuild_dataloader(self.base, settings, batch_sampler=batches)
                    self.loaders_built += 1
                    if loader.num_workers > 0 and loader.persistent_workers:
                        kept[name] = (loader, batches)
                # the workers' first prefetch, drawn here from the run's RNG as the fit's iterator would draw it
                epoch.batch(position + loader.num_workers * (loader.prefetch_factor or 0))
                state = generator.get_state() if (generator := loader.generator) is not None else None
                with isolate_rng(include_cuda=torch.cuda.is_available()):  # this iterator's seed draw is not the run's
                    drawn = generator or torch.default_generator
                    drawn.manual_seed(_block_seed(drawn.initial_seed(), self.loaders_built))
                    iterator = iter(loader)
                if generator is not None and state is not None:
                    generator.set_state(state)
                switched = False
                try:
                    for batch in iterator:
                        position += 1
                        epoch.served(position)
                        yield batch
                        if self.live.settings != settings:
                            switched = True
                            break
                finally:
                    del iterator  # a loader not kept shuts its workers down here, at the switch
        finally:
            for loader, _ in kept.values():
                _shut_down(loader)


def _shut_down(loader: DataLoader[Any]) -> None:
    """End a kept loader's persistent workers (its batches left prefetched are dropped with them)."""
    iterator = getattr(loader, "_iterator", None)
    if iterator is not None and hasattr(iterator, "_shutdown_workers"):
        iterator._shutdown_workers()
    loader._iterator = None
