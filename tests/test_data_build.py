"""Tests of the cache build's decoding: in this process, or by workers when they measured faster."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from lightning_speedkit.data import CachedDataset, build
from lightning_speedkit.data.packed import MANIFEST


class Decode:
    """Sample ``i``: a 4x4x3 array of ``i`` and ``i``, after ``delay`` seconds; raises at index ``fail``."""

    def __init__(self, delay: float = 0.0, fail: int | None = None) -> None:
        self.delay, self.fail = delay, fail

    def __call__(self, i: int) -> tuple[np.ndarray[Any, Any], int]:
        if i == self.fail:
            raise ValueError(f"bad sample {i}")
        if self.delay:
            time.sleep(self.delay)
        return np.full((4, 4, 3), i % 256, dtype=np.uint8), i

    def __len__(self) -> int:
        return 400

    def __getitem__(self, i: int) -> tuple[np.ndarray[Any, Any], int]:
        return self(i)


def _force(monkeypatch: pytest.MonkeyPatch, workers_win: bool) -> None:
    """Try workers after a short in-process window whatever is left, and keep them (or not) whatever they measure."""
    monkeypatch.setattr(build, "PROBE_S", 0.005)
    monkeypatch.setattr(build, "workers_can_repay", lambda left_s, workers: workers > 1)
    monkeypatch.setattr(build, "MARGIN", -1e9 if workers_win else 1.0)


def _indices(samples: list[tuple[np.ndarray[Any, Any], int]]) -> list[int]:
    assert all(np.array_equal(pixels, np.full((4, 4, 3), i % 256, np.uint8)) for pixels, i in samples)
    return [i for _, i in samples]


@pytest.mark.parametrize("workers_win", [True, False])
def test_the_samples_come_in_order_whichever_way_decodes_them(
    monkeypatch: pytest.MonkeyPatch, workers_win: bool
) -> None:
    """Workers that win decode the rest; workers that lose are shut down and this process goes on where they left."""
    _force(monkeypatch, workers_win)
    report: dict[str, Any] = {}
    samples = list(build.decode_all(Decode(delay=0.0005), 3, 400, workers=2, report=report))
    assert _indices(samples) == list(range(3, 400))
    assert report["in_process_s"] > 0
    assert report["workers_s"] is None or report["workers_s"] > 0
    assert report["way"] == ("workers" if workers_win else "in process")
    assert report["workers"] == (2 if workers_win else 0)


@pytest.mark.parametrize("workers_win", [True, False])
def test_trying_workers_leaves_the_global_rng_as_it_was(monkeypatch: pytest.MonkeyPatch, workers_win: bool) -> None:
    """Whichever way decodes, the global RNG after the build is the one before it: the fit's shuffle is the same."""
    torch.manual_seed(0)
    expected = torch.rand(3)
    _force(monkeypatch, workers_win)
    torch.manual_seed(0)
    list(build.decode_all(Decode(delay=0.0005), 0, 400, workers=2))
    assert torch.equal(torch.rand(3), expected)


def test_a_build_shorter_than_the_timing_window_never_starts_workers() -> None:
    """Samples decoded before `PROBE_S` is over end the build: nothing is timed against workers."""
    report: dict[str, Any] = {}
    assert _indices(list(build.decode_all(Decode(), 0, 20, workers=2, report=report))) == list(range(20))
    assert report == {"way": "in process", "workers": 0, "in_process_s": None, "workers_s": None}


def test_one_core_decodes_in_this_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """With fewer than 2 workers to try, this process decodes every sample and nothing is timed."""
    _force(monkeypatch, workers_win=True)
    report: dict[str, Any] = {}
    assert _indices(list(build.decode_all(Decode(delay=0.0002), 0, 100, workers=1, report=report))) == list(range(100))
    assert report["way"] == "in process"


def test_a_sample_that_fails_in_a_worker_raises_its_own_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """A decoding error in a worker reaches the caller as the same exception, naming the sample."""
    _force(monkeypatch, workers_win=True)
    with pytest.raises(ValueError, match="bad sample 300"):
        list(build.decode_all(Decode(delay=0.0002, fail=300), 0, 400, workers=2))


def test_workers_can_repay_only_a_long_enough_build_on_several_cores() -> None:
    """The best case (the decoding shared evenly) must repay the start-up twice over; one worker never can."""
    assert build.workers_can_repay(left_s=4 * build.WORKER_START_S, workers=2)
    assert not build.workers_can_repay(left_s=3 * build.WORKER_START_S, workers=2)
    assert not build.workers_can_repay(left_s=100.0, workers=1)


def test_a_cache_built_by_workers_is_the_same_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The packed file of a build decoded by workers has the SHA-256 of one decoded in this process."""
    monkeypatch.setattr(build, "build_workers", lambda limit=8: 0)
    alone = CachedDataset(Decode(delay=0.0002), tmp_path / "alone", fingerprint="v1")
    _force(monkeypatch, workers_win=True)
    monkeypatch.setattr(build, "build_workers", lambda limit=8: 2)
    shared = CachedDataset(Decode(delay=0.0002), tmp_path / "shared", fingerprint="v1")
    assert (alone.build_report["way"], shared.build_report["way"]) == ("in process", "workers")
    files = [json.loads((c.directory / MANIFEST).read_text())["files"] for c in (alone, shared)]
    assert files[0] == files[1]
    assert [shared[i][1] for i in range(len(shared))] == list(range(400))
