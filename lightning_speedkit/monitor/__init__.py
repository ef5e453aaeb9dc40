"""Why is training slow: data wait vs compute per step, device readings, a diagnosis with advice, and MFU."""

from lightning_speedkit.monitor.callback import UtilizationMonitor
from lightning_speedkit.monitor.diagnosis import (
    LABELS,
    LoaderSettings,
    RankWindow,
    WindowDiagnosis,
    WindowJudgement,
    diagnose,
    format_summary,
    judge_window,
)
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
    "RankWindow",
    "UtilizationMonitor",
    "WindowDiagnosis",
    "WindowJudgement",
    "diagnose",
    "format_summary",
    "judge_window",
    "measure_flops",
    "mfu",
    "peak_flops",
    "precision_key",
    "tf32_allowed",
    "training_peak_flops",
    "uses_tf32",
]
