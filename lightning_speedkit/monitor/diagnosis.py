"""The diagnosis of a window of steps (data, copy, loop, memory or compute bound), with advice from its loader."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from lightning_speedkit.data.batched import fetches_at_once
from lightning_speedkit.data.streaming import is_streaming_loader, unsharded_iterable
from lightning_speedkit.monitor.flops import mfu
from lightning_speedkit.timing import WindowStats

__all__ = [
    "LABELS",
    "LoaderSettings",
    "RankWindow",
    "WindowDiagnosis",
    "WindowJudgement",
    "diagnose",
    "format_summary",
    "judge_window",
]

LABELS = ("compute_bound", "data_bound", "h2d_bound", "loop_bound", "memory_thrash", "underutilized")
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
        streaming: Whether it is a litdata ``StreamingDataLoader`` (its advice is litdata's own levers).
        remote: Whether that streaming dataset is read from a URL (chunks downloaded and cached) or a local directory.
        workers_measured_slower: What a loader tuner measured of more workers on real steps, when they all lost
            (``"num_workers=1 26% slower"``): the advice then does not suggest them.
        fetched_per_sample: Whether the samples are rows of in-memory tensors fetched and stacked one by one, which
            one indexing call a batch would serve (`lightning_speedkit.data.fetches_at_once`): the advice says so first.
    """

    num_workers: int = 0
    pin_memory: bool = False
    persistent_workers: bool = False
    prefetch_factor: int | None = None
    batch_size: int | None = None
    cores: int = 1
    ranks_per_node: int = 1
    accelerator: str = "cpu"
    streaming: bool = False
    remote: bool = False
    workers_measured_slower: str | None = None
    fetched_per_sample: bool = False
    iterable: bool = False  # an IterableDataset (not litdata's): each worker would yield every sample
    in_use: tuple[str, ...] = ()  # the compute speedups the run already has (`monitor.loader.loader_in_use`)

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
            streaming=is_streaming_loader(loader),
            remote=getattr(getattr(getattr(loader, "dataset", None), "input_dir", None), "url", None) is not None,
            fetched_per_sample=fetches_at_once(getattr(loader, "dataset", None), getattr(loader, "collate_fn", None)),
            iterable=unsharded_iterable(getattr(loader, "dataset", None)) and not is_streaming_loader(loader),
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
    between_fraction: float = 0.0,
) -> WindowDiagnosis:
    r"""Label a window of steps and say what to change, from the dataloader settings actually in use.

    In order: ``memory_thrash`` (the CUDA allocator retried), ``h2d_bound`` (the data wait is high and mostly the
    host-to-device copy), ``data_bound`` (the data wait is high), ``loop_bound`` (the host's own work between steps,
    outside the loader, takes as much), ``underutilized`` (the device is idle although data is ready: batches too
    small, launch overhead), else ``compute_bound``.

    Args:
        data_wait_fraction: Share of the step time waiting for data, in [0, 1].
        h2d_fraction: Share of the step time copying batches to the device, in [0, 1].
        utilization: Device busy share in [0, 1], or None when unknown (on CPU it is not used).
        alloc_retries: CUDA allocator retries during the window.
        loader: The training dataloader's settings, for concrete advice.
        warn_util_below: Utilisation below which the device counts as underutilised.
        warn_data_wait_above: Data-wait (or ``between_fraction``) share above which the window is data (loop) bound.
        between_fraction: Share of the step time the host worked between steps outside the loader (Lightning's
            loop, callbacks' hooks, logging: `lightning_speedkit.timing.StepTime.between_s`).

    Example:
        >>> loader = LoaderSettings(num_workers=0, batch_size=32, cores=16, accelerator="cuda")
        >>> print(*diagnose(0.62, loader=loader).advice.split("; "), sep="\n")
        data_bound: 62% of each step waits for data
        num_workers=0 on a 16-core machine
        try num_workers=8, pin_memory=True, persistent_workers=True (batch_size=32).
        >>> tuned = LoaderSettings(num_workers=0, cores=2, workers_measured_slower="num_workers=1 26% slower")
        >>> print(*diagnose(0.27, loader=tuned).advice.split("; "), sep="\n")
        data_bound: 27% of each step waits for data
        num_workers=0 on a 2-core machine, and DataLoaderTuner measured num_workers=1 26% slower on real steps here
        make each sample cheaper (cache decoded data, augment on the device, a faster decoder).
        >>> rows = LoaderSettings(num_workers=0, cores=2, fetched_per_sample=True)
        >>> print(*diagnose(0.35, loader=rows).advice.split("; "), sep="\n")
        data_bound: 35% of each step waits for data
        num_workers=0 on a 2-core machine, each sample of a TensorDataset fetched and stacked one by one
        fetch each batch with one indexing call (DataLoaderTuner tries batched_fetch=True on real steps).
        >>> diagnose(0.05, utilization=0.95).label
        'compute_bound'
        >>> print(*diagnose(0.02, between_fraction=0.9).advice.split("; "), sep="\n")
        loop_bound: 90% of each step is host work between steps, not data loading (the loop, hooks, logging)
        find the slow hook with Trainer(profiler="simple"), log less often, or use larger batches.
    """
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
    if between_fraction > warn_data_wait_above:
        return WindowDiagnosis(
            "loop_bound",
            f"loop_bound: {round(100 * between_fraction)}% of each step is host work between steps, not data loading"
            ' (the loop, hooks, logging); find the slow hook with Trainer(profiler="simple"), log less often, or use'
            " larger batches.",
        )
    if utilization is not None and utilization < warn_util_below:
        larger = f"a larger batch_size than {loader.batch_size}" if loader and loader.batch_size else "larger batches"
        return WindowDiagnosis(
            "underutilized",
            f"underutilized: the device is busy {round(100 * utilization)}% of the time although data waits only"
            f" {wait}%; try {larger}, or torch.compile / CUDA graphs to cut launch overhead.",
        )
    levers = ["bf16-mixed precision", "torch.compile", "channels_last"] if cuda else ["torch.compile"]
    left = [lever for lever in levers if loader is None or lever not in loader.in_use]  # never what it already has
    speedups = ", ".join(left) if cuda else ", or ".join([*left, "a GPU"])
    computes = round(100 * (1 - data_wait_fraction - between_fraction))
    advice = f"compute_bound: {computes}% of each step computes; speed the model up: {speedups or 'a faster GPU'}."
    return WindowDiagnosis("compute_bound", advice)


class RankWindow(NamedTuple):
    """One rank's figures for a window, the ones `judge_window` compares across ranks."""

    data_wait_fraction: float
    """The median step's data-wait share (`lightning_speedkit.timing.median_fractions`)."""
    h2d_fraction: float
    """The median step's host-to-device-copy share."""
    utilization: float | None
    """The device's busy share, None when unknown or not used (on CPU)."""
    step_time_s: float
    """Mean seconds per step."""
    alloc_retries: int
    """CUDA allocator retries during the window."""
    between_fraction: float = 0.0
    """The median step's share of the host's work between steps, outside the loader."""


@dataclass(frozen=True)
class WindowJudgement:
    """What `judge_window` concludes about a window.

    Args:
        diagnosis: The label and advice.
        metrics: What to log, by name under ``speedkit/monitor/``.
        figures: The latest-window figures of `UtilizationMonitor.report
            <lightning_speedkit.monitor.UtilizationMonitor.report>` (``steps`` aside).
        mfu: This rank's model FLOPs utilisation, None without FLOPs or a peak.
    """

    diagnosis: WindowDiagnosis
    metrics: dict[str, float]
    figures: dict[str, Any]
    mfu: float | None


def judge_window(
    stats: WindowStats,
    ranks: Sequence[RankWindow],
    readings: Mapping[str, float] | None = None,
    *,
    loader: LoaderSettings | None = None,
    flops_per_batch: float | None = None,
    peak_flops: float | None = None,
    cuda: bool = False,
    warn_util_below: float = 0.7,
    warn_data_wait_above: float = 0.2,
) -> WindowJudgement:
    """Diagnose a window of steps from this rank's totals and every rank's figures: the worst rank decides.

    The diagnosis (`diagnose`) takes the highest median data-wait and copy shares, the most allocator retries and
    the lowest known utilisation over ``ranks`` (one entry without DDP). The logged fractions and rate are this
    rank's shares of the window's summed time (``stats``); its step time is ``stats.total_s / stats.steps`` and its
    MFU uses that. With several ranks the metrics add ``slowest_rank``, ``step_time_max_s``,
    ``median_data_wait_fraction_max`` and, when known, ``utilization_min`` and ``utilization_max``; on CUDA
    ``alloc_retries``. ``readings`` (`lightning_speedkit.monitor.readings.aggregate_readings`) are logged as they are.

    Example:
        >>> stats = WindowStats(steps=4, samples=128, data_wait_s=0.2, h2d_s=0.0, compute_s=1.8)
        >>> judged = judge_window(stats, [RankWindow(0.1, 0.0, None, 0.5, 0)], flops_per_batch=1e9, peak_flops=1e10)
        >>> judged.diagnosis.label, judged.mfu, judged.metrics["samples_per_second"]
        ('compute_bound', 0.2, 64.0)
        >>> two = [RankWindow(0.1, 0.0, None, 0.5, 0), RankWindow(0.6, 0.0, None, 0.9, 0)]
        >>> judged = judge_window(stats, two)
        >>> judged.diagnosis.label, judged.metrics["slowest_rank"], judged.figures["median_data_wait_fraction"]
        ('data_bound', 1.0, 0.6)
    """
    if not ranks:
        raise ValueError("`ranks` must hold at least one rank's figures, got none.")
    readings = dict(readings or {})
    wait, h2d = max(r.data_wait_fraction for r in ranks), max(r.h2d_fraction for r in ranks)
    between = max(r.between_fraction for r in ranks)
    retries = max(r.alloc_retries for r in ranks)
    utils = [r.utilization for r in ranks if r.utilization is not None]
    util = min(utils) if utils else None
    metrics: dict[str, float] = {}
    slowest = None
    if len(ranks) > 1:
        slowest = max(range(len(ranks)), key=lambda i: ranks[i].step_time_s)
        metrics.update(
            slowest_rank=float(slowest), step_time_max_s=ranks[slowest].step_time_s, median_data_wait_fraction_max=wait
        )
        if utils:
            metrics.update(utilization_min=min(utils), utilization_max=max(utils))
    diagnosis = diagnose(wait, h2d, util, retries, loader, warn_util_below, warn_data_wait_above, between)
    step_time = stats.total_s / stats.steps if stats.steps else 0.0
    value = mfu(flops_per_batch, step_time, peak_flops) if flops_per_batch and peak_flops else None
    metrics.update(
        data_wait_fraction=stats.data_wait_fraction,
        h2d_fraction=stats.h2d_fraction,
        between_fraction=stats.between_fraction,
        step_time_s=step_time,
        samples_per_second=stats.samples_per_second,
        diagnosis=float(LABELS.index(diagnosis.label)),
        **readings,
    )
    if cuda:
        metrics["alloc_retries"] = float(retries)
    if value is not None:
        metrics["mfu"] = value
    figures = {
        "median_data_wait_fraction": wait,
        "data_wait_fraction": stats.data_wait_fraction,
        "h2d_fraction": stats.h2d_fraction,
        "between_fraction": stats.between_fraction,
        "samples_per_second": stats.samples_per_second,
        "step_time_s": step_time,
        "utilization": readings.get("gpu_utilization", readings.get("cpu_utilization")),
        "mfu": value,
        "slowest_rank": slowest,
    }
    return WindowJudgement(diagnosis, metrics, figures, value)


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
    wait, h2d, between = (total.get(f"{k}_fraction", 0.0) for k in ("data_wait", "h2d", "between"))
    lines = [
        f"UtilizationMonitor summary ({report.get('batches', 0)} batches)",
        f"  data wait   {100 * wait:6.1f}%",
        f"  h2d copy    {100 * h2d:6.1f}%",
        *([f"  between     {100 * between:6.1f}%  (the loop, hooks, logging)"] if between else []),
        f"  compute     {100 * (1 - wait - between):6.1f}%",
        f"  samples/s   {total.get('samples_per_second', 0.0):7.1f}",
    ]
    for key, name in (("utilization", "utilization"), ("mfu", "MFU")):
        if report.get(key) is not None:
            lines.append(f"  {name:<11} {100 * report[key]:6.1f}%")
    lines += [f"  diagnosis    {report.get('diagnosis')}", f"  advice       {report.get('advice')}"]
    return "\n".join(lines)


def _streaming_advice(loader: LoaderSettings, have: str) -> str:
    r"""A data-bound litdata StreamingDataLoader: its own levers (workers shard it; chunks, cache, pre-download).

    Example:
        >>> advice = _streaming_advice(LoaderSettings(streaming=True, remote=True, cores=8), "num_workers=0")
        >>> print(*advice.replace(", a ", ",\na ").split("; "), sep="\n")
        a litdata StreamingDataLoader with num_workers=0
        try num_workers=8, prefetch_factor=4 (DataLoaderTuner times them on real steps),
        a cache_dir on local NVMe,
        a larger max_cache_size, max_pre_download above 2, or larger chunks (write_streaming(chunk_bytes=...))
    """
    tries = [f"num_workers={loader.suggested_workers}"] if loader.num_workers < loader.suggested_workers else []
    if loader.prefetch_factor is None or loader.prefetch_factor < 4:
        tries.append("prefetch_factor=4")
    tuner = f"{', '.join(tries)} (DataLoaderTuner times them on real steps), " if tries else ""
    larger = "larger chunks (write_streaming(chunk_bytes=...))"
    if loader.remote:
        chunks = f"a cache_dir on local NVMe, a larger max_cache_size, max_pre_download above 2, or {larger}"
    else:
        chunks = f"{larger}, or on one machine a CachedDataset (a random read in microseconds, not milliseconds)"
    return f"a litdata StreamingDataLoader with {have}; try {tuner}{chunks}"


def _loader_advice(loader: LoaderSettings | None) -> str:
    if loader is None:
        return "try more DataLoader workers, pin_memory=True and persistent_workers=True"
    where = f"on a {loader.cores}-core machine"
    if loader.ranks_per_node > 1:
        where = f"per rank, {loader.ranks_per_node} ranks {where}"
    have = f"num_workers={loader.num_workers} {where}"
    if loader.streaming:
        return _streaming_advice(loader, have)
    cuda = loader.accelerator == "cuda"
    if loader.fetched_per_sample:
        return (
            f"{have}, each sample of a TensorDataset fetched and stacked one by one; fetch each batch with one"
            " indexing call (DataLoaderTuner tries batched_fetch=True on real steps)"
        )
    if loader.workers_measured_slower:
        return (
            f"{have}, and DataLoaderTuner measured {loader.workers_measured_slower} on real steps here; make each"
            " sample cheaper (cache decoded data, augment on the device, a faster decoder)"
        )
    if loader.iterable and loader.num_workers < loader.suggested_workers:  # workers would repeat the data
        return (
            f"{have}, an IterableDataset: with workers each would yield every sample, unless it shards itself by"
            " worker (torch.utils.data.get_worker_info()); shard it, then try workers, or make each sample cheaper"
        )
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
