"""Is the layout decision stable? The demo's ChannelsLast decision made afresh N times, against a long timing.

Each of ``--runs`` fits is the demo's speedkit side as far as the layout goes: the demo ResNet on the packed cache of
the demo's images (`lightning_speedkit.demo.DemoDataModule` with ``cache=True``), batch 32, the demo's epoch budget,
with ``ChannelsLast(remember=False)`` (nothing remembered: every run probes) and its default counted probe. Each fit
stops once the layout is decided: what follows does not change the decision.

The reference is a long side-by-side timing in the same process: training steps of the same model in both layouts
on one fixed batch, interleaved rounds (NCHW, NHWC, NCHW, ...) of ``--repeats`` steps each, ``--rounds`` rounds, so
at least 200 steps per layout. Where that timing differs by ``--clear`` (10%) or more, a decision agrees only when
it keeps the faster layout; within it, either layout is a fair call. The result counts the agreeing runs and how
often the most common decision came (issue 25 asks for 9 in 10 or more).

    python benchmarks/layout_stability.py            # 10 runs and the reference: a few minutes on 2 cores
    python benchmarks/layout_stability.py --quick    # a smoke run for the tests
    python benchmarks/layout_stability.py --precision bf16-mixed   # as the demo trains on a CPU with bf16
"""

from __future__ import annotations

import argparse
import collections
import copy
import os
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch

from lightning_speedkit import ChannelsLast
from lightning_speedkit.demo import DemoClassifier, DemoDataModule, DemoResNet
from lightning_speedkit.hardware import cpu_info
from lightning_speedkit.layout import to_channels_last

if str(Path(__file__).resolve().parent) not in sys.path:  # _harness, also when a test loads this file by path
    sys.path.append(str(Path(__file__).resolve().parent))

from _harness import fixed_batch, interleaved_ms, print_and_write, quiet_trainer, train_step

DEFAULT_OUT = Path(__file__).parent / "results" / "layout_stability.json"


class _StopWhenDecided(L.Callback):
    """Ends the fit at the first step after ``lever`` has decided."""

    def __init__(self, lever: ChannelsLast) -> None:
        self.lever = lever

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if self.lever.report().get("decision") is not None:
            trainer.should_stop = True


def decide_once(
    num_images: int, max_epochs: int, cache_dir: str | None, seed: int, precision: str = "32-true"
) -> dict[str, Any]:
    """One demo-like fit in ``precision`` with a fresh ``ChannelsLast``: its report and the steps it trained."""
    L.seed_everything(seed, verbose=False)
    datamodule = DemoDataModule(num_images=num_images, batch_size=32, seed=0, root=cache_dir, cache=True)
    datamodule.prepare_data()
    lever = ChannelsLast(remember=False)
    trainer = quiet_trainer(
        max_epochs=max_epochs,
        callbacks=[lever, _StopWhenDecided(lever)],
        num_sanity_val_steps=0,
        limit_val_batches=0,
        precision=precision,
    )
    trainer.fit(DemoClassifier(crop_size=datamodule.crop_size), datamodule)
    report = lever.report()
    return {
        "decision": report["decision"],
        "reason": report["reason"],
        "step_ms": report.get("step_ms"),
        "probe_s": report.get("probe_s"),
        "steps": trainer.global_step,
    }


def reference(rounds: int, repeats: int, crop: int, precision: str = "32-true") -> dict[str, Any]:
    """Median ms per training step of the demo ResNet in each layout over interleaved rounds, on one batch.

    ``precision``: ``"bf16-mixed"`` times the steps under bf16 autocast, as the fits train.
    """
    torch.manual_seed(0)
    x, y = fixed_batch(32, crop)
    nchw = DemoResNet(width=16)
    nhwc = copy.deepcopy(nchw)
    to_channels_last(nhwc)
    autocast = torch.bfloat16 if precision == "bf16-mixed" else None
    steps = {"default": train_step(nchw, x, y, autocast), "channels_last": train_step(nhwc, x, y, autocast)}
    ms = interleaved_ms(steps, rounds, repeats)
    return {
        "rounds": rounds,
        "repeats": repeats,
        "steps_per_layout": rounds * repeats,
        "ms": ms,
        "nhwc_over_nchw": ms["channels_last"] / ms["default"],
    }


def judge(decisions: list[str], ratio: float, clear: float) -> dict[str, Any]:
    """How many ``decisions`` agree with a reference NHWC/NCHW step-time ``ratio``, and the most common one's count.

    Example:
        >>> judge(["default"] * 9 + ["channels_last"], 1.25, 0.1)["agree"]
        9
        >>> judge(["default", "channels_last"], 1.05, 0.1)["agree"]  # within 10%: either is a fair call
        2
    """
    faster = "channels_last" if ratio <= 1 - clear else "default" if ratio >= 1 + clear else None
    agree = sum(1 for d in decisions if faster is None or d == faster)
    counts = collections.Counter(decisions)
    return {
        "clear_winner": faster,
        "agree": agree,
        "runs": len(decisions),
        "most_common": counts.most_common(1)[0][1],
        "counts": dict(counts),
    }


def run(
    quick: bool = False,
    runs: int = 10,
    rounds: int = 10,
    repeats: int = 25,
    clear: float = 0.10,
    out: str | Path = DEFAULT_OUT,
    cache_dir: str | None = None,
    precision: str = "32-true",
) -> dict[str, Any]:
    """Decide ``runs`` times, time the reference, judge, print and write the JSON; every step in ``precision``."""
    num_images, max_epochs = (400, 50) if quick else (5000, 8)  # quick: 500 steps repay 12 rounds of 4-step blocks
    if quick:
        runs, rounds, repeats = 2, 2, 3
    load_before = os.getloadavg()
    decided = [decide_once(num_images, max_epochs, cache_dir, seed, precision) for seed in range(runs)]
    ref = reference(rounds, repeats, crop=56, precision=precision)
    verdict = judge([d["decision"] for d in decided], ref["nhwc_over_nchw"], clear)
    info = cpu_info()
    result = {
        "settings": {
            "quick": quick,
            "runs": runs,
            "clear": clear,
            "precision": precision,
            "num_images": num_images,
            "batch_size": 32,
            "torch_threads": torch.get_num_threads(),
        },
        "cpu": {"model": info.model, "flags": list(info.flags), "isa_limit": info.isa_limit},
        "load_average": {"before": list(load_before), "after": list(os.getloadavg())},
        "runs": decided,
        "reference": ref,
        "verdict": verdict,
    }
    lines = [f"{i}: {d['decision']:<14} ({d['reason']})" for i, d in enumerate(decided)]
    lines.append(
        f"reference, {ref['steps_per_layout']} steps per layout: NCHW {ref['ms']['default']:.2f} ms, "
        f"NHWC {ref['ms']['channels_last']:.2f} ms (NHWC/NCHW {ref['nhwc_over_nchw']:.3f})"
    )
    lines.append(
        f"agree with the reference: {verdict['agree']}/{verdict['runs']} (clear winner: "
        f"{verdict['clear_winner']}); most common decision {verdict['most_common']}/{verdict['runs']}"
    )
    print_and_write("\n".join(lines), result, out)
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tiny run for smoke tests")
    parser.add_argument("--runs", type=int, default=10, help="fits that each decide the layout afresh")
    parser.add_argument("--out", default=str(DEFAULT_OUT), help="where to write the JSON results")
    parser.add_argument("--cache-dir", default=None, help="where the demo images are (default: speedkit's cache)")
    parser.add_argument(
        "--precision",
        default="32-true",
        choices=("32-true", "bf16-mixed"),
        help="the precision every step trains in (the demo keeps bf16-mixed on a CPU with bf16 instructions)",
    )
    args = parser.parse_args(argv)
    return run(quick=args.quick, runs=args.runs, out=args.out, cache_dir=args.cache_dir, precision=args.precision)


if __name__ == "__main__":
    main()
