"""Step timing: how long each training step waited for data and how long it computed, over a rolling window.

This is the one measurement path shared by the monitor, the dataloader tuner and the benchmarks. On CPU it reads
the wall clock. On CUDA it records two events per step on the current stream and reads them only once the GPU has
passed them (``Event.query()``), so it never calls ``torch.cuda.synchronize()``: the data wait is then the time the
GPU sat idle (or copying) between steps, which is what costs throughput.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from lightning_speedkit.checks import check_int

__all__ = ["StepClock", "StepTime", "StepTimer", "WindowStats", "median_fractions", "median_ms", "summarize"]


class StepClock:
    """Times training steps end to end: each from the previous step's end (its batch's wait and its compute).

    The first step, with no step before it, is timed from its `start`. Restored trials time a step the same way
    (`StepTimer`); counted trials and the remembered-decision check use this lighter clock.

    Example:
        >>> clock = StepClock()
        >>> clock.running
        False
        >>> clock.start(); clock.running
        True
        >>> clock.stop() >= 0.0, clock.running, clock.last_wait
        (True, False, 0.0)
    """

    def __init__(self) -> None:
        self._started = 0.0
        self._last_end = 0.0
        self.last_wait = 0.0
        """The part of the last stopped step before its `start`: waiting for its batch (0 for a first step)."""

    @property
    def running(self) -> bool:
        """Whether a step was started and not yet stopped."""
        return self._started != 0.0

    def start(self) -> None:
        """A step begins (its clock starts here only if no step ended before it)."""
        self._started = time.perf_counter()

    def reset(self) -> None:
        """Forget the last step's end: the next step is timed from its `start` (after a pause, or validation)."""
        self._last_end = 0.0

    def stop(self) -> float:
        """The step ends: its seconds from the previous step's end (or from its `start`)."""
        now = time.perf_counter()
        seconds = now - (self._last_end or self._started)
        self.last_wait = max(0.0, self._started - self._last_end) if self._last_end else 0.0
        self._started, self._last_end = 0.0, now
        return seconds


class StepTime(NamedTuple):
    """One training step.

    Args:
        data_wait_s: From the end of the previous step (or `StepTimer.mark`) to the start of this one: fetching,
            collating and copying the batch. On CUDA, the GPU's idle-or-copying time between the two steps.
        h2d_s: The part of the data wait the host spent in the host-to-device copy (wall clock, both devices).
        compute_s: From the start of the step to its end (forward, backward, optimizer).
        samples: Samples in the batch (0 when unknown).
        between_s: The part of the time between the steps before the loader was asked for this batch (Lightning's
            loop, callbacks' hooks, logging), not in ``data_wait_s``: on the wall clock, when `StepTimer.fetch_start`
            is told; else 0.
    """

    data_wait_s: float
    h2d_s: float
    compute_s: float
    samples: int
    between_s: float = 0.0


@dataclass(frozen=True)
class WindowStats:
    """Totals and rates over some steps; fractions are of the summed step time, 0 when there is no time.

    Example:
        >>> stats = summarize([StepTime(0.3, 0.1, 0.7, 32)] * 4)
        >>> stats.steps, round(stats.data_wait_fraction, 2), round(stats.samples_per_second, 1)
        (4, 0.3, 32.0)
    """

    steps: int
    samples: int
    data_wait_s: float
    h2d_s: float
    compute_s: float
    between_s: float = 0.0

    @property
    def total_s(self) -> float:
        """Data wait, compute and the host's work between the steps."""
        return self.data_wait_s + self.compute_s + self.between_s

    @property
    def between_fraction(self) -> float:
        """Share of the step time the host spent between steps outside the loader (`StepTime.between_s`)."""
        return self.between_s / self.total_s if self.total_s > 0 else 0.0

    @property
    def data_wait_fraction(self) -> float:
        """Share of the step time spent waiting for data, in [0, 1]."""
        return self.data_wait_s / self.total_s if self.total_s > 0 else 0.0

    @property
    def h2d_fraction(self) -> float:
        """Share of the step time the host spent copying batches to the device, in [0, 1]."""
        return min(1.0, self.h2d_s / self.total_s) if self.total_s > 0 else 0.0

    @property
    def samples_per_second(self) -> float:
        """Samples per second of step time (0 when no samples were counted)."""
        return self.samples / self.total_s if self.total_s > 0 else 0.0

    @property
    def steps_per_second(self) -> float:
        """Steps per second of step time."""
        return self.steps / self.total_s if self.total_s > 0 else 0.0


def summarize(steps: Iterable[StepTime]) -> WindowStats:
    """Sum steps into a `WindowStats`.

    Example:
        >>> summarize([StepTime(0.1, 0.0, 0.1, 8), StepTime(0.0, 0.0, 0.2, 8)]).data_wait_fraction
        0.25
        >>> summarize([]).samples_per_second
        0.0
    """
    count = samples = 0
    wait = h2d = compute = between = 0.0
    for step in steps:
        count += 1
        samples += step.samples
        wait += step.data_wait_s
        h2d += step.h2d_s
        compute += step.compute_s
        between += step.between_s
    return WindowStats(count, samples, wait, h2d, compute, between)


def median_fractions(steps: Sequence[StepTime]) -> tuple[float, float, float]:
    """The median over steps of each step's data-wait, host-to-device-copy and between-steps shares (0 for no steps).

    Unlike `WindowStats` fractions (shares of the summed time), one slow step (a warm-up, a checkpoint write, the
    process being descheduled) cannot swing it, so it describes the typical step.

    Example:
        >>> median_fractions([StepTime(0.5, 0.0, 0.5, 8), StepTime(0.6, 0.1, 0.4, 8), StepTime(0.0, 0.0, 9.0, 8)])
        (0.5, 0.0, 0.0)
    """
    if not steps:
        return 0.0, 0.0, 0.0
    totals = [step.data_wait_s + step.compute_s + step.between_s for step in steps]
    waits = [step.data_wait_s / t if t > 0 else 0.0 for step, t in zip(steps, totals, strict=True)]
    copies = [min(1.0, step.h2d_s / t) if t > 0 else 0.0 for step, t in zip(steps, totals, strict=True)]
    between = [step.between_s / t if t > 0 else 0.0 for step, t in zip(steps, totals, strict=True)]
    return statistics.median(waits), statistics.median(copies), statistics.median(between)


class _Pending(NamedTuple):
    before: torch.cuda.Event  # the previous step's end, or a mark
    start: torch.cuda.Event
    end: torch.cuda.Event
    h2d_s: float
    samples: int


class StepTimer:
    """Times steps with `step_start`/`step_end` and keeps the last ``window`` completed ones.

    Call `mark` where a data wait begins that does not follow a step (an epoch start, the end of validation);
    `add_h2d` adds host time spent copying the next batch to the device; `fetch_start`, told when the loop asks the
    loader for the next batch, ends the host's own work after a step (on the wall clock: its `StepTime.between_s`,
    not data wait). On CUDA, steps complete lazily: a step is counted once the GPU has passed its end event, so
    ``completed`` may trail ``started`` by a few steps; the data wait there is the GPU's idle time between steps.

    Args:
        window: How many completed steps `window_stats` covers.
        device: The device the steps run on; CUDA events are used for a CUDA device, the wall clock otherwise.
        max_pending: On CUDA, the most steps left unread before the oldest is waited for (bounds memory if the
            GPU falls far behind).

    Raises:
        ValueError: If ``window`` or ``max_pending`` is not a positive int.

    Example:
        >>> timer = StepTimer(window=2)
        >>> timer.mark()
        >>> for _ in range(3):
        ...     timer.step_start(samples=4)
        ...     timer.step_end()
        >>> timer.completed, timer.window_stats().steps
        (3, 2)
    """

    def __init__(self, window: int = 20, device: torch.device | str | None = None, max_pending: int = 64) -> None:
        check_int("window", window)
        check_int("max_pending", max_pending)
        self.window = window
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.cuda = self.device.type == "cuda"
        self.max_pending = max_pending
        self.completed = 0
        self.started = 0
        self._recent: deque[StepTime] = deque(maxlen=window)
        self._total_samples = 0
        self._total_wait = self._total_h2d = self._total_compute = 0.0
        self._samples = 0
        self._pending: deque[_Pending] = deque()
        self._h2d = self._between = 0.0
        self._total_between = 0.0
        self._since_end: float | None = None  # the last step's end, until the loader is asked for the next batch
        self._wall_before: float | None = None
        self._wall_start = 0.0
        self._event_before: torch.cuda.Event | None = None
        self._event_start: torch.cuda.Event | None = None

    def mark(self) -> None:
        """Start a data wait now (at an epoch start or after validation) and forget any copy time so far."""
        self._h2d = self._between = 0.0
        self._since_end = None
        self._wall_before = time.perf_counter()
        if self.cuda:
            self._event_before = self._record()

    def add_h2d(self, seconds: float) -> None:
        """Add host seconds spent copying the coming batch to the device."""
        self._h2d += seconds

    def fetch_start(self) -> None:
        """The loop asks the loader for a batch: the host's work since the last step's end was not a data wait."""
        if self._since_end is not None:
            self._between += time.perf_counter() - self._since_end
            self._since_end = None

    def step_start(self, samples: int = 0) -> None:
        """The batch is on the device and the step begins; ends the data wait."""
        now = time.perf_counter()
        self.started += 1
        if self._wall_before is None:
            self._wall_before = now
        self._wall_start = now
        self._samples = samples
        if self.cuda:
            if self._event_before is None:
                self._event_before = self._record()
            self._event_start = self._record()

    def step_end(self) -> None:
        """The step's work has been issued; starts the next data wait."""
        now = time.perf_counter()
        h2d, self._h2d = self._h2d, 0.0
        if self.cuda and self._event_before is not None and self._event_start is not None:
            end = self._record()
            self._pending.append(_Pending(self._event_before, self._event_start, end, h2d, self._samples))
            self._event_before, self._event_start = end, None
            while len(self._pending) > self.max_pending:
                self._pending[0].end.synchronize()
                self._read_ready()
        else:
            before = self._wall_before if self._wall_before is not None else self._wall_start
            between = min(self._between, self._wall_start - before)
            wait = self._wall_start - before - between
            self._add(StepTime(wait, h2d, now - self._wall_start, self._samples, between))
        self._wall_before, self._between = now, 0.0
        self._since_end = None if self.cuda else now

    def flush(self) -> None:
        """Wait for every pending CUDA step and count it (for the end of a run, not for every step)."""
        if self._pending:
            self._pending[-1].end.synchronize()
        self._read_ready()

    def window_stats(self) -> WindowStats:
        """Stats over the last ``window`` completed steps (reads only CUDA events that have finished)."""
        self._read_ready()
        return summarize(self._recent)

    def recent_steps(self) -> list[StepTime]:
        """The last ``window`` completed steps, oldest first."""
        self._read_ready()
        return list(self._recent)

    def total_stats(self) -> WindowStats:
        """Stats over every completed step since construction or `restore`."""
        self._read_ready()
        return WindowStats(
            self.completed,
            self._total_samples,
            self._total_wait,
            self._total_h2d,
            self._total_compute,
            self._total_between,
        )

    def restore(self, totals: WindowStats) -> None:
        """Continue the running totals from ``totals`` (saved from an earlier run, for a resume)."""
        self.completed, self._total_samples = totals.steps, totals.samples
        self._total_wait, self._total_h2d, self._total_compute = totals.data_wait_s, totals.h2d_s, totals.compute_s
        self._total_between = totals.between_s

    def _add(self, step: StepTime) -> None:
        self.completed += 1
        self._recent.append(step)
        self._total_samples += step.samples
        self._total_wait += step.data_wait_s
        self._total_h2d += step.h2d_s
        self._total_compute += step.compute_s
        self._total_between += step.between_s

    def _read_ready(self) -> None:
        while self._pending and self._pending[0].end.query():  # type: ignore[no-untyped-call]
            p = self._pending.popleft()
            wait = max(0.0, p.before.elapsed_time(p.start) / 1000.0)
            self._add(StepTime(wait, p.h2d_s, p.start.elapsed_time(p.end) / 1000.0, p.samples))

    def _record(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        event.record(torch.cuda.current_stream(self.device))
        return event


def median_ms(run: Callable[[], object], repeats: int, warmup: int = 2) -> float:
    """Median wall time in milliseconds of ``repeats`` calls of ``run``, after ``warmup`` untimed calls.

    Latency figures (pruning's CPU latency, INT8's ONNX Runtime latency, the benchmarks) all go through here.

    Example:
        >>> median_ms(lambda: sum(range(100)), repeats=3) >= 0.0
        True
    """
    if repeats < 1 or warmup < 0:
        raise ValueError(f"`repeats` must be >= 1 and `warmup` >= 0, got repeats={repeats}, warmup={warmup}.")
    for _ in range(warmup):
        run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append((time.perf_counter() - start) * 1000.0)
    return statistics.median(times)
