"""The demo's PNG: validation accuracy against wall time, and each variant's step time split."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning_speedkit.report import atomic_file

__all__ = ["plot_demo"]


def plot_demo(report: dict[str, Any], path: str | Path) -> str | None:
    """Draw :func:`~lightning_speedkit.demo.run.run_demo`'s report to ``path`` (atomically).

    Returns:
        The path written, or None (with nothing written) when matplotlib is not installed
        (``pip install "lightning-speedkit[plot]"``).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    runs = report["runs"]
    fig, (curve, split) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [2, 1]})
    for name, run in runs.items():
        points = run["timeline"]
        curve.plot([p["seconds"] for p in points], [p["val_acc"] for p in points], marker="o", label=name)
    curve.axhline(report["config"]["target_acc"], color="grey", linestyle="--", linewidth=1, label="target")
    curve.set(xlabel="wall time (s)", ylabel="validation accuracy", title="accuracy vs time")
    curve.legend()
    names = list(runs)
    waits = [runs[n]["step_data_wait_ms"] for n in names]
    computes = [runs[n]["step_compute_ms"] for n in names]
    split.bar(names, computes, label="compute")
    split.bar(names, waits, bottom=computes, label="data wait")
    between = [runs[n].get("step_between_ms", 0.0) for n in names]  # absent from reports made before it was timed
    split.bar(names, between, bottom=[c + w for c, w in zip(computes, waits, strict=True)], label="between steps")
    split.set(ylabel="ms per training step", title="step time")
    split.tick_params(axis="x", labelrotation=20)
    split.legend()
    fig.tight_layout()
    try:
        with atomic_file(path) as tmp:
            fig.savefig(tmp, dpi=100, format="png")
    finally:
        plt.close(fig)
    return str(path)
