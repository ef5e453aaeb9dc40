"""Decoding a cache's samples once: in this process, or in worker processes when the build's own samples say so.

A `lightning_speedkit.data.CachedDataset` decodes its whole source once, and on a first run that build is part of the
fit's time (the demo's 4,000 training JPEGs: 0.9 s of a 12-17 s run on a 2-core AVX-512 EPYC, of which decoding
0.6-0.7 s; decoding at 0.33 ms a sample on the AVX2 one). Decoding is what
DataLoader workers are for, and before training starts the other cores are idle. Whether workers decode faster here
is measured on the build's own samples, none decoded twice (as counted trials are, `lightning_speedkit.trials.counted`):

1. the first samples are decoded in this process for `PROBE_S`, the second half of that window timed (the first
   samples pay one-off warm-ups: timing all of them made this process look 0.47 ms a demo sample against 0.2);
2. workers are tried only when what is left could repay their start-up (`workers_can_repay`);
3. the workers' first samples are timed over `2 * PROBE_S` from their start (the start-up included: a worker's
   first chunks come at once from its prefetch, so timing from the first one would flatter them), and they decode
   the rest only when they beat this process by `MARGIN`; otherwise they are shut down and this process decodes
   the rest.

Workers serve the samples in order (a DataLoader over the indices left), so the cache is the same file either way,
and the global RNG is left as it was (a worker loader draws its seed from it: a build that tried workers used to move
the fit's shuffle and weights, so the demo's same seed trained another trajectory when the timing chose otherwise).
"""

from __future__ import annotations

import itertools
import multiprocessing
import time
from collections.abc import Callable, Iterator
from typing import Any

from lightning.pytorch.utilities.seed import isolate_rng
from torch.utils.data import DataLoader, Dataset

from lightning_speedkit.hardware import cpu_info

__all__ = ["MARGIN", "PROBE_S", "WORKER_START_S", "build_workers", "decode_all", "workers_can_repay"]

WORKER_START_S = 0.2
"""Seconds workers take to start, priced into trying them: the first step of a one-worker loader block on the demo took
146-222 ms against a 22-26 ms step (2-core AVX-512 EPYC; two workers 253 ms). `DataLoaderTuner` prices its worker
candidates with it too (`lightning_speedkit.dataloader.counted.wait_can_repay`)."""

PROBE_S = 0.2
"""Seconds of samples decoded in this process before deciding whether to try workers (twice that for the workers)."""

MARGIN = 0.1
"""How much faster per sample the workers must be (their start-up included) to decode the rest."""

_PAYBACK = 2.0
"""How many times the best case must repay a start-up. Half the levers' 4 (`lightning_speedkit.decisions`): a build's
best case, idle cores sharing the decoding, is close to what happens, and a losing try costs one start-up and one
timing window of samples that are kept anyway."""


def workers_can_repay(left_s: float, workers: int, start_s: float = WORKER_START_S) -> bool:
    """Whether ``workers`` processes could save enough of the ``left_s`` seconds of decoding left to repay starting.

    At best the workers share the decoding evenly, saving ``left_s * (1 - 1/workers)``; that must repay their
    start-up ``_PAYBACK`` times.

    Example:
        >>> workers_can_repay(left_s=1.3, workers=2)  # the demo's training split on 2 cores
        True
        >>> workers_can_repay(left_s=0.3, workers=2), workers_can_repay(left_s=10.0, workers=1)
        (False, False)
    """
    return workers > 1 and left_s * (1.0 - 1.0 / workers) >= _PAYBACK * start_s


def build_workers(limit: int = 8) -> int:
    """Worker processes for a build: the cores this process may run on, at most ``limit``.

    0 inside a daemon process: a DataLoader worker cannot start processes of its own.
    """
    if multiprocessing.current_process().daemon:
        return 0
    return min(limit, cpu_info().available_cores)


CHUNK_S = 0.05
"""Seconds of decoding (as timed in this process) a worker does per item it sends back: a sample at a time, the
pickling and queueing of each one cost more than decoding it (2.1 ms against 0.5 ms a demo sample)."""


class _Chunks(Dataset[list[Any]]):
    """``decode(i)`` for the indices ``start`` to ``stop``, ``size`` at a time, for the workers."""

    def __init__(self, decode: Callable[[int], Any], start: int, stop: int, size: int) -> None:
        self.decode, self.start, self.stop, self.size = decode, start, stop, size

    def __len__(self) -> int:
        return -(-(self.stop - self.start) // self.size)

    def __getitem__(self, index: int) -> list[Any]:
        first = self.start + index * self.size
        return [self.decode(i) for i in range(first, min(first + self.size, self.stop))]


def _as_decoded(chunk: list[Any]) -> list[Any]:
    return chunk


def decode_all(
    decode: Callable[[int], Any],
    start: int,
    stop: int,
    workers: int | None = None,
    report: dict[str, Any] | None = None,
) -> Iterator[Any]:
    """``decode(i)`` for ``i`` from ``start`` to ``stop``, in order; by workers for the rest when they measured faster.

    Args:
        decode: The sample at an index (picklable where processes are spawned, not forked; else this process decodes).
        start: The first index.
        stop: One past the last index.
        workers: Worker processes to try (default: `build_workers`); below 2, this process decodes everything.
        report: Filled with what was decided: ``way`` ("in process" or "workers"), ``workers``, and the seconds per
            sample measured (``in_process_s``, ``workers_s``; None when not measured).
    """
    report = report if report is not None else {}
    report.update(way="in process", workers=0, in_process_s=None, workers_s=None)
    count = build_workers() if workers is None else workers
    position, began = start, time.perf_counter()
    half, halfway = start, began  # the window's second half is timed: its first samples pay one-off warm-ups
    while position < stop and ((now := time.perf_counter()) - began < PROBE_S or count < 2):
        if now - began < PROBE_S / 2:
            half, halfway = position, now
        yield decode(position)
        position += 1
    if position >= stop:
        return
    in_process_s = (time.perf_counter() - halfway) / max(1, position - half)
    report["in_process_s"] = in_process_s
    if workers_can_repay(in_process_s * (stop - position), count):
        chunks = _Chunks(decode, position, stop, size=max(1, round(CHUNK_S / max(in_process_s, 1e-9))))
        loader = DataLoader(chunks, batch_size=None, num_workers=count, collate_fn=_as_decoded)
        began, served = time.perf_counter(), 0
        iterator: Iterator[list[Any]] | None = None
        try:
            with isolate_rng(include_cuda=False):  # starting workers draws their seed from torch's global RNG
                iterator = iter(loader)
            first = next(iterator)
        except Exception:  # workers could not start here (an unpicklable source under spawn): decode in-process
            iterator = None
        if iterator is not None:
            report.update(way="workers", workers=count)
            for chunk in itertools.chain([first], iterator):
                yield from chunk
                position, served = position + len(chunk), served + len(chunk)
                elapsed = time.perf_counter() - began
                if report["workers_s"] is None and elapsed >= 2 * PROBE_S:
                    report["workers_s"] = workers_s = elapsed / served
                    if workers_s > in_process_s * (1.0 - MARGIN):
                        report.update(way="in process", workers=0)
                        break
            del iterator  # shuts the workers down
    while position < stop:
        yield decode(position)
        position += 1
