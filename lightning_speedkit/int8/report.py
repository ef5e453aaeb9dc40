"""An INT8 export's report as flat ``speedkit/int8/...`` metrics, and in words: its verdict and one summary line."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["drop_message", "int8_metrics", "size_words", "summary_line", "verdict"]


def int8_metrics(report: Mapping[str, Any]) -> dict[str, float]:
    """The numbers of an `export_int8` report as flat ``speedkit/int8/...`` metrics (missing values left out).

    Example:
        >>> int8_metrics({"fp32_bytes": 4_000_000, "int8_bytes": 1_000_000, "size_ratio": 4.0})
        {'speedkit/int8/fp32_mb': 4.0, 'speedkit/int8/int8_mb': 1.0, 'speedkit/int8/size_ratio': 4.0}
    """
    if not isinstance(report, Mapping):
        raise ValueError(f"`report` must be the dict export_int8 returns, got {report!r}.")
    values: dict[str, Any] = {
        "fp32_mb": report["fp32_bytes"] / 1e6,
        "int8_mb": report["int8_bytes"] / 1e6,
        "size_ratio": report["size_ratio"],
    }
    for key, timing in (report.get("latency") or {}).items():
        if key.startswith("batch_"):
            batch = key.removeprefix("batch_")
            values[f"latency_fp32_b{batch}_ms"] = timing["fp32_ms"]
            values[f"latency_int8_b{batch}_ms"] = timing["int8_ms"]
            values[f"speedup_b{batch}"] = timing["speedup"]
    verification = report.get("verification") or {}
    for key in ("max_abs_diff", "top1_agreement", "metric_fp32", "metric_int8"):
        values[key] = verification.get(key)
    values["metric_drop"] = report.get("metric_drop")
    aware = report.get("accuracy_aware") or {}
    if aware:
        values["fp32_layers"] = len(aware["fp32_layers"])
        values["fp32_layers_bytes"] = aware["cost"]["int8_bytes"]
    return {f"speedkit/int8/{k}": float(v) for k, v in values.items() if v is not None}


def drop_message(report: Mapping[str, Any]) -> str:
    """What a missed budget says: the metric (or top-1 agreement) for FP32 and INT8 and the bound it missed.

    Example:
        >>> report = {"verification": {"top1_agreement": 0.914}, "min_agreement": 0.97,
        ...           "accuracy_aware": {"fp32_layers": [{}] * 15, "limit": 20}}
        >>> for part in drop_message(report).split("; "):
        ...     print(part)
        INT8 top-1 agreement with FP32 is 0.9140, less than min_agreement=0.97
        even with 15 layer(s) kept in FP32 (max_fp32_layers=20)
    """
    v = report["verification"]
    drop, limit = report.get("metric_drop"), report.get("max_metric_drop")
    parts = []
    if drop is not None and limit is not None and drop > limit:
        parts.append(
            f"INT8 {v['metric']} is {v['metric_int8']:.4f} vs FP32 {v['metric_fp32']:.4f} on {v['samples']} samples:"
            f" a drop of {drop:.4f}, more than max_metric_drop={limit}"
        )
    agreement, required = v.get("top1_agreement"), report.get("min_agreement")
    if agreement is not None and required is not None and agreement < required:
        parts.append(f"INT8 top-1 agreement with FP32 is {agreement:.4f}, less than min_agreement={required}")
    kept = report.get("accuracy_aware") or {}
    if kept.get("fp32_layers") is not None:
        parts.append(f"even with {len(kept['fp32_layers'])} layer(s) kept in FP32 (max_fp32_layers={kept['limit']})")
    return "; ".join(parts)


def verdict(report: Mapping[str, Any]) -> str:
    """The report's ``status``: ``FAILED: ...`` when the budget was missed, else what was checked, in one line.

    Example:
        >>> verdict({"passed": True, "verification": None})
        'not verified (verify=False): sizes and latency only'
        >>> verdict({"passed": True, "verification": {"top1_agreement": 0.99}, "min_agreement": 0.97})
        'passed: top-1 agreement 0.9900 >= min_agreement=0.97'
    """
    verification = report.get("verification")
    if not report.get("passed", True):
        return (
            f"FAILED: {drop_message(report)}; the model misses its accuracy target: keep more layers in FP32"
            " (max_fp32_layers), calibrate on more batches, or loosen the target"
        )
    if verification is None:
        return "not verified (verify=False): sizes and latency only"
    held = []
    agreement, required = verification.get("top1_agreement"), report.get("min_agreement")
    if agreement is not None and required is not None:
        held.append(f"top-1 agreement {agreement:.4f} >= min_agreement={required}")
    drop, limit = report.get("metric_drop"), report.get("max_metric_drop")
    if drop is not None and limit is not None:
        held.append(f"{verification['metric']} drop {drop:.4f} <= max_metric_drop={limit}")
    if held:
        return "passed: " + ", ".join(held)
    shown = "n/a" if agreement is None else f"{agreement:.4f}"
    return f"compared with FP32 (top-1 agreement {shown}), no accuracy target given"


def size_words(ratio: float) -> str:
    """The INT8 file's size against the FP32 one's (``ratio``: FP32 bytes over INT8 bytes), in words.

    A small model's INT8 file can be the larger: its quantize and dequantize nodes and their scales outweigh the
    weights' fourfold saving.

    Example:
        >>> size_words(3.9), size_words(0.73)
        ('3.90x smaller than FP32', '1.37x larger than FP32')
    """
    return f"{ratio:.2f}x smaller than FP32" if ratio >= 1 else f"{1 / ratio:.2f}x larger than FP32"


def summary_line(report: Mapping[str, Any]) -> str:
    """One line on an export: where it went, how much smaller, the agreement, the metric and any FP32 layers.

    A failed export says so first.

    Example:
        >>> summary_line({"int8_path": "m.onnx", "size_ratio": 3.9, "verification": None, "metric_drop": None,
        ...               "weights": "final weights"})
        'wrote m.onnx (3.90x smaller than FP32) from the final weights'
    """
    verification = report["verification"] or {}
    failed = "" if report.get("passed", True) else "FAILED its accuracy target: "
    parts = [f"{failed}wrote {report['int8_path']} ({size_words(report['size_ratio'])}"]
    if verification.get("top1_agreement") is not None:
        parts.append(f"top-1 agreement {verification['top1_agreement']:.4f}")
    if report["metric_drop"] is not None:
        parts.append(f"{verification['metric']} {verification['metric_int8']:.4f} vs {verification['metric_fp32']:.4f}")
    kept = (report.get("accuracy_aware") or {}).get("fp32_layers")
    if kept:
        parts.append(f"{len(kept)} layer(s) kept in FP32: {', '.join(k['layer'] or k['node'] for k in kept)}")
    return ", ".join(parts) + f") from the {report.get('weights', 'model')}"
