"""An INT8 export's report as flat ``speedkit/int8/...`` metrics and as one line for people."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["int8_metrics", "summary_line"]


def int8_metrics(report: Mapping[str, Any]) -> dict[str, float]:
    """The numbers of an `export_int8` report as flat ``speedkit/int8/...`` metrics (missing values left out).

    Example:
        >>> int8_metrics({"fp32_bytes": 4_000_000, "int8_bytes": 1_000_000, "size_ratio": 4.0})
        {'speedkit/int8/fp32_mb': 4.0, 'speedkit/int8/int8_mb': 1.0, 'speedkit/int8/size_ratio': 4.0}
    """
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


def summary_line(report: Mapping[str, Any]) -> str:
    """One line on an export: where it went, how much smaller, the agreement, the metric and any FP32 layers.

    Example:
        >>> summary_line({"int8_path": "m.onnx", "size_ratio": 3.9, "verification": None, "metric_drop": None,
        ...               "weights": "final weights"})
        'wrote m.onnx (3.90x smaller than FP32) from the final weights'
    """
    verification = report["verification"] or {}
    parts = [f"wrote {report['int8_path']} ({report['size_ratio']:.2f}x smaller than FP32"]
    if verification.get("top1_agreement") is not None:
        parts.append(f"top-1 agreement {verification['top1_agreement']:.4f}")
    if report["metric_drop"] is not None:
        parts.append(f"{verification['metric']} {verification['metric_int8']:.4f} vs {verification['metric_fp32']:.4f}")
    kept = (report.get("accuracy_aware") or {}).get("fp32_layers")
    if kept:
        parts.append(f"{len(kept)} layer(s) kept in FP32: {', '.join(k['layer'] or k['node'] for k in kept)}")
    return ", ".join(parts) + f") from the {report.get('weights', 'model')}"
