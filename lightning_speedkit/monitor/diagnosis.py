"""The diagnosis of a window of steps (data, copy, memory or compute bound) with advice from the dataloader settings."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["LABELS", "LoaderSettings", "WindowDiagnosis", "diagnose", "format_summary"]

LABELS = ("compute_bound", "data_bound", "h2d_bound", "memory_thrash", "underutilized")
"""The diagnoses; ``speedkit/monitor/diagnosis`` logs the index of one in this tuple."""


@dataclass(frozen=True)
class LoaderSettings:
    """The training dataloader's settings and the CPU they run on, read at fit start.

    Args:
        num_workers: DataLoader worker processes.
        pin_memory: Whether batches are page-locked.
        persistent_workers: Whether workers survive between epochs.
        prefetch_factor: Batches each worker loads ahead (None with ``num_workers=0``).
        batch_size: Samples per batch, when the loader says.
        cores: CPU cores this process may use.
        ranks_per_node: Training processes sharing those cores.
        accelerator: ``"cuda"``, ``"cpu"``, ...
    """

    num_workers: int = 0
    pin_memory: bool = False
    persistent_workers: bool = False
    prefetch_factor: int | None = None
    batch_size: int | None = None
    cores: int = 1
    ranks_per_node: int = 1
    accelerator: str = "cpu"

    @classmethod
    def from_loader(cls, loader: Any, cores: int, ranks_per_node: int = 1, accelerator: str = "cpu") -> LoaderSettings:
        """Read the settings off a ``torch.utils.data.DataLoader`` (missing attributes keep their defaults)."""
        batch_size = getattr(loader, "batch_size", None)
        if batch_size is None:
            batch_size = getattr(getattr(loader, "batch_sampler", None), "batch_size", None)
        return cls(
            num_workers=int(getattr(loader, "num_workers", 0)),
            pin_memory=bool(getattr(loader, "pin_memory", False)),
            persistent_workers=bool(getattr(loader, "persistent_workers", False)),
            prefetch_factor=getattr(loader, "prefetch_factor", None) if getattr(loader, "num_workers", 0) else None,
            batch_size=batch_size if isinstance(batch_size, int) else None,
            cores=cores,
            ranks_per_node=max(1, ranks_per_node),
            accelerator=accelerator,
        )

    @property
    def suggested_workers(self) -> int:
        """Workers worth trying per rank: the cores per rank, at most 8."""
        return max(1, min(8, self.cores // self.ranks_per_node))


@dataclass(frozen=True)
class WindowDiagnosis:
    """One of `LABELS` and a one-line advice that starts with it."""

    label: str
    advice: str


def diagnose(
    data_wait_fraction: float,
    h2d_fraction: float = 0.0,
    utilization: float | None = None,
    alloc_retries: int = 0,
    loader: LoaderSettings | None = None,
    warn_util_below: float = 0.7,
    warn_data_wait_above: float = 0.2,
) -> WindowDiagnosis:
    """Label a window of steps and say what to change, from the dataloader settings actually in use.

    In order: ``memory_thrash`` (the CUDA allocator retried), ``h2d_bound`` (the data wait is high and mostly the
    host-to-device copy), ``data_bound`` (the data wait is high), ``underutilized`` (the device is idle although
    data is ready: batches too small, launch overhead), else ``compute_bound``.

    Args:
        data_wait_fraction: Share of the step time waiting for data, in [0, 1].
        h2d_fraction: Share of the step time copying batches to the device, in [0, 1].
        utilization: Device busy share in [0, 1], or None when unknown (on CPU it is not used).
        alloc_retries: CUDA allocator retries during the window.
        loader: The training dataloader's settings, for concrete advice.
        warn_util_below: Utilisation below which the device counts as underutilised.
        warn_data_wait_above: Data-wait share above which the window counts as data bound.

    Example:
        >>> loader = LoaderSettings(num_workers=0, batch_size=32, cores=16, accelerator="cuda")
        >>> diagnose(0.62, loader=loader).advice
        'data_bound: 62% of each step waits for data; num_workers=0 on a 16-core machine; try num_workers=8, pin_memory=True, persistent_workers=True (batch_size=32).'
        >>> diagnose(0.05, utilization=0.95).label
        'compute_bound'
    """  # noqa: E501
    wait, h2d = round(100 * data_wait_fraction), round(100 * h2d_fraction)
    batch = f" (batch_size={loader.batch_size})" if loader and loader.batch_size else ""
    cuda = loader is None or loader.accelerator == "cuda"
    if alloc_retries > 0:
        smaller = (
            f"a smaller batch_size than {loader.batch_size}" if loader and loader.batch_size else "a smaller batch"
        )
        return WindowDiagnosis(
            "memory_thrash",
            f"memory_thrash: the CUDA allocator freed its cache and retried {alloc_retries} time(s) in this window;"
            f" try {smaller}, PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, or activation checkpointing.",
        )
    copies = loader is None or loader.accelerator != "cpu"  # on CPU "to device" is no copy: count it as data wait
    if copies and data_wait_fraction > warn_data_wait_above and h2d_fraction >= data_wait_fraction / 2:
        fix = "pin_memory=True so the copy runs asynchronously" if not (loader and loader.pin_memory) else ""
        fix = fix or "send smaller batches (uint8 images, normalise on the device)"
        return WindowDiagnosis(
            "h2d_bound", f"h2d_bound: {h2d}% of each step copies the batch to the device; try {fix}{batch}."
        )
    if data_wait_fraction > warn_data_wait_above:
        return WindowDiagnosis(
            "data_bound", f"data_bound: {wait}% of each step waits for data; {_loader_advice(loader)}{batch}."
        )
    if utilization is not None and utilization < warn_util_below:
        larger = f"a larger batch_size than {loader.batch_size}" if loader and loader.batch_size else "larger batches"
        return WindowDiagnosis(
            "underutilized",
            f"underutilized: the device is busy {round(100 * utilization)}% of the time although data waits only"
            f" {wait}%; try {larger}, or torch.compile / CUDA graphs to cut launch overhead.",
        )
    speedups = "bf16-mixed precision, torch.compile, channels_last" if cuda else "torch.compile, or a GPU"
    return WindowDiagnosis(
        "compute_bound", f"compute_bound: {100 - wait}% of each step computes; speed the model up: {speedups}."
    )


def format_summary(report: Mapping[str, Any]) -> str:
    """The end-of-fit table for a `UtilizationMonitor.report` dict.

    Example:
        >>> print(format_summary({"diagnosis": "compute_bound", "advice": "compute_bound: ...", "batches": 4,
        ...     "total": {"data_wait_fraction": 0.1, "h2d_fraction": 0.0, "samples_per_second": 12.0}}))
        UtilizationMonitor summary (4 batches)
          data wait     10.0%
          h2d copy       0.0%
          compute       90.0%
          samples/s      12.0
          diagnosis    compute_bound
          advice       compute_bound: ...
    """
    total = report.get("total", {})
    wait, h2d = total.get("data_wait_fraction", 0.0), total.get("h2d_fraction", 0.0)
    lines = [
        f"UtilizationMonitor summary ({report.get('batches', 0)} batches)",
        f"  data wait   {100 * wait:6.1f}%",
        f"  h2d copy    {100 * h2d:6.1f}%",
        f"  compute     {100 * (1 - wait):6.1f}%",
        f"  samples/s   {total.get('samples_per_second', 0.0):7.1f}",
    ]
    for key, name in (("utilization", "utilization"), ("mfu", "MFU")):
        if report.get(key) is not None:
            lines.append(f"  {name:<11} {100 * report[key]:6.1f}%")
    lines += [f"  diagnosis    {report.get('diagnosis')}", f"  advice       {report.get('advice')}"]
    return "\n".join(lines)


def _loader_advice(loader: LoaderSettings | None) -> str:
    if loader is None:
        return "try more DataLoader workers, pin_memory=True and persistent_workers=True"
    where = f"on a {loader.cores}-core machine"
    if loader.ranks_per_node > 1:
        where = f"per rank, {loader.ranks_per_node} ranks {where}"
    have = f"num_workers={loader.num_workers} {where}"
    cuda = loader.accelerator == "cuda"
    if loader.num_workers < loader.suggested_workers:
        tries = [f"num_workers={loader.suggested_workers}"]
        tries += ["pin_memory=True"] if cuda and not loader.pin_memory else []
        tries += ["persistent_workers=True"] if not loader.persistent_workers else []
        return f"{have}; try {', '.join(tries)}"
    tries = ["persistent_workers=True"] if not loader.persistent_workers else []
    if loader.prefetch_factor is not None and loader.prefetch_factor < 4:
        tries.append(f"prefetch_factor=4 (now {loader.prefetch_factor})")
    more = f"; try {', '.join(tries)}" if tries else ""
    return (
        f"{have} already uses the cores{more}; make each sample cheaper (cache decoded data, augment on the device,"
        " a faster decoder)"
    )
