"""Three of speedkit's rules and the probes themselves, each against the demo without it, end to end, on every seed.

``speedkit demo``'s speedkit side (``preset(lr="auto")`` on the embedded workload, the same config and budget) is run
several ways on each seed, beside the demo's naive baseline, all in an order that rotates from seed to seed:

- ``library``: as every user gets it.
- ``no_signal_rule``: ``LRFinder(method="range", min_signal=0)``: the range test that follows the valley of any
  curve (fastai's rule), however flat and noisy, instead of keeping the user's LR when the loss fell by less than 3x
  its noise.
- ``no_first_round_drop``: `lightning_speedkit.trials.measure` times every candidate in both rounds, also the ones
  the first round showed clearly slower (`lightning_speedkit.decisions.clearly_slower` switched off for this run
  only: a patch, since no lever exposes it).
- ``collect_at_exit``: every `~lightning_speedkit.trials.TrialSession` ends with a full ``gc.collect()`` on the CPU
  too, as before the sessions left that to Python (`lightning_speedkit.oom.release_memory` always collecting, for
  this run only: the other patch).
- ``no_probes``: the choices the library makes on this 2-core CPU (``benchmarks/results/demo.json``: bf16-mixed,
  channels-last, the loader as built, the user's LR) given up front, so nothing is probed: what the probes cost, and
  the most that cheaper probes could win. Not a library setting: it knows the answers.
- ``lr_x2``: ``no_probes`` at twice the user's LR, hand-picked: whether a higher peak LR, which no range test found
  here, would shorten the run on every seed. Not a library setting either.
- ``ema`` and ``ema_short``: ``library`` plus Lightning's own ``EMAWeightAveraging`` at ``decay=0.99`` (a time
  constant of 100 steps, about an epoch of the demo) and ``0.97`` (33 steps): validation, and the weights the run
  ends with, are an exponential moving average of the trained weights (buffers too, Lightning's default). Whether
  averaging, which Hägele et al. 2024 found recovers part of a cool-down's gain at a constant LR, smooths the
  epoch-to-epoch swings of ``val_acc`` enough to reach the target in fewer epochs. Not a library setting.
- ``average``: ``library`` with ``preset(average=True)``: the library's `~lightning_speedkit.WeightAverage`, its decay
  set by the run (a time constant of a quarter of the steps between validations: 0.968 on the demo's 125-step
  epochs), updated with one fused ``lerp`` a step.
- ``no_fused``, ``no_layout`` and ``no_fused_no_layout``: ``library`` with ``preset(fused_optimizer=False)``,
  ``preset(channels_last=False)`` or both: the two levers that keep the math and change only its rounding (the fused
  update, the NHWC layout), off. Whether a seed that needs more epochs than the baseline does so because of their
  rounding (with both off, the speedkit side trains the baseline's trajectory, bit for bit, at the user's LR).
- ``remembered``: ``library`` run twice with the same lever memory; the second run is the one counted (every lever
  applies its remembered decision, nothing is probed), the first is kept under ``first_run``: what a user's second
  run of the same job gets, beside ``no_probes`` in the same benchmark run.

For each run: time to the target ``val_acc``, epochs, the LR chosen and why, each lever's probe seconds, and the
speed-up over the baseline of the same seed (0.0 for a miss, as ``speedkit demo --seeds`` counts it). The summary
gives each way's median speed-up and time to target (a seed that missed it counts as slower than any that reached
it), how many seeds reached it, and the median probe seconds.

    python benchmarks/demo_rules.py                 # seeds 0-4, every way: about half an hour on 2 CPU cores
    python benchmarks/demo_rules.py --quick         # a smoke run
    python benchmarks/demo_rules.py --ways library,no_probes   # the baseline and two ways
    python benchmarks/demo_rules.py --ways no_probes,remembered --out benchmarks/results/demo_remembered_rules.json
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import math
import os
import statistics
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import EMAWeightAveraging

from lightning_speedkit import ChannelsLast, LRFinder
from lightning_speedkit.demo import DemoConfig
from lightning_speedkit.demo.run import parse_seeds, train_variant
from lightning_speedkit.hardware import cpu_info
from lightning_speedkit.oom import release_memory
from lightning_speedkit.report import machine_and_load

if str(Path(__file__).resolve().parent) not in sys.path:  # _harness, also when a test loads this file by path
    sys.path.append(str(Path(__file__).resolve().parent))

from _harness import fresh_decisions, print_and_write, rotated

DEFAULT_OUT = Path(__file__).parent / "results" / "demo_rules.json"
WAYS = (
    "baseline",
    "library",
    "no_signal_rule",
    "no_first_round_drop",
    "collect_at_exit",
    "no_probes",
    "lr_x2",
    "ema",
    "ema_short",
    "average",
    "no_fused",
    "no_layout",
    "no_fused_no_layout",
    "remembered",
)
EMA_DECAYS = {"ema": 0.99, "ema_short": 0.97}
"""The ``ema`` ways' decays (Lightning's default, 0.999, averages over the demo's whole 1,000-step budget)."""
LEVERS_OFF = {
    "no_fused": {"fused_optimizer": False},
    "no_layout": {"channels_last": False},
    "no_fused_no_layout": {"fused_optimizer": False, "channels_last": False},
}
"""The ways with rounding-only levers switched off: their ``preset`` options."""


def given() -> dict[str, Any]:
    """``no_probes``' preset options: what the library keeps on the demo, here.

    The precision (bf16 autocast where the CPU has bf16 instructions, fp32 elsewhere, as
    ``benchmarks/results/demo.json`` records), the loader as built and the user's LR (no LR search).
    """
    precision = "bf16-mixed" if cpu_info().bf16_instructions else "32-true"
    return {"precision": precision, "lr": False, "tune_data": False}


@contextlib.contextmanager
def _patched(module_name: str, name: str, value: Any) -> Iterator[None]:
    """``module_name.name`` is ``value`` while the block runs (the one run of a way that switches a rule off)."""
    module = importlib.import_module(module_name)
    original = vars(module)[name]
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, original)


def _always_collect(collect: bool = True) -> None:
    release_memory(collect=True)


PATCHES = {
    "no_first_round_drop": ("lightning_speedkit.trials.measure", "clearly_slower", lambda *args, **kwargs: []),
    "collect_at_exit": ("lightning_speedkit.trials.session", "release_memory", _always_collect),
}
"""The ways that switch off a rule no lever exposes: module, name, stand-in."""


def run_way(config: DemoConfig, way: str) -> dict[str, Any]:
    """One demo run of ``way`` (the baseline, or the speedkit side changed one way); the figures compared."""
    if way == "baseline":
        return {"way": way, **_figures(train_variant(config, "baseline", progress=False))}
    fresh_decisions()  # every way probes afresh: a decision remembered from another way would hide its probes
    if way == "remembered":  # the first run probes and remembers; the second applies what the first decided
        first = train_variant(config, "speedkit", progress=False)
        second = train_variant(config, "speedkit", progress=False)
        return {"way": way, **_figures(second), "sources": second["choices"]["sources"], "first_run": _figures(first)}
    callbacks: list[L.Callback] = [LRFinder(method="range", min_signal=0.0)] if way == "no_signal_rule" else []
    if way in EMA_DECAYS:
        callbacks = [EMAWeightAveraging(decay=EMA_DECAYS[way])]
    options: dict[str, Any] = {"average": True} if way == "average" else dict(LEVERS_OFF.get(way, {}))
    if way in ("no_probes", "lr_x2"):
        callbacks, options = [ChannelsLast(measure=False)], given()  # NHWC, as measured faster here, without a probe
        config = dataclasses.replace(config, lr=2 * config.lr) if way == "lr_x2" else config
    with _patched(*PATCHES[way]) if way in PATCHES else contextlib.nullcontext():
        result = train_variant(config, "speedkit", progress=False, callbacks=callbacks, preset_options=options)
    return {"way": way, **_figures(result)}


def _figures(result: dict[str, Any]) -> dict[str, Any]:
    choices = result["choices"]
    return {
        "time_to_target_s": result["time_to_target_s"],
        "epochs": result["epochs"],
        "final_val_acc": result["final_val_acc"],
        "lr": choices["lr"],
        "lr_reason": choices["lr_reason"],
        "probe_s": choices["probe_s"],
        "probes": choices["probes"],
        "precision": choices.get("precision", "32-true"),
        "channels_last": choices["channels_last"],
        "optimizer": choices["optimizer"],
        "loader": choices.get("loader", "as built"),
        "samples_per_s": result.get("samples_per_s"),
        "data_wait_fraction": result.get("data_wait_fraction"),
    }


def run(
    seeds: list[int], config: DemoConfig, out: str | Path = DEFAULT_OUT, ways: tuple[str, ...] = WAYS
) -> dict[str, Any]:
    """Every way (of ``ways``; the baseline always) on every seed, in rotating order; print the table and summary."""
    ways = ("baseline", *(w for w in ways if w != "baseline"))
    load_before = os.getloadavg()
    rows: list[dict[str, Any]] = []
    for position, seed in enumerate(seeds):
        seeded = dataclasses.replace(config, seed=seed)
        rows.extend({"seed": seed, **run_way(seeded, way)} for way in rotated(ways, position))
        base = next(r["time_to_target_s"] for r in rows[-len(ways) :] if r["way"] == "baseline")
        for row in rows[-len(ways) :]:
            row["speedup"] = base / row["time_to_target_s"] if base and row["time_to_target_s"] else 0.0
            reached = f"{row['time_to_target_s']:.1f} s" if row["time_to_target_s"] else "missed"
            print(
                f"seed {seed}  {row['way']:<20} {reached:>7} ({row['epochs']} ep)  {row['speedup']:.2f}x"
                f"  LR {row['lr']:.3g}  probes {row['probe_s']:.2f} s",
                flush=True,
            )
    summary: dict[str, Any] = {}
    lines = []
    for way in ways:
        mine = [r for r in rows if r["way"] == way]
        times = [r["time_to_target_s"] or math.inf for r in mine]  # a miss is slower than any time
        median = statistics.median(times)
        summary[way] = {
            "median_time_to_target_s": None if math.isinf(median) else median,
            "reached": sum(1 for t in times if not math.isinf(t)),
            "total": len(mine),
            "median_probe_s": statistics.median(r["probe_s"] for r in mine),
            "median_speedup": statistics.median(r["speedup"] for r in mine),
        }
        shown = summary[way]["median_time_to_target_s"]
        lines.append(
            f"{way:<20} reached {summary[way]['reached']}/{len(mine)}, median speed-up"
            f" {summary[way]['median_speedup']:.2f}x, median time to target"
            f" {'-' if shown is None else f'{shown:.1f} s'}, median probes {summary[way]['median_probe_s']:.2f} s"
        )
    result = {
        "config": dataclasses.asdict(config),
        "seeds": seeds,
        "rows": rows,
        "summary": summary,
        **machine_and_load(load_before),
    }
    print_and_write("\n".join(lines), result, out)
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0-4", help="seeds, as for `speedkit demo --seeds` (default 0-4)")
    parser.add_argument("--quick", action="store_true", help="one epoch of 200 images on one seed, a smoke run")
    parser.add_argument("--out", default=str(DEFAULT_OUT), help="where to write the JSON results")
    parser.add_argument("--ways", default=",".join(WAYS), help=f"ways to run, of {', '.join(WAYS)} (default all)")
    args = parser.parse_args(argv)
    ways = tuple(w.strip() for w in args.ways.split(",") if w.strip())
    unknown = [w for w in ways if w not in WAYS]
    if unknown:
        parser.error(f"--ways: unknown {', '.join(unknown)}; choose from {', '.join(WAYS)}")
    if args.quick:
        return run([0], DemoConfig.quick(num_images=200, max_epochs=1, stop_at_target=True), out=args.out, ways=ways)
    return run(parse_seeds(args.seeds), DemoConfig(), out=args.out, ways=ways)


if __name__ == "__main__":
    main()
