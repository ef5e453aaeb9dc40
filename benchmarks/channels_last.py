"""ChannelsLast: training-step and inference time of the same model in the default (NCHW) and channels-last layout.

For the demo ResNet (width 16, 56 px crops) at the batch sizes the demo and a throughput search use, and for an MLP
as the control (no convolutions: `ChannelsLast` leaves it alone, the ratio must be ~1). Both layouts start from the
same weights and see the same batch; rounds are interleaved (NCHW, NHWC, NCHW, ...) so drift on a shared machine
hits both alike. The figure is the median step time over all rounds, and the speed-up is NCHW time / NHWC time.

    python benchmarks/channels_last.py            # about a minute on 2 CPU cores
    python benchmarks/channels_last.py --quick    # seconds: a smoke run for the tests
"""

from __future__ import annotations

import argparse
import copy
import statistics
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_speedkit.demo import DemoResNet
from lightning_speedkit.layout import to_channels_last
from lightning_speedkit.report import write_json_atomic
from lightning_speedkit.timing import median_ms

DEFAULT_OUT = Path(__file__).parent / "results" / "channels_last.json"


def _settings(quick: bool) -> dict[str, Any]:
    if quick:
        return {"rounds": 1, "repeats": 2, "cases": [("resnet", "train", 8), ("mlp", "train", 8)]}
    cases = [("resnet", "train", 32), ("resnet", "train", 128), ("resnet", "inference", 256), ("mlp", "train", 32)]
    return {"rounds": 5, "repeats": 10, "cases": cases}


def _model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "resnet":
        return DemoResNet(width=16)
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 56 * 56, 256), nn.ReLU(), nn.Linear(256, 10))


def _step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, mode: str) -> Any:
    if mode == "inference":
        model.eval()

        def infer() -> None:
            with torch.inference_mode():
                model(x)

        return infer
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def train() -> None:
        loss = nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    return train


def measure(kind: str, mode: str, batch_size: int, rounds: int, repeats: int) -> dict[str, Any]:
    """Median ms per step in each layout over interleaved rounds, and the NCHW / NHWC ratio."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(batch_size, 3, 56, 56, generator=generator)
    y = torch.randint(0, 10, (batch_size,), generator=generator)
    nchw = _model(kind)
    nhwc = copy.deepcopy(nchw)
    converted = to_channels_last(nhwc)
    runs = {"nchw": _step(nchw, x, y, mode), "nhwc": _step(nhwc, x, y, mode)}
    times: dict[str, list[float]] = {"nchw": [], "nhwc": []}
    for _ in range(rounds):
        for layout, run in runs.items():
            times[layout].append(median_ms(run, repeats=repeats))
    ms = {layout: statistics.median(values) for layout, values in times.items()}
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


def run(quick: bool = False, out: str | Path = DEFAULT_OUT) -> dict[str, Any]:
    """Measure every case, print the table and write the JSON."""
    s = _settings(quick)
    rows = [measure(kind, mode, bs, s["rounds"], s["repeats"]) for kind, mode, bs in s["cases"]]
    result = {"settings": {"quick": quick, "rounds": s["rounds"], "torch_threads": torch.get_num_threads()}}
    result["rows"] = rows  # type: ignore[assignment]
    print(format_table(result))
    write_json_atomic(result, out)
    print(f"wrote {out}")
    return result


def format_table(result: dict[str, Any]) -> str:
    """The rows as a fixed-width text table."""
    lines = [f"{'model':<8}{'mode':<11}{'batch':>6}{'NCHW ms':>10}{'NHWC ms':>10}{'speed-up':>10}{'samples/s':>11}"]
    for r in result["rows"]:
        lines.append(
            f"{r['model']:<8}{r['mode']:<11}{r['batch_size']:>6}{r['nchw_ms']:>10.2f}{r['nhwc_ms']:>10.2f}"
            f"{r['speedup']:>9.2f}x{r['nhwc_samples_per_s']:>11.0f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tiny run for smoke tests")
    parser.add_argument("--out", default=str(DEFAULT_OUT), help="where to write the JSON results")
    args = parser.parse_args(argv)
    return run(quick=args.quick, out=args.out)


if __name__ == "__main__":
    main()
