"""ChannelsLast: training-step and inference time of the same model in the default (NCHW) and channels-last layout.

For the demo ResNet (width 16, 56 px crops) at the batch sizes the demo and a throughput search use, for FlatHeadNet
(a net NHWC makes slower), and for an MLP as the control (no convolutions: `ChannelsLast` leaves it alone, the ratio
must be ~1). Both layouts start from the same weights and see the same batch; rounds are interleaved (NCHW, NHWC,
NCHW, ...) so drift on a shared machine hits both alike. The figure is the median step time over all rounds, and the
speed-up is NCHW time / NHWC time.

Then, for each conv net, what the callback itself decides: a real fit with ``ChannelsLast()`` long enough for its
probe to pay back, with the step times it measured and the layout it kept.

    python benchmarks/channels_last.py            # about a minute on 2 CPU cores
    python benchmarks/channels_last.py --quick    # seconds: a smoke run for the tests
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_speedkit import ChannelsLast
from lightning_speedkit.demo import DemoClassifier, DemoResNet, FlatHeadNet
from lightning_speedkit.layout import to_channels_last

if str(Path(__file__).resolve().parent) not in sys.path:  # _harness, also when a test loads this file by path
    sys.path.append(str(Path(__file__).resolve().parent))

from _harness import (
    Column,
    fixed_batch,
    inference_step,
    interleaved_ms,
    print_and_write,
    quiet_trainer,
    table,
    train_step,
)

DEFAULT_OUT = Path(__file__).parent / "results" / "channels_last.json"


def _settings(quick: bool) -> dict[str, Any]:
    if quick:
        cases = [("resnet", "train", 8), ("flat_head", "train", 8), ("mlp", "train", 8)]
        return {"rounds": 1, "repeats": 2, "cases": cases, "fit_crop": 16, "fit_batch": 4}
    cases = [
        ("resnet", "train", 32),
        ("resnet", "train", 128),
        ("resnet", "inference", 256),
        ("flat_head", "train", 32),
        ("mlp", "train", 32),
    ]
    return {"rounds": 5, "repeats": 10, "cases": cases, "fit_crop": 56, "fit_batch": 32}


def _model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "resnet":
        return DemoResNet(width=16)
    if kind == "flat_head":
        return FlatHeadNet(crop_size=56)
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 56 * 56, 256), nn.ReLU(), nn.Linear(256, 10))


def _step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, mode: str) -> Any:
    return inference_step(model, x) if mode == "inference" else train_step(model, x, y)


def measure(kind: str, mode: str, batch_size: int, rounds: int, repeats: int) -> dict[str, Any]:
    """Median ms per step in each layout over interleaved rounds, and the NCHW / NHWC ratio."""
    x, y = fixed_batch(batch_size, 56)
    nchw = _model(kind)
    nhwc = copy.deepcopy(nchw)
    converted = to_channels_last(nhwc)
    runs = {"nchw": _step(nchw, x, y, mode), "nhwc": _step(nhwc, x, y, mode)}
    ms = interleaved_ms(runs, rounds, repeats)
    return {
        "model": kind,
        "mode": mode,
        "batch_size": batch_size,
        "tensors_converted": converted,
        "nchw_ms": ms["nchw"],
        "nhwc_ms": ms["nhwc"],
        "speedup": ms["nchw"] / ms["nhwc"],
        "nhwc_samples_per_s": 1e3 * batch_size / ms["nhwc"],
    }


def decide(architecture: str, crop: int, batch: int, steps: int = 200) -> dict[str, Any]:
    """What ``ChannelsLast()`` keeps for a model in a real fit of ``steps`` batches (long enough for its probe)."""
    L.seed_everything(0, verbose=False)
    x, y = fixed_batch(steps * batch, crop)
    callback = ChannelsLast()
    trainer = quiet_trainer(max_epochs=1, callbacks=[callback])
    model = DemoClassifier(width=16 if architecture == "resnet" else 8, crop_size=crop, architecture=architecture)
    trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=batch, shuffle=True))
    report = callback.report()
    return {"model": architecture, "batch_size": batch, "crop": crop, **report}


def run(quick: bool = False, out: str | Path = DEFAULT_OUT) -> dict[str, Any]:
    """Measure every case, print the table and write the JSON."""
    s = _settings(quick)
    rows = [measure(kind, mode, bs, s["rounds"], s["repeats"]) for kind, mode, bs in s["cases"]]
    result: dict[str, Any] = {
        "settings": {"quick": quick, "rounds": s["rounds"], "torch_threads": torch.get_num_threads()}
    }
    result["rows"] = rows
    result["decisions"] = [decide(kind, s["fit_crop"], s["fit_batch"]) for kind in ("resnet", "flat_head")]
    print_and_write(format_table(result), result, out)
    return result


def format_table(result: dict[str, Any]) -> str:
    """The rows as a fixed-width text table."""
    columns = [
        Column("model", 10, "model", align="<"),
        Column("mode", 11, "mode", align="<"),
        Column("batch", 6, "batch_size"),
        Column("NCHW ms", 10, "nchw_ms", ".2f"),
        Column("NHWC ms", 10, "nhwc_ms", ".2f"),
        Column("speed-up", 10, "speedup", ".2f", suffix="x"),
        Column("samples/s", 11, "nhwc_samples_per_s", ".0f"),
    ]
    lines = [table(columns, result["rows"])]
    lines.append("\nwhat ChannelsLast() decided in a real fit (its own probe):")
    for d in result.get("decisions", []):
        ms = d.get("step_ms") or {}
        shown = ", ".join(f"{k} {v:.2f} ms" for k, v in ms.items() if v is not None) or "not probed"
        lines.append(f"  {d['model']:<10} kept {d.get('decision', '?'):<14} ({shown}): {d.get('reason', '')}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tiny run for smoke tests")
    parser.add_argument("--out", default=str(DEFAULT_OUT), help="where to write the JSON results")
    args = parser.parse_args(argv)
    return run(quick=args.quick, out=args.out)


if __name__ == "__main__":
    main()
