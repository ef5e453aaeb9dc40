"""`StructuredPruning`'s report: its monitored metric checked, the flat metrics logged under ``speedkit/pruning/``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from lightning.pytorch.utilities import rank_zero_warn

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = [
    "DEFAULT_MONITOR",
    "check_monitor_logged",
    "final_metrics",
    "finish_line",
    "nothing_removed",
    "step_line",
    "warn_if_nothing_removed",
    "warn_monitor_not_logged",
]


def _logged(trainer: pl.Trainer) -> str:
    names = sorted(trainer.callback_metrics)
    return ", ".join(map(repr, names)) if names else "nothing"


DEFAULT_MONITOR = "val_loss"
"""The metric reported when none is named: warned about, not an error, when the module does not log it."""


def check_monitor_logged(trainer: pl.Trainer, monitor: str) -> None:
    """Raise a ``ValueError`` naming ``monitor`` and the logged metrics if it is not among them (all ranks agree).

    Called at the end of the first validation of a fit, where a validation metric has been logged if it ever will.
    The default, `DEFAULT_MONITOR`, which the user did not name, is only warned about (`warn_monitor_not_logged`).
    """
    if monitor == DEFAULT_MONITOR:
        warn_monitor_not_logged(trainer, monitor)
        return
    missing = monitor not in trainer.callback_metrics
    if trainer.strategy.reduce_boolean_decision(missing, all=False):
        raise ValueError(
            f"`monitor` must be a metric the LightningModule logs, got {monitor!r}; logged: {_logged(trainer)}."
            " Log it with `self.log`, choose a logged one, or pass monitor=None."
        )


def warn_monitor_not_logged(trainer: pl.Trainer, monitor: str) -> None:
    """Warn (rank zero) that ``monitor`` was never logged, where no validation ran to check it: the report lacks it."""
    if monitor not in trainer.callback_metrics:
        rank_zero_warn(
            f"StructuredPruning: `monitor` {monitor!r} was never logged (no validation ran; logged:"
            f" {_logged(trainer)}): the report has no metric before or after. Pass monitor=None to report none."
        )


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


def nothing_removed(ratio: float, round_to: int | None) -> str:
    """Why a pruning step at ``ratio`` can remove no channel, and what to pass instead.

    Example:
        >>> print(nothing_removed(0.6, 8))  # doctest: +ELLIPSIS
        the step at ratio 0.600 removed no channel: with round_to=8 a layer keeps a multiple of 8 channels ...
    """
    if not round_to:
        return f"the step at ratio {ratio:.3f} removed no channel: every layer it could cut is ignored or left whole"
    return (
        f"the step at ratio {ratio:.3f} removed no channel: with round_to={round_to} a layer keeps a multiple of"
        f" {round_to} channels and one that would drop below {round_to} is left whole, and coupled layers (a"
        " residual sum, a depthwise conv, GroupNorm's groups) must agree on one count (a 16-channel conv net keeps"
        f" all 16 at ratio 0.6; with GroupNorm and a depthwise conv, every ratio kept all); pass round_to=None (any"
        " count), or another ratio"
    )


def warn_if_nothing_removed(removed: int, ratio: float, round_to: int | None) -> None:
    """A warning when a pruning step removed no channel (`nothing_removed` says why); nothing otherwise."""
    if not removed:
        rank_zero_warn(f"StructuredPruning: {nothing_removed(ratio, round_to)}.")


def finish_line(report: Mapping[str, Any], metrics: Mapping[str, float], monitor: str | None) -> str:
    """The line `StructuredPruning` prints when the fine-tune ends: MACs, parameters, latency and the monitor (if any).

    Example:
        >>> report = {"params_before": 1000, "params_after": 500, "latency_ms_before": 2.0, "latency_ms_after": 1.2}
        >>> metrics = {"macs_before": 4e6, "macs_after": 2e6, "macs_speedup": 2.0}
        >>> finish_line(report, metrics, None)
        'StructuredPruning: MACs 4,000,000 -> 2,000,000 (2.00x), params 1,000 -> 500, latency 2.0 -> 1.2 ms.'
    """
    return (
        f"StructuredPruning: MACs {metrics['macs_before']:,.0f} -> {metrics['macs_after']:,.0f}"
        f" ({metrics['macs_speedup']:.2f}x), params {report['params_before']:,} -> {report['params_after']:,}, latency"
        f" {report['latency_ms_before']} -> {report['latency_ms_after']} ms"
        + (f", {monitor} {report.get('metric_before')} -> {report.get('metric_after')}." if monitor else ".")
    )


def step_line(report: Mapping[str, Any], steps: int, removed: int, measured: float | None) -> str:
    """The line `StructuredPruning` prints after a pruning step, from ``report``'s last step record.

    ``measured`` is the measured latency speedup so far (None: MACs only).

    Example:
        >>> record = {"epoch": 2, "ratio": 0.5, "macs": 500.0, "params": 40}
        >>> line = step_line({"macs_before": 1000.0, "params_before": 80, "steps": [record]}, 2, 8, None)
        >>> line.removeprefix("StructuredPruning: step 1/2 at epoch 2: removed 8 channels (ratio 0.500); ")
        'MACs 1,000 -> 500 (2.00x), params 80 -> 40.'
    """
    record, before = report["steps"][-1], report["macs_before"]
    return (
        f"StructuredPruning: step {len(report['steps'])}/{steps} at epoch {record['epoch']}: removed {removed} channels"
        f" (ratio {record['ratio']:.3f}); MACs {before:,.0f} -> {record['macs']:,.0f}"
        f" ({before / max(record['macs'], 1.0):.2f}x), params {report['params_before']:,} -> {record['params']:,}"
        + ("." if measured is None else f", measured {measured:.2f}x faster.")
    )
