"""How often does a counted probe keep the right setting under a shared machine's load? Real step times, replayed.

A layout probe on a 2-core shared machine sees load come and go in bursts of a fraction of a second to a few
seconds; a burst that covers one setting's block and not the other's moves that round's ratio by more than NHWC's
gain. This benchmark measures how each shape of counted probe (block length x rounds) copes, on step times of the
real thing:

1. **Record.** ``--traces`` fits of the demo ResNet on the demo's packed image cache (batch 32, ``--precision``),
   each ``--steps`` training steps in one layout, every step timed as a counted probe times it (`StepClock`): first on
   the machine as it is ("quiet"), then again while a second process burns one core in random bursts of 0.2-1.5 s,
   busy 40% of the time ("bursts", standing in for a neighbour's load).
2. **Replay.** For each trace and each start offset (every 5 steps), a `CountedTrials` of two settings runs on the
   recorded steps in order, the candidate's steps scaled by ``ratio`` (its true step time against the setting in
   place: 0.85 and 0.90 are real gains, 1.0 none, 1.05 a loss). Every rule of the probe is the shipped one (paired
   rounds, the margin of 3%, the consistency rule, dropping, added rounds); only the clock reads the recording.

The result is, for each ratio and shape, the share of probes that kept the candidate: near 1 for a real gain, near 0
for a loss. ``25x3`` was `ChannelsLast`'s probe before, ``6x12`` is its probe now.

    python benchmarks/probe_replay.py --out benchmarks/results/avx512/probe_replay.json   # ~4 minutes on 2 cores
    python benchmarks/probe_replay.py --quick                                            # a smoke run for the tests
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import lightning as L

from lightning_speedkit.demo import DemoClassifier, DemoDataModule
from lightning_speedkit.hardware import cpu_info
from lightning_speedkit.timing import StepClock
from lightning_speedkit.trials.counted import CountedTrials
from lightning_speedkit.trials.settings import AsIs

if str(Path(__file__).resolve().parent) not in sys.path:  # _harness, also when a test loads this file by path
    sys.path.append(str(Path(__file__).resolve().parent))

from _harness import StepTimes, print_and_write, quiet_trainer

DEFAULT_OUT = Path(__file__).parent / "results" / "probe_replay.json"
SHAPES = ((25, 3), (10, 8), (6, 12))
"""(block steps, rounds) replayed: ChannelsLast's shape before, one between, and its shape now."""
RATIOS = (0.85, 0.90, 1.0, 1.05)
MARGIN = 0.03
"""ChannelsLast's default margin."""

_BURNER = """
import os, random, sys, time
random.seed(int(sys.argv[1]))
parent = os.getppid()
while os.getppid() == parent:  # ends with the benchmark, even one killed before it could stop this
    until = time.perf_counter() + random.uniform(0.2, 1.5)
    if random.random() < 0.4:
        while time.perf_counter() < until:
            pass
    else:
        time.sleep(until - time.perf_counter())
"""


def record(steps: int, seed: int, precision: str, cache_dir: str | None) -> list[float]:
    """The seconds of each of ``steps`` training steps of a demo fit (the first five, warming up, left out).

    A step's seconds run from the previous step's end to its own, as a counted probe's `StepClock` times it.
    """
    L.seed_everything(seed, verbose=False)
    datamodule = DemoDataModule(num_images=5000, batch_size=32, seed=0, root=cache_dir, cache=True)
    datamodule.prepare_data()
    ends = StepTimes()
    trainer = quiet_trainer(
        max_steps=steps + 5, callbacks=[ends], num_sanity_val_steps=0, limit_val_batches=0, precision=precision
    )
    trainer.fit(DemoClassifier(crop_size=datamodule.crop_size), datamodule)
    gaps = [b - a for a, b in zip(ends.ends, ends.ends[1:], strict=False)]  # steps 2, 3, ...
    return gaps[4:]


class _Progress:
    ready = 10


class _ReplayTrainer:
    """What `CountedTrials` reads of a Trainer, for a replay: one rank, an epoch and a run longer than any probe."""

    num_training_batches = 10**6
    estimated_stepping_batches = 10**6
    global_step = 0
    accumulate_grad_batches = 1

    def __init__(self) -> None:
        self.progress = _Progress()
        current = type("Current", (), {"current": self.progress})
        self.fit_loop = type("FitLoop", (), {"epoch_loop": type("Epoch", (), {"batch_progress": current})})
        self.fit_loop._combined_loader = object()  # built: `steps_left` leaves it alone
        self.strategy = type("Strategy", (), {"broadcast": staticmethod(lambda obj, src=0: obj)})


class _ReplayClock(StepClock):
    """A `StepClock` whose steps take the recorded seconds, the candidate's scaled by ``ratio``."""

    def __init__(self, steps: Iterator[float], trials: CountedTrials, candidate: AsIs, ratio: float) -> None:
        super().__init__()
        self.steps, self.trials, self.candidate, self.ratio = steps, trials, candidate, ratio

    def stop(self) -> float:
        seconds = next(self.steps)
        return seconds * self.ratio if self.trials._active is self.candidate else seconds


def replay(times: Sequence[float], ratio: float, block: int, rounds: int) -> tuple[bool, int]:
    """One counted probe on ``times`` in order: whether it kept the candidate, and how many steps it took."""
    current, candidate = AsIs("current"), AsIs("candidate")
    trials = CountedTrials(current, [candidate], block, MARGIN, warmup=1, rounds=rounds)
    steps = iter(times)
    trials._clock = _ReplayClock(steps, trials, candidate, ratio)  # the probe's own clock, reading the recording
    trainer: Any = _ReplayTrainer()
    trials.join(trainer)
    taken = 0
    while True:
        taken += 1
        trainer.progress.ready += 1
        trials.step_started(trainer)
        decision = trials.step_ended(trainer)
        if decision is not None:
            return decision.decision == "candidate", taken


def replay_all(traces: Sequence[Sequence[float]], stride: int, room: int) -> list[dict[str, Any]]:
    """Every ratio and shape, replayed from every ``stride``-th step of each trace that leaves ``room`` steps."""
    rows = []
    for ratio in RATIOS:
        for block, rounds in SHAPES:
            kept, steps = [], []
            for times in traces:
                for start in range(0, len(times) - room, stride):
                    won, taken = replay(times[start:], ratio, block, rounds)
                    kept.append(won)
                    steps.append(taken)
            rows.append(
                {
                    "ratio": ratio,
                    "shape": f"{block}x{rounds}",
                    "probes": len(kept),
                    "kept_candidate": sum(kept) / len(kept),
                    "mean_steps": statistics.fmean(steps),
                }
            )
    return rows


def _summary(times: Sequence[float]) -> dict[str, float]:
    ms = sorted(1e3 * t for t in times)
    return {"steps": len(ms), "median_ms": statistics.median(ms), "p90_ms": ms[int(0.9 * (len(ms) - 1))]}


def run(
    steps: int = 1500,
    traces: int = 3,
    precision: str = "bf16-mixed",
    quick: bool = False,
    out: str | Path = DEFAULT_OUT,
    cache_dir: str | None = None,
) -> dict[str, Any]:
    """Record quiet and bursty traces, replay every shape on them, print and write the JSON."""
    if quick:
        steps, traces = 300, 1
    # room: steps a probe may take from its start; the longest, 25x3 with its two added rounds, takes 250
    stride, room = (5, 400) if not quick else (40, 250)
    load_before = os.getloadavg()
    recorded: dict[str, list[list[float]]] = {"quiet": [], "bursts": []}
    for kind in recorded:
        burner = subprocess.Popen([sys.executable, "-c", _BURNER, "1"]) if kind == "bursts" else None
        try:
            for seed in range(traces):
                recorded[kind].append(record(steps, seed, precision, cache_dir))
        finally:
            if burner is not None:
                burner.kill()
                burner.wait()
    started = time.perf_counter()
    replays = {kind: replay_all(times, stride, room) for kind, times in recorded.items()}
    info = cpu_info()
    result = {
        "settings": {"steps": steps, "traces": traces, "precision": precision, "quick": quick, "stride": stride},
        "cpu": {"model": info.model, "flags": list(info.flags), "isa_limit": info.isa_limit},
        "load_average": {"before": list(load_before), "after": list(os.getloadavg())},
        "traces": {kind: [_summary(t) for t in times] for kind, times in recorded.items()},
        "replays": replays,
        "replay_s": time.perf_counter() - started,
    }
    lines = [
        f"{kind:<7} ratio {row['ratio']:.2f} {row['shape']:>5}: candidate kept in {100 * row['kept_candidate']:5.1f}%"
        f" of {row['probes']} probes, {row['mean_steps']:.0f} steps each"
        for kind, rows in replays.items()
        for row in rows
    ]
    print_and_write("\n".join(lines), result, out)
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1500, help="training steps per recorded trace")
    parser.add_argument("--traces", type=int, default=3, help="traces per condition (quiet, bursts)")
    parser.add_argument("--precision", default="bf16-mixed", help="the fits' precision (32-true on an AVX2 CPU)")
    parser.add_argument("--quick", action="store_true", help="one short trace per condition (a smoke run)")
    parser.add_argument("--out", default=None, help=f"the JSON (default {DEFAULT_OUT}; with --quick a temp dir)")
    parser.add_argument("--cache-dir", default=None, help="where the demo's images are generated and cached")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.traces < 1:
        parser.error(f"--steps and --traces must be at least 1, got {args.steps} and {args.traces}")
    out = args.out or (Path(tempfile.mkdtemp()) / DEFAULT_OUT.name if args.quick else DEFAULT_OUT)
    return run(args.steps, args.traces, args.precision, args.quick, out, args.cache_dir)


if __name__ == "__main__":
    main()
