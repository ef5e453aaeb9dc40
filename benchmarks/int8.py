"""INT8 ONNX (`export_int8`) vs FP32 ONNX on conv, depthwise and two-input nets: this CPU and a forced AVX2 ISA.

Workloads: ``conv`` (the demo ResNet), ``depthwise`` (a MobileNetV3-style net of inverted residuals with depthwise
convolutions, squeeze-excitation and hard-swish) and ``encoder`` (a small two-input BERT-style encoder, ``input_ids``
and ``attention_mask``, on a synthetic token task). Each is trained once with Lightning (seeded), then exported in two
passes, each in a process of its own:

- ``native``: this CPU as it is;
- ``avx2``: under ``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2``, what an AVX2-only user gets:
  `lightning_speedkit.hardware.cpu_info` hides AVX-512, VNNI and bf16, so the INT8 format is chosen for an AVX2 CPU.
  ONNX Runtime has no such switch (its kernels follow cpuid): on an AVX2 machine the two passes run the same kernels.

Each pass runs `export_int8` with ``min_agreement=0.97`` and ``max_metric_drop=0.005`` (accuracy-aware mode keeps the
most sensitive layers in FP32 where plain INT8 falls short), calibrated on 16 validation batches and verified on the
whole validation set; it records `cpu_info` (model, flags, ``isa_limit``) and the load average (the machine may be
shared), and times ORT FP32 and INT8 at 1 thread (batch 1 and ``batch``) and all threads (``batch``): the median of
interleaved rounds (`_harness.interleaved_ms`). The native pass also compares the five INT8 formats on each workload
(``formats``): U8S8, U8S8+reduce_range, S8S8, S8S8+reduce_range and U8U8, each plainly quantized (for the encoder,
with the nodes its native row kept in FP32 left in FP32 for every format, so that only the format differs).

    python benchmarks/int8.py            # 2000 images / sequences, 8 epochs per workload (tens of minutes, 2 cores)
    python benchmarks/int8.py --quick    # a smoke run for the tests
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import onnxruntime as ort
import torch
from torch import nn
from typing_extensions import override

from lightning_speedkit.demo import DemoClassifier, DemoDataModule
from lightning_speedkit.hardware import cpu_info
from lightning_speedkit.int8 import Int8Format, export_int8
from lightning_speedkit.int8.inputs import feeds, named_inputs
from lightning_speedkit.int8.steps import export_onnx, files_of, ort_session, preprocess, quantize_qdq, verify_outputs
from lightning_speedkit.warmup import WarmupScheduler

if str(Path(__file__).resolve().parent) not in sys.path:  # _harness and _models, also when loaded by path
    sys.path.append(str(Path(__file__).resolve().parent))

from _harness import interleaved_ms, print_and_write, quiet_trainer, timed_fit
from _models import TextClassifier

DEFAULT_OUT = Path(__file__).parent / "results" / "int8.json"
WORKLOADS = ("conv", "depthwise", "encoder")
ISA_PASSES: dict[str, dict[str, str]] = {
    "native": {},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
}
FORMATS = {  # name -> (activations, weights, reduce_range)
    "U8S8": ("uint8", "int8", False),
    "U8S8+reduce_range": ("uint8", "int8", True),
    "S8S8": ("int8", "int8", False),
    "S8S8+reduce_range": ("int8", "int8", True),
    "U8U8": ("uint8", "uint8", False),
}


def _settings(quick: bool) -> dict[str, Any]:
    """The workloads' sizes, the batch, the timing rounds and the accuracy budget."""
    full = {"num_images": 2000, "epochs": 8, "train_batches": None, "width": 32, "blocks": 2, "depthwise_width": 16}
    full |= {"text_samples": 2000, "batch": 32, "calibration_batches": 16, "rounds": 5, "runs_per_round": 5}
    full |= {"min_agreement": 0.97, "max_metric_drop": 0.005}
    if not quick:
        return full
    quick_sizes = {"num_images": 200, "epochs": 1, "train_batches": 3, "width": 8, "blocks": 1, "depthwise_width": 8}
    return full | quick_sizes | {"text_samples": 128, "batch": 16, "calibration_batches": 2, "rounds": 1}


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


def _model(name: str, s: dict[str, Any], crop_size: int) -> L.LightningModule:
    L.seed_everything(0, verbose=False)
    if name == "conv":
        return DemoClassifier(width=s["width"], blocks_per_stage=s["blocks"], crop_size=crop_size)
    if name == "depthwise":
        return DepthwiseClassifier(s["depthwise_width"], crop_size)
    return TextClassifier(s["text_samples"], s["batch"])


def _text_inputs(batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)`` of an ``(input_ids, attention_mask, label)`` batch."""
    return batch[0], batch[1]


def _train(name: str, model: L.LightningModule, dm: DemoDataModule, s: dict[str, Any], root: Path) -> float:
    """Fit ``model`` (warmup + cosine) and return the seconds it took."""
    trainer = quiet_trainer(
        max_epochs=s["epochs"],
        limit_train_batches=s["train_batches"],
        num_sanity_val_steps=0,
        default_root_dir=root,
        callbacks=[WarmupScheduler(warmup=0.05, decay="cosine")],  # as int8.json was measured
    )
    return timed_fit(trainer, model, None if name == "encoder" else dm).seconds


def _timings(sessions: dict[str, Any], feed: dict[str, np.ndarray], s: dict[str, Any]) -> dict[str, float]:
    """Median ms per session over interleaved rounds (each: the median of ``runs_per_round`` runs after a warm-up)."""
    runs = {name: (lambda session=session: session.run(None, feed)) for name, session in sessions.items()}
    return interleaved_ms(runs, s["rounds"], s["runs_per_round"], warmup=1)


def _latency(paths: dict[str, str], sample: dict[str, np.ndarray], c: dict[str, Any]) -> dict[str, dict[str, float]]:
    """ORT FP32 and INT8 latency at 1 thread (batch 1 and ``batch``) and all threads (``batch``)."""
    result = {}
    for threads, batch in ((1, 1), (1, c["batch"]), (os.cpu_count() or 1, c["batch"])):
        sessions = {f"ort_{k}": ort_session(ort, Path(p), threads) for k, p in paths.items()}
        feed = {k: np.ascontiguousarray(np.repeat(v[:1], batch, axis=0)) for k, v in sample.items()}
        result[f"t{threads}_b{batch}"] = _timings(sessions, feed, c)
    return result


def _row(name: str, model: L.LightningModule, loader: Any, c: dict[str, Any], out: Path) -> dict[str, Any]:
    text = name == "encoder"
    report = export_int8(
        model,
        loader,
        out / name / "model.onnx",
        inputs_from_batch=_text_inputs if text else None,
        calibration_batches=c["calibration_batches"],
        validation_data=loader,
        metric=None if text else model.val_acc,
        min_agreement=c["min_agreement"],
        max_metric_drop=c["max_metric_drop"],
        latency_repeats=0,  # timed below, interleaved
        overwrite=True,
    )
    v, q, aware = report["verification"], report["quantization"], report["accuracy_aware"]
    kept = [] if aware is None else aware["fp32_layers"]
    sample = next(feeds(model, loader, _example(model, loader, text), _text_inputs if text else None))[0]
    latency = _latency({"fp32": report["fp32_path"], "int8": report["int8_path"]}, sample, c)
    return {
        "workload": name,
        "input_names": report["input_names"],
        "params": sum(p.numel() for p in model.parameters()),
        "int8_format": q["int8_format"],
        "reduce_range": q["reduce_range"],
        "format_reason": q["format_reason"],
        "symbolic_shape_inference": report["preprocess"]["symbolic_shape_inference"],
        "fp32_layers": [f"{k['layer'] or k['node']} ({k['op']})" for k in kept],
        "fp32_nodes": [k["node"] for k in kept],
        "fp32_layers_cost": None if aware is None else aware["cost"],
        "all_int8": None if aware is None else aware["all_int8"],
        "top1_agreement": v["top1_agreement"],
        "val_acc_fp32": v["metric_fp32"],
        "val_acc_int8": v["metric_int8"],
        "acc_delta_points": 100.0 * (v["metric_int8"] - v["metric_fp32"]),
        "relative_error": v["relative_error"],
        "val_samples": v["samples"],
        "fp32_mb": report["fp32_bytes"] / 1e6,
        "int8_mb": report["int8_bytes"] / 1e6,
        "size_ratio": report["size_ratio"],
        "passed": report["passed"],
        "status": report["status"],
        "latency_ms": latency,
        "speedup": {k: t["ort_fp32"] / t["ort_int8"] for k, t in latency.items()},
    }


def _example(model: nn.Module, loader: Any, text: bool) -> dict[str, torch.Tensor]:
    first = next(iter(loader))
    return named_inputs(model, _text_inputs(first) if text else first[0])


def _formats(
    name: str, model: L.LightningModule, loader: Any, row: dict[str, Any], c: dict[str, Any], out: Path
) -> Any:
    """Agreement, latency and size of each of `FORMATS` for one workload (see the module docstring)."""
    text = name == "encoder"
    example = _example(model, loader, text)
    pairs = list(feeds(model, loader, example, _text_inputs if text else None))
    calibration = [feed for feed, _ in pairs[: c["calibration_batches"]]]
    directory = out / "formats" / name
    directory.mkdir(parents=True)
    fp32, pre = directory / "fp32.onnx", directory / "pre.onnx"
    model.eval()
    with torch.no_grad():
        export_onnx(model, example, fp32)
    preprocess(fp32, pre)
    excluded = row["fp32_nodes"] if text else []
    fp32_session = ort_session(ort, fp32, 1)
    outputs: list[np.ndarray] = []
    result: dict[str, Any] = {"nodes_kept_in_fp32": excluded}
    for fmt, (activations, weights, reduce_range) in FORMATS.items():
        path = directory / f"{fmt}.onnx"
        quantize_qdq(pre, path, calibration, Int8Format(activations, weights, reduce_range, ""), False, excluded)
        v = verify_outputs((fp32_session, ort_session(ort, path, 1)), pairs, fp32_outputs=outputs)
        result[fmt] = {
            "top1_agreement": v["top1_agreement"],
            "relative_error": v["relative_error"],
            "int8_mb": sum(p.stat().st_size for p in files_of(path)) / 1e6,
        }
    for batch in (1, c["batch"]):
        feed = {k: np.ascontiguousarray(np.repeat(v[:1], batch, axis=0)) for k, v in calibration[0].items()}
        sessions = {"FP32": fp32_session} | {fmt: ort_session(ort, directory / f"{fmt}.onnx", 1) for fmt in FORMATS}
        for fmt, ms in _timings(sessions, feed, c).items():
            result.setdefault(fmt, {})[f"t1_b{batch}_ms"] = ms
    return result


def _run_pass(args: argparse.Namespace) -> dict[str, Any]:
    """One ISA pass in this process: export, verify and time every workload from the saved weights."""
    s = c = _settings(args.quick)
    dm = DemoDataModule(num_images=s["num_images"], batch_size=c["batch"], root=args.cache_dir)
    dm.prepare_data()
    dm.setup("fit")
    cpu = cpu_info()
    load_before = os.getloadavg() if hasattr(os, "getloadavg") else None  # the machine may be shared: say how busy
    rows, formats = [], {}
    for name in WORKLOADS:
        model = _model(name, s, dm.crop_size)
        model.load_state_dict(torch.load(Path(args.models) / f"{name}.pt", weights_only=True))
        model.eval()
        loader = model.val_dataloader() if name == "encoder" else dm.val_dataloader()
        rows.append(_row(name, model, loader, c, Path(args.models) / args.isa_pass))
        if args.formats:
            formats[name] = _formats(name, model, loader, rows[-1], c, Path(args.models) / args.isa_pass)
    return {
        "isa_pass": args.isa_pass,
        "environment": ISA_PASSES[args.isa_pass],
        "cpu": {
            "model": cpu.model,
            "flags": list(cpu.flags),
            "isa_limit": cpu.isa_limit,
            "torch": cpu.torch_capability,
        },
        "rows": rows,
        "formats": formats or None,
        "load_average": {"before": load_before, "after": os.getloadavg() if hasattr(os, "getloadavg") else None},
    }


def format_table(results: dict[str, Any]) -> str:
    """A plain-text table of the results: one block per ISA pass, then the formats comparison."""
    lines = []
    for run in results["runs"]:
        cpu = run["cpu"]
        lines.append(f"[{run['isa_pass']}] {cpu['model']}, flags {' '.join(cpu['flags']) or '-'}, {cpu['isa_limit']}")
        for row in run["rows"]:
            lat = row["latency_ms"]
            t1b1, t1b, tnb = (lat[k] for k in lat)
            kept = ", ".join(row["fp32_layers"]) or "none"
            lines.append(
                f"  {row['workload']}: {row['int8_format']}, agreement {row['top1_agreement']:.4f}, val acc"
                f" {row['val_acc_fp32']:.4f} -> {row['val_acc_int8']:.4f}, {row['fp32_mb']:.2f} -> {row['int8_mb']:.2f}"
                f" MB, ORT ms FP32/INT8 {t1b1['ort_fp32']:.2f}/{t1b1['ort_int8']:.2f} (1 thread b1),"
                f" {t1b['ort_fp32']:.1f}/{t1b['ort_int8']:.1f} (1 thread b{results['settings']['batch']}),"
                f" {tnb['ort_fp32']:.1f}/{tnb['ort_int8']:.1f} (all threads); FP32 kept: {kept};"
                f" {'passed' if row['passed'] else 'FAILED'}"
            )
        for name, table in (run["formats"] or {}).items():
            lines.append(f"  formats, {name}:")
            batch = results["settings"]["batch"]
            for fmt in ("FP32", *FORMATS):
                entry = table[fmt]
                agreement = "" if fmt == "FP32" else f"agreement {entry['top1_agreement']:.4f}, "
                lines.append(
                    f"    {fmt:<18} {agreement}1 thread b1 {entry['t1_b1_ms']:.2f} ms, b{batch}"
                    f" {entry[f't1_b{batch}_ms']:.1f} ms"
                )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="a small, fast run (for the tests)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"JSON output (default {DEFAULT_OUT})")
    parser.add_argument("--cache-dir", default=None, help="where the demo images are generated")
    parser.add_argument("--isa-pass", choices=tuple(ISA_PASSES), help=argparse.SUPPRESS)  # internal: one pass
    parser.add_argument("--models", help=argparse.SUPPRESS)
    parser.add_argument("--formats", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.isa_pass:
        part = _run_pass(args)
        args.out.write_text(json.dumps(part))
        return part
    s = c = _settings(args.quick)
    dm = DemoDataModule(num_images=s["num_images"], batch_size=c["batch"], root=args.cache_dir)
    dm.prepare_data()
    runs, train_s = [], {}
    with tempfile.TemporaryDirectory(prefix="speedkit-int8-") as tmp:
        for name in WORKLOADS:
            model = _model(name, s, dm.crop_size)
            train_s[name] = _train(name, model, dm, s, Path(tmp))
            torch.save(model.state_dict(), Path(tmp) / f"{name}.pt")
        for isa_pass, environment in ISA_PASSES.items():
            part = Path(tmp) / f"{isa_pass}.json"
            command = [sys.executable, __file__, "--isa-pass", isa_pass, "--models", tmp, "--out", str(part)]
            command += ["--quick"] * args.quick + ["--formats"] * (isa_pass == "native")
            command += ["--cache-dir", args.cache_dir] if args.cache_dir else []
            subprocess.run(command, env=os.environ | environment, check=True)
            runs.append(json.loads(part.read_text()))
    results = {
        "settings": s | {"quick": args.quick},
        "machine": {
            "cpu_count": os.cpu_count(),
            "machine": platform.machine(),
            "torch": torch.__version__,
            "onnxruntime": ort.__version__,
            "numpy": np.__version__,
        },
        "train_s": train_s,
        "runs": runs,
    }
    print_and_write(format_table(results), results, args.out)
    return results


if __name__ == "__main__":
    main()
