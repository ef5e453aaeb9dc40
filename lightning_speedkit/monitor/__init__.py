"""Why is training slow: data wait vs compute per step, device readings, a diagnosis with advice, and MFU."""

from lightning_speedkit.monitor.callback import UtilizationMonitor
from lightning_speedkit.monitor.diagnosis import LABELS, LoaderSettings, WindowDiagnosis, diagnose, format_summary
from lightning_speedkit.monitor.flops import (
    DENSE_PEAK_FLOPS,
    measure_flops,
    mfu,
    peak_flops,
    precision_key,
    tf32_allowed,
    training_peak_flops,
    uses_tf32,
)

__all__ = [
    "DENSE_PEAK_FLOPS",
    "LABELS",
    "LoaderSettings",
    "UtilizationMonitor",
    "WindowDiagnosis",
    "diagnose",
    "format_summary",
    "measure_flops",
    "mfu",
    "peak_flops",
    "precision_key",
    "tf32_allowed",
    "training_peak_flops",
    "uses_tf32",
]
