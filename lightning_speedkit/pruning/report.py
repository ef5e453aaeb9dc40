"""`StructuredPruning`'s report as flat metrics: what it logs under ``speedkit/pruning/`` once the fine-tune ends."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["final_metrics"]


def final_metrics(report: Mapping[str, Any], monitor: str | None) -> dict[str, float]:
    """MACs, parameters, CPU latency at each measured batch size and the monitored metric, before and after.

    Example:
        >>> report = {"macs_before": 4e6, "macs_after": 2e6, "params_before": 90, "params_after": 40,
        ...           "latency_ms_before": {1: 2.0}, "latency_ms_after": {1: 1.0}, "metric_before": 0.8}
        >>> metrics = final_metrics(report, "val_acc")
        >>> metrics["macs_speedup"], metrics["latency_speedup_b1"], metrics["val_acc_before"]
        (2.0, 2.0, 0.8)
        >>> "val_acc_after" in metrics
        False
    """
    metrics = {
        "macs_before": float(report["macs_before"]),
        "macs_after": float(report["macs_after"]),
        "macs_speedup": report["macs_before"] / max(report["macs_after"], 1.0),
        "params_before": float(report["params_before"]),
        "params_after": float(report["params_after"]),
    }
    for batch, ms in (report.get("latency_ms_before") or {}).items():
        after = (report.get("latency_ms_after") or {}).get(batch)
        metrics[f"latency_ms_b{batch}_before"] = ms
        if after is not None:
            metrics[f"latency_ms_b{batch}_after"] = after
            metrics[f"latency_speedup_b{batch}"] = ms / after
    for when in ("before", "after"):
        if report.get(f"metric_{when}") is not None:
            metrics[f"{monitor}_{when}"] = report[f"metric_{when}"]
    return metrics
