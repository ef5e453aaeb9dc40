"""INT8 ONNX (Int8Export) vs FP32 ONNX vs eager torch FP32 on four workloads, in one run.

Workloads: ``conv`` (the demo ResNet), ``linear`` (a Linear-heavy head), ``depthwise`` (a MobileNetV3-style net of
inverted residuals with depthwise convolutions, squeeze-excitation and hard-swish, the kind whose plain INT8 loses
the most) and ``encoder`` (a small two-input BERT-style encoder, ``input_ids`` and ``attention_mask``, on a
synthetic token task, exported with ``inputs_from_batch``). Each is trained briefly with Lightning, with
`Int8Export` attached (``max_metric_drop=0.005``, so accuracy-aware mode keeps the most sensitive layers in FP32 when
plain INT8 loses more): at the end of fit it exports FP32 and static QDQ INT8 ONNX models calibrated on validation
batches and compares them on the validation set. The script then times all three (eager torch FP32, ORT FP32, ORT
INT8) at batch 1 and a larger batch, with 1 thread and with all threads (median of repeated runs, contender after
contender). Ratios are against ORT FP32 of the same run (size, speedup) and against eager torch (speedup).

    python benchmarks/int8.py            # 2000 images / sequences, 8 epochs per workload (minutes on 2 CPU cores)
    python benchmarks/int8.py --quick    # seconds: a smoke run for the tests
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import lightning as L
import numpy as np
import onnxruntime as ort
import torch
from torch import nn
from typing_extensions import override

from lightning_speedkit.batch import forward_example
from lightning_speedkit.demo import DemoClassifier, DemoDataModule
from lightning_speedkit.int8 import Int8Export
from lightning_speedkit.int8.steps import ort_session
from lightning_speedkit.report import write_json_atomic
from lightning_speedkit.warmup import WarmupScheduler

DEFAULT_OUT = Path(__file__).parent / "results" / "int8.json"


def _sibling(name: str) -> ModuleType:
    """Another benchmark script of this directory as a module (the text encoder is shared with the pruning one)."""
    if f"benchmark_{name}" not in sys.modules:
        spec = importlib.util.spec_from_file_location(f"benchmark_{name}", Path(__file__).with_name(f"{name}.py"))
        assert spec is not None
        assert spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    return sys.modules[f"benchmark_{name}"]


def _settings(quick: bool) -> dict[str, Any]:
    if quick:
        return {
            "num_images": 200,
            "epochs": 1,
            "train_batches": 3,
            "width": 8,
            "blocks": 1,
            "hidden": 128,
            "batch": 16,
            "repeats": 2,
            "text_samples": 128,
            "max_metric_drop": 0.005,
        }
    return {
        "num_images": 2000,
        "epochs": 8,
        "train_batches": None,
        "width": 32,
        "blocks": 2,
        "hidden": 1024,
        "batch": 32,
        "repeats": 20,
        "text_samples": 2000,
        "max_metric_drop": 0.005,
    }


class MlpClassifier(DemoClassifier):
    """The demo classifier with a Linear-heavy head: the last feature map flattened into two ``hidden``-unit layers.

    VGG-style: the Linear layers hold most of the weights (96% at width 16, hidden 1024).
    """

    def __init__(self, hidden: int = 1024, width: int = 16, crop_size: int = 56, lr: float = 1e-3) -> None:
        super().__init__(width=width, lr=lr, crop_size=crop_size)
        side = -(-crop_size // 8)  # the stem and two stages halve the side
        self.model.pool = nn.Identity()
        self.model.classifier = nn.Sequential(
            nn.Linear(4 * width * side * side, hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Linear(hidden, 10),
        )


class SqueezeExcite(nn.Module):
    """MobileNetV3's squeeze-excitation: pooled, squeezed 4x, hard-sigmoid gate per channel."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.reduce, self.expand = nn.Conv2d(channels, channels // 4, 1), nn.Conv2d(channels // 4, channels, 1)

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = nn.functional.hardsigmoid(self.expand(torch.relu(self.reduce(x.mean((2, 3), keepdim=True)))))
        return x * gate


class InvertedResidual(nn.Module):
    """1x1 expansion, 3x3 depthwise, squeeze-excitation, 1x1 projection; hard-swish; a residual when shapes match."""

    def __init__(self, cin: int, expand: int, cout: int, stride: int) -> None:
        super().__init__()
        self.block = nn.Sequential(
            nn.Conv2d(cin, expand, 1, bias=False),
            nn.BatchNorm2d(expand),
            nn.Hardswish(),
            nn.Conv2d(expand, expand, 3, stride, 1, groups=expand, bias=False),
            nn.BatchNorm2d(expand),
            nn.Hardswish(),
            SqueezeExcite(expand),
            nn.Conv2d(expand, cout, 1, bias=False),
            nn.BatchNorm2d(cout),
        )
        self.residual = stride == 1 and cin == cout

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.block(x)
        return x + out if self.residual else out  # type: ignore[no-any-return]


class DepthwiseNet(nn.Module):
    """A MobileNetV3-small-like net: a stride-2 stem, six inverted residuals (16 -> 48 channels), a 1x1 head."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        w = width
        self.features = nn.Sequential(
            nn.Conv2d(3, w, 3, 2, 1, bias=False),
            nn.BatchNorm2d(w),
            nn.Hardswish(),
            InvertedResidual(w, 4 * w, w, 1),
            InvertedResidual(w, 4 * w, 2 * w, 2),
            InvertedResidual(2 * w, 6 * w, 2 * w, 1),
            InvertedResidual(2 * w, 6 * w, 3 * w, 2),
            InvertedResidual(3 * w, 6 * w, 3 * w, 1),
            InvertedResidual(3 * w, 6 * w, 3 * w, 1),
            nn.Conv2d(3 * w, 8 * w, 1, bias=False),
            nn.BatchNorm2d(8 * w),
            nn.Hardswish(),
        )
        self.classifier = nn.Sequential(nn.Linear(8 * w, 16 * w), nn.Hardswish(), nn.Linear(16 * w, 10))

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x).mean((2, 3)))  # type: ignore[no-any-return]


class DepthwiseClassifier(DemoClassifier):
    """The demo classifier (data, loss, metric, AdamW) with the MobileNetV3-style `DepthwiseNet`."""

    def __init__(self, width: int = 16, crop_size: int = 56, lr: float = 2e-3) -> None:
        super().__init__(width=width, lr=lr, crop_size=crop_size)
        self.model = DepthwiseNet(width)


def _eager_run(model: nn.Module, x: Any) -> Callable[[], None]:
    def run() -> None:
        with torch.inference_mode():
            forward_example(model, x)

    return run


def _timings(runners: dict[str, Callable[[], None]], repeats: int) -> dict[str, float]:
    """Median ms of each runner over ``repeats`` runs after 3 warm-up runs, one runner after the other.

    Not interleaved run by run: ORT's and torch's thread pools spin-wait after each run, and on a small machine
    the idle pool of one starves the other (eager torch at 2 threads measured 400 ms instead of 5 ms).
    """
    result = {}
    for name, run in runners.items():
        times = []
        for index in range(repeats + 3):
            start = time.perf_counter()
            run()
            if index >= 3:
                times.append((time.perf_counter() - start) * 1000.0)
        result[name] = statistics.median(times)
    return result


def _eager_accuracy(model: nn.Module, loader: Any) -> float:
    correct = total = 0
    with torch.inference_mode():
        for *x, y in loader:
            correct += int((model(*x).argmax(1) == y).sum())
            total += len(y)
    return correct / total


def _text_inputs(batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)`` of an ``(input_ids, attention_mask, label)`` batch."""
    return batch[0], batch[1]


def _workload(name: str, model: L.LightningModule, dm: Any, s: dict[str, Any], out: Path) -> dict[str, Any]:
    text = name == "encoder"
    export = Int8Export(
        out / name,
        calibration_batches=16,
        latency_repeats=s["repeats"],  # the report's own latency, and what layers kept in FP32 cost
        max_metric_drop=s["max_metric_drop"],
        inputs_from_batch=_text_inputs if text else None,
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=s["epochs"],
        limit_train_batches=s["train_batches"],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=out,
        callbacks=[WarmupScheduler(warmup=0.05), export],  # warmup + cosine: both nets train reliably at LR 1e-3
    )
    trainer.fit(model, datamodule=dm)
    report = export.report()
    if not report["exported"]:
        raise RuntimeError(f"Int8Export wrote no report for {name}")
    model.eval()
    loader = model.val_dataloader() if text else dm.val_dataloader()
    first = next(iter(loader))
    sample = [t[:1] for t in _text_inputs(first)] if text else [first[0][:1]]
    all_threads = os.cpu_count() or 1
    latency: dict[str, dict[str, float]] = {}
    previous = torch.get_num_threads()
    try:
        for threads in sorted({1, all_threads}):
            torch.set_num_threads(threads)  # once per setting: switching per call rebuilds the thread pool
            sessions = {k: ort_session(ort, Path(report[f"{k}_path"]), threads) for k in ("fp32", "int8")}
            for batch in (1, s["batch"]):
                x = [t.expand(batch, *t.shape[1:]).contiguous() for t in sample]
                feed = {n: t.numpy() for n, t in zip(report["input_names"], x, strict=True)}
                runners: dict[str, Callable[[], None]] = {
                    f"ort_{k}": (lambda sess=sess, feed=feed: sess.run(None, feed)) for k, sess in sessions.items()
                }
                runners["eager_fp32"] = _eager_run(model, tuple(x))
                latency[f"t{threads}_b{batch}"] = _timings(runners, s["repeats"])
    finally:
        torch.set_num_threads(previous)
    verification = report["verification"]
    aware = report["accuracy_aware"]
    return {
        "workload": name,
        "input_names": report["input_names"],
        "dynamic_axes": report["dynamic_axes"],
        "params": sum(p.numel() for p in model.parameters()),
        "fp32_mb": report["fp32_bytes"] / 1e6,
        "int8_mb": report["int8_bytes"] / 1e6,
        "size_ratio": report["size_ratio"],
        "val_acc_eager": _eager_accuracy(model, loader),
        "val_acc_fp32": verification["metric_fp32"],
        "val_acc_int8": verification["metric_int8"],
        "acc_delta_points": 100.0 * (verification["metric_int8"] - verification["metric_fp32"]),
        "top1_agreement": verification["top1_agreement"],
        "relative_error": verification["relative_error"],
        "all_int8": None if aware is None else aware["all_int8"],
        "fp32_layers": None
        if aware is None
        else [f"{k['layer'] or k['node']} ({k['op']})" for k in aware["fp32_layers"]],
        "fp32_tensors": None if aware is None else aware["fp32_tensors"],
        "fp32_layers_cost": None if aware is None else aware["cost"],
        "passed": report["passed"],
        "latency_ms": latency,
        "speedup_vs_ort_fp32": {k: v["ort_fp32"] / v["ort_int8"] for k, v in latency.items()},
        "speedup_vs_eager": {k: v["eager_fp32"] / v["ort_int8"] for k, v in latency.items()},
    }


def format_table(results: dict[str, Any]) -> str:
    """A plain-text table of the results."""
    lines = []
    for row in results["rows"]:
        lines.append(
            f"{row['workload']}: {row['params']:,} params, FP32 {row['fp32_mb']:.2f} MB -> INT8 {row['int8_mb']:.2f} MB"
            f" ({row['size_ratio']:.2f}x smaller); val acc eager {row['val_acc_eager']:.4f}, ORT FP32"
            f" {row['val_acc_fp32']:.4f}, ORT INT8 {row['val_acc_int8']:.4f}"
            f" (INT8 - FP32: {row['acc_delta_points']:+.2f} points), top-1 agreement {row['top1_agreement']:.4f}"
        )
        if row["fp32_layers"] is not None:
            cost, first = row["fp32_layers_cost"], row["all_int8"]
            latency = "n/a" if cost["latency_ms_b1"] is None else f"{cost['latency_ms_b1']:+.3f} ms at batch 1"
            lines.append(
                f"  accuracy-aware: all-INT8 agreement {first['top1_agreement']:.4f}, metric drop"
                f" {first['metric_drop']:.4f}; kept in FP32: {', '.join(row['fp32_layers']) or 'none'}"
                f" ({cost['int8_bytes'] / 1e3:+.1f} KB, {latency}){'' if row['passed'] else '; budget missed'}"
            )
        lines.append(
            f"  {'threads/batch':<14}{'eager FP32':>12}{'ORT FP32':>12}{'ORT INT8':>12}{'vs ORT':>9}{'vs eager':>10}"
        )
        for key, ms in row["latency_ms"].items():
            lines.append(
                f"  {key:<14}{ms['eager_fp32']:>10.3f}ms{ms['ort_fp32']:>10.3f}ms{ms['ort_int8']:>10.3f}ms"
                f"{row['speedup_vs_ort_fp32'][key]:>8.2f}x{row['speedup_vs_eager'][key]:>9.2f}x"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="a small, fast run (for the tests)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"JSON output (default {DEFAULT_OUT})")
    parser.add_argument("--cache-dir", default=None, help="where the demo images are generated")
    args = parser.parse_args(argv)
    s = _settings(args.quick)
    L.seed_everything(0, verbose=False)
    dm = DemoDataModule(num_images=s["num_images"], batch_size=s["batch"], root=args.cache_dir)
    dm.prepare_data()
    rows = []
    with tempfile.TemporaryDirectory(prefix="speedkit-int8-") as tmp:
        conv = DemoClassifier(width=s["width"], blocks_per_stage=s["blocks"], crop_size=dm.crop_size)
        rows.append(_workload("conv", conv, dm, s, Path(tmp)))
        linear = MlpClassifier(s["hidden"], 16, dm.crop_size)
        rows.append(_workload("linear", linear, dm, s, Path(tmp)))
        depthwise = DepthwiseClassifier(16, dm.crop_size)
        rows.append(_workload("depthwise", depthwise, dm, s, Path(tmp)))
        encoder = _sibling("pruning").TextClassifier(s["text_samples"], s["batch"])
        rows.append(_workload("encoder", encoder, None, s, Path(tmp)))
    results = {
        "settings": s | {"quick": args.quick},
        "machine": {
            "cpu_count": os.cpu_count(),
            "torch": torch.__version__,
            "onnxruntime": ort.__version__,
            "numpy": np.__version__,
        },
        "rows": rows,
    }
    print(format_table(results))
    write_json_atomic(results, args.out)
    print(f"wrote {args.out}")
    return results


if __name__ == "__main__":
    main()
