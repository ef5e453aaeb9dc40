from __future__ import annotations

import time

import pytest
import torch

import lightning_speedkit.timing as timing
from lightning_speedkit.timing import StepTime, StepTimer, WindowStats, median_ms, summarize


def test_all_is_sorted() -> None:
    """The module's `__all__` is sorted."""
    assert timing.__all__ == sorted(timing.__all__)


@pytest.mark.parametrize(
    ("steps", "wait_fraction", "h2d_fraction", "samples_per_second"),
    [
        ([], 0.0, 0.0, 0.0),
        ([StepTime(0.0, 0.0, 1.0, 10)], 0.0, 0.0, 10.0),
        ([StepTime(1.0, 0.5, 1.0, 10)], 0.5, 0.25, 5.0),
        ([StepTime(3.0, 0.0, 1.0, 8), StepTime(0.0, 0.0, 4.0, 8)], 3 / 8, 0.0, 2.0),
        ([StepTime(1.0, 0.0, 0.0, 0)], 1.0, 0.0, 0.0),
    ],
)
def test_summarize(steps: list[StepTime], wait_fraction: float, h2d_fraction: float, samples_per_second: float) -> None:
    """Fractions are of the summed step time and the rate is samples over that time; no time gives zeros."""
    stats = summarize(steps)
    assert stats.steps == len(steps)
    assert stats.data_wait_fraction == pytest.approx(wait_fraction)
    assert stats.h2d_fraction == pytest.approx(h2d_fraction)
    assert stats.samples_per_second == pytest.approx(samples_per_second)


@pytest.mark.parametrize(("argument", "value"), [("window", 0), ("window", 2.0), ("window", True), ("max_pending", 0)])
def test_bad_arguments(argument: str, value: object) -> None:
    """Bad sizes are refused with the argument's name."""
    with pytest.raises(ValueError, match=f"`{argument}`"):
        StepTimer(**{argument: value})  # type: ignore[arg-type]


class Clock:
    """A manual clock standing in for `time.perf_counter`, so the expected times are exact."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        """The current manual time."""
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    """Replace the timer's wall clock with a manual one."""
    fake = Clock()
    monkeypatch.setattr(timing.time, "perf_counter", fake)
    return fake


def test_wall_clock_split_on_cpu(clock: Clock) -> None:
    """On CPU, the time before `step_start` is data wait (with any copy time) and the time to `step_end` is compute."""
    timer = StepTimer(window=4)
    timer.mark()
    clock.now += 2.0  # fetching
    timer.add_h2d(0.5)
    timer.step_start(samples=8)
    clock.now += 1.0  # computing
    timer.step_end()
    clock.now += 3.0  # fetching the next batch
    timer.step_start(samples=8)
    clock.now += 1.0
    timer.step_end()
    assert timer.window_stats() == WindowStats(steps=2, samples=16, data_wait_s=5.0, h2d_s=0.5, compute_s=2.0)


def test_the_hosts_work_before_the_fetch_is_between_steps_not_data_wait(clock: Clock) -> None:
    """After a step, the time until the loop asks the loader for a batch (`fetch_start`) is ``between_s``.

    It was all data wait: other callbacks' hooks and Lightning's logging made an in-memory loader look slow.
    """
    timer = StepTimer(window=4)
    timer.mark()
    clock.now += 2.0  # fetching: after a mark, the wait begins at once
    timer.fetch_start()
    timer.step_start(samples=8)
    clock.now += 1.0
    timer.step_end()
    clock.now += 3.0  # the hooks after the step, the loop's logging
    timer.fetch_start()
    clock.now += 0.5  # fetching
    timer.step_start(samples=8)
    clock.now += 1.0
    timer.step_end()
    clock.now += 4.0  # no fetch told (a loop without the seam): the whole gap is data wait, as before
    timer.step_start(samples=8)
    clock.now += 1.0
    timer.step_end()
    stats = timer.total_stats()
    assert stats == WindowStats(steps=3, samples=24, data_wait_s=6.5, h2d_s=0.0, compute_s=3.0, between_s=3.0)
    assert [step.between_s for step in timer.recent_steps()] == [0.0, 3.0, 0.0]
    assert stats.between_fraction == pytest.approx(3.0 / 12.5)
    assert timing.median_fractions(timer.recent_steps())[2] == 0.0  # the median step's


def test_mark_starts_a_new_wait_and_forgets_copy_time(clock: Clock) -> None:
    """Time and copy time before `mark` (validation, an epoch boundary) is not counted as data wait."""
    timer = StepTimer()
    timer.step_start()
    clock.now += 1.0
    timer.step_end()
    timer.add_h2d(1.0)
    clock.now += 50.0  # validation
    timer.mark()
    clock.now += 2.0
    timer.step_start()
    clock.now += 1.0
    timer.step_end()
    assert timer.total_stats() == WindowStats(steps=2, samples=0, data_wait_s=2.0, h2d_s=0.0, compute_s=2.0)


def test_window_rolls_and_totals_keep_everything(clock: Clock) -> None:
    """The window covers the last `window` steps; the totals cover all of them and continue after `restore`."""
    timer = StepTimer(window=3)
    for samples in range(1, 6):
        timer.step_start(samples)
        timer.step_end()
    assert timer.window_stats().samples == 3 + 4 + 5
    assert (timer.total_stats().steps, timer.total_stats().samples) == (5, 15)
    fresh = StepTimer(window=3)
    fresh.restore(WindowStats(5, 15, 1.0, 0.5, 2.0))
    fresh.step_start(6)
    fresh.step_end()
    total = fresh.total_stats()
    assert (fresh.completed, total.steps, total.samples) == (6, 6, 21)
    assert (total.data_wait_s, total.h2d_s, total.compute_s) == (1.0, 0.5, 2.0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_events_read_lazily() -> None:
    """On CUDA, steps are counted once the GPU passes them, and the GPU's idle time between steps is the data wait."""
    timer = StepTimer(window=8, device="cuda")
    x = torch.randn(2048, 2048, device="cuda")
    timer.mark()
    for _ in range(4):
        time.sleep(0.02)  # the GPU idles while the host "fetches"
        timer.step_start(samples=2048)
        for _ in range(10):
            x = x @ x
            x = x / x.norm()
        timer.step_end()
    assert timer.started == 4
    assert timer.completed <= 4
    timer.flush()
    stats = timer.window_stats()
    assert (timer.completed, stats.steps, stats.samples) == (4, 4, 4 * 2048)
    assert stats.compute_s > 0
    assert stats.data_wait_s >= 0.5 * 4 * 0.02  # most of each host sleep shows as GPU idle time


def test_median_ms_skips_warmup_calls_and_checks_arguments() -> None:
    """Warm-up calls run but are not timed; a non-positive repeat count is refused."""
    calls: list[int] = []
    assert median_ms(lambda: calls.append(1), repeats=3, warmup=2) >= 0.0
    assert len(calls) == 5
    with pytest.raises(ValueError, match="`repeats`"):
        median_ms(lambda: None, repeats=0)
