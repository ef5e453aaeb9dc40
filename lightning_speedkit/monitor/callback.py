"""UtilizationMonitor: why is training slow, data wait vs compute per step, device readings, a diagnosis and MFU."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_speedkit.batch import first_tensor
from lightning_speedkit.checks import check_bool, check_callable, check_int, check_number
from lightning_speedkit.hardware import cpu_info
from lightning_speedkit.hooks import LeanCallback
from lightning_speedkit.monitor.diagnosis import LoaderSettings, RankWindow, format_summary, judge_window
from lightning_speedkit.monitor.flops import measure_flops, training_peak_flops
from lightning_speedkit.monitor.loader import first_loader, loader_in_use
from lightning_speedkit.monitor.readings import DeviceReadings
from lightning_speedkit.monitor.seams import Seams
from lightning_speedkit.report import log_rank_zero
from lightning_speedkit.restore import StateSpec, cached_state_key, check_checkpoints
from lightning_speedkit.sampling import DeviceSampler, open_sampler
from lightning_speedkit.timing import StepTimer, WindowStats, median_fractions

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["UtilizationMonitor"]

_FRACTIONS = ("data_wait_fraction", "h2d_fraction", "between_fraction")


class UtilizationMonitor(LeanCallback):
    """Time every training step (data wait vs compute), read the device in the background, diagnose each window.

    Every ``window`` training batches it takes the last ``window`` completed steps, the device readings since the
    previous window and the CUDA allocator's retry count, labels them with `diagnose` (one of `LABELS`, with
    advice built from the training dataloader's settings read at train start), logs the figures and warns once
    each time the label changes (rank zero); the window's maths is the pure `judge_window`. The diagnosis uses the
    median step's data-wait share (`lightning_speedkit.timing.median_fractions`), so one slow step (warm-up, a
    checkpoint write, the process being descheduled) cannot flip it; the logged fractions are shares of the
    window's summed time. At the end of fit it prints a summary table (`format_summary`) and `report` returns the
    figures as a dict.

    Timing goes through `lightning_speedkit.timing.StepTimer`: wall clock on CPU; on CUDA, events read only once
    the GPU has passed them, so no step waits for the GPU. Host time in ``strategy.batch_to_device`` is timed as the
    host-to-device copy; on the wall clock, the host's work after a step until the loop asks the loader for the next
    batch (Lightning's loop, other callbacks' hooks, logging) is not data wait but ``between`` (`monitor.seams`: both
    wrapped on their instances during fit, put back at teardown); the diagnosis tells that ``loop_bound``.
    Device readings come from a `lightning_speedkit.sampling.DeviceSampler` (NVML on CUDA, else this process's CPU
    share and RSS) in a daemon thread that stops at the end of fit, on an exception and at teardown; if it fails
    mid-run it warns once, falls back to the process reading and training goes on. On CPU the utilisation is
    logged but not used for the diagnosis (other processes share the cores).

    MFU needs FLOPs per batch (``flops_per_batch``, or measured once on the meta device with ``flop_counter`` from
    the forward on the first batch's first tensor) and the dense peak (``peak_flops``, else `training_peak_flops`:
    TF32's for a conv net in ``32-true``); it warns when MFU exceeds 1. Under DDP the figures are gathered every
    window: the diagnosis uses the worst rank, and the slowest rank is logged.

    Args:
        window: Training batches per window (also the rolling window the figures cover).
        warn_util_below: Device utilisation below which a window is ``underutilized``, in (0, 1].
        warn_data_wait_above: Data-wait share above which a window is ``data_bound``, in [0, 1).
        peak_flops: Peak FLOP/s of one device, overriding the table (needed for MFU on CPU or unlisted GPUs).
        flops_per_batch: FLOPs of one training step on one device (forward and backward), None to measure.
        sample_interval: Seconds between device readings.
        sampler: Opens the `DeviceSampler` for a device (default `lightning_speedkit.sampling.open_sampler`).
        summary: Print the summary table at the end of fit.

    Raises:
        ValueError: In ``__init__`` for a bad argument (the message names it and its value).

    Logged metrics (to every Trainer logger, rank zero, each window, at ``step=trainer.global_step``), all under
    ``speedkit/monitor/``: ``data_wait_fraction``, ``h2d_fraction``, ``between_fraction``, ``step_time_s``,
    ``samples_per_second``, ``diagnosis`` (index in `LABELS`); with readings ``gpu_utilization``,
    ``gpu_memory_used_gb``, ``gpu_power_w``, ``gpu_temperature_c``, ``gpu_sm_clock_mhz`` (NVML) or
    ``cpu_utilization``, ``rss_gb`` (process); on CUDA ``alloc_retries``; with FLOPs and a peak ``mfu``; under DDP
    ``slowest_rank``, ``step_time_max_s``, ``median_data_wait_fraction_max``, ``utilization_min``, ``utilization_max``.

    Example:
        >>> import lightning as L
        >>> monitor = UtilizationMonitor(window=10)
        >>> trainer = L.Trainer(logger=False, callbacks=[monitor])
    """

    def __init__(
        self,
        window: int = 20,
        warn_util_below: float = 0.7,
        warn_data_wait_above: float = 0.2,
        peak_flops: float | None = None,
        flops_per_batch: float | None = None,
        sample_interval: float = 0.5,
        sampler: Callable[[torch.device], DeviceSampler] | None = None,
        summary: bool = True,
    ) -> None:
        check_int("window", window)
        check_number("warn_util_below", warn_util_below, 0, 1, open_low=True)
        check_number("warn_data_wait_above", warn_data_wait_above, 0, 1, open_high=True)
        for name, value in (("peak_flops", peak_flops), ("flops_per_batch", flops_per_batch)):
            if value is not None:
                check_number(name, value, 0, open_low=True)
        check_number("sample_interval", sample_interval, 0, open_low=True)
        check_bool("summary", summary)
        if sampler is not None:
            check_callable("sampler", sampler, "a function of a torch.device that returns a DeviceSampler, or None")
        self.window = window
        self.warn_util_below = warn_util_below
        self.warn_data_wait_above = warn_data_wait_above
        self.peak_flops = peak_flops
        self.flops_per_batch = flops_per_batch
        self.sample_interval = sample_interval
        self.sampler = sampler
        self.summary = summary
        self._reset()

    def _reset(self) -> None:
        """The run's state as before any fit: the one list of it (here, before the hooks, so mypy reads its types)."""
        self._timer: StepTimer | None = None
        self._readings = DeviceReadings(self.sample_interval)
        self._seams = Seams()
        self._loader: LoaderSettings | None = None
        self._base = WindowStats(0, 0, 0.0, 0.0, 0.0)
        self._batches = self._windows = self._retries = 0
        self._label: str | None = None
        self._advice = ""
        self._label_counts: dict[str, int] = {}
        self._last: dict[str, Any] = {}
        self._flops: float | None = None
        self._flops_error = ""  # why the FLOPs could not be counted: no MFU, the peak kept for the report
        self._flops_input: torch.Tensor | None = None
        self._peak: float | None = None
        self._cuda = False
        self._device_name = "cpu"
        self._warned_mfu = False

    @property
    @override
    def state_key(self) -> str:
        return cached_state_key(
            self,
            window=self.window,
            warn_util_below=self.warn_util_below,
            warn_data_wait_above=self.warn_data_wait_above,
        )

    state_spec: ClassVar[StateSpec] = {
        "batches": int,
        "totals": {"steps": int, "samples": int}
        | dict.fromkeys(("data_wait_s", "h2d_s", "compute_s", "between_s"), float),
        "label": (str, None),
        "advice": (str, None),
        "label_counts": dict,
        "windows": int,
        "flops_per_batch": (float, None),
        "last": dict,
    }
    """What a checkpoint may hold for the monitor (checked before any restore: `lightning_speedkit.restore`)."""

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        check_checkpoints(trainer)
        if stage != "fit":
            return
        self._stop()
        self._reset()  # a checkpoint's state, if any, is loaded after this
        self._seams.wrap(trainer, self._copied, self._fetching)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        device = pl_module.device
        self._timer = StepTimer(self.window, device)
        self._timer.restore(self._base)
        self._cuda = device.type == "cuda"
        self._device_name = torch.cuda.get_device_name(device) if self._cuda else "cpu"
        loader = first_loader(trainer.train_dataloader)
        if loader is not None:
            cores = cpu_info().available_cores
            self._loader = LoaderSettings.from_loader(loader, cores, trainer.num_devices, device.type)
        self._peak = self.peak_flops
        if self._peak is None and self._cuda:  # TF32's peak for a conv net in 32-true: cuDNN runs its convs in TF32
            self._peak = training_peak_flops(self._device_name, str(trainer.precision), pl_module)[0]
        self._retries = self._alloc_retries(device)
        self._readings.start(self.sampler or open_sampler, device)

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._timer is not None:
            self._timer.mark()

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._timer is None:
            return
        first = first_tensor(batch)
        if (
            self._flops is None
            and self.flops_per_batch is None
            and self._peak
            and not self._flops_error
            and first is not None
        ):
            self._flops_input = first
        self._timer.step_start(int(first.shape[0]) if first is not None and first.dim() else 0)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._timer is None:
            return
        self._timer.step_end()
        self._batches += 1
        if self._flops_input is not None:
            self._measure_flops(pl_module, self._flops_input)
            self._timer.mark()  # the measurement is not data wait
        if self._batches % self.window == 0:
            self._close_window(trainer)

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._timer is not None and not trainer.sanity_checking:
            self._timer.mark()

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._timer is None:
            return
        self._timer.flush()
        if self._batches % self.window or self._label is None:
            self._close_window(trainer)
        else:
            self._readings.take()  # notice a sampler that failed after the last window
        self._stop()
        if self.summary and self._label is not None:
            rank_zero_info(format_summary(self.report()))

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._stop()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._stop()

    @override
    def state_dict(self) -> dict[str, Any]:
        if self._timer is not None:
            self._timer.flush()  # a checkpoint counts the steps still running on the GPU (waits for them once)
        totals = self._totals()
        return {
            "batches": self._batches,
            "totals": asdict(totals),
            "label": self._label,
            "advice": self._advice,
            "label_counts": dict(self._label_counts),
            "windows": self._windows,
            "flops_per_batch": self._flops,
            "last": dict(self._last),
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._batches = int(state_dict.get("batches", 0))
        self._base = WindowStats(**state_dict["totals"]) if "totals" in state_dict else self._base
        self._label = state_dict.get("label")
        self._advice = state_dict.get("advice", "")
        self._label_counts = dict(state_dict.get("label_counts", {}))
        self._windows = int(state_dict.get("windows", 0))
        self._flops = state_dict.get("flops_per_batch", self._flops)
        self._last = dict(state_dict.get("last", {}))

    def report(self) -> dict[str, Any]:
        """The figures so far as a plain dict.

        Keys: ``diagnosis`` (the latest window's label, ``"unknown"`` before the first), ``advice``,
        ``data_wait_fraction``, ``h2d_fraction``, ``samples_per_second``, ``step_time_s``,
        ``median_data_wait_fraction`` (the median step's share, what the diagnosis used; all for the latest window),
        ``steps`` (``trainer.global_step`` at the latest window), ``batches`` (timed in all, across resumes),
        ``windows``, ``label_counts``, ``total`` (the same fractions and rate over every timed step),
        ``utilization``, ``mfu`` (``mfu_reason``: why there is none), ``flops_per_batch``, ``peak_flops``,
        ``device``, ``loader`` (settings dict or None), ``sampling_error`` (why readings stopped, or why NVML was not
        used); figures not available are None.
        """
        totals = self._totals()
        last = self._last
        return {
            "diagnosis": self._label or "unknown",
            "advice": self._advice,
            "data_wait_fraction": last.get("data_wait_fraction", totals.data_wait_fraction),
            "h2d_fraction": last.get("h2d_fraction", totals.h2d_fraction),
            "median_data_wait_fraction": last.get("median_data_wait_fraction"),
            "samples_per_second": last.get("samples_per_second", totals.samples_per_second),
            "step_time_s": last.get("step_time_s"),
            "steps": int(last.get("steps", 0)),
            "batches": self._batches,
            "windows": self._windows,
            "label_counts": dict(self._label_counts),
            "total": {  # steps, samples, data_wait_s, h2d_s, compute_s, and the fractions and rate over them all
                **asdict(totals),
                **{k: getattr(totals, k) for k in (*_FRACTIONS, "samples_per_second")},
            },
            "utilization": last.get("utilization"),
            "mfu": last.get("mfu"),
            "mfu_reason": self._mfu_reason(),
            "flops_per_batch": self.flops_per_batch or self._flops,
            "peak_flops": self._peak,
            "device": self._device_name,
            "loader": asdict(self._loader) if self._loader is not None else None,
            "sampling_error": self._readings.error,
        }

    def _totals(self) -> WindowStats:
        return self._timer.total_stats() if self._timer is not None else self._base

    def _close_window(self, trainer: pl.Trainer) -> None:
        assert self._timer is not None  # only called while timing
        stats = self._timer.window_stats()
        if stats.steps == 0:
            return
        readings = self._readings.take()
        retries_now = self._alloc_retries(trainer.strategy.root_device)
        retries, self._retries = retries_now - self._retries, retries_now
        wait, h2d, between = median_fractions(self._timer.recent_steps())
        util = readings.get("gpu_utilization") if self._cuda else None
        mine = RankWindow(wait, h2d, util, stats.total_s / stats.steps, retries, between)
        flops = self.flops_per_batch or self._flops
        self._loader = loader_in_use(self._loader, trainer)  # a loader tuner rebuilds it after the fit started
        judged = judge_window(
            stats,
            _gather(trainer, mine),
            readings,
            loader=self._loader,
            flops_per_batch=flops,
            peak_flops=self._peak,
            cuda=self._cuda,
            warn_util_below=self.warn_util_below,
            warn_data_wait_above=self.warn_data_wait_above,
        )
        diagnosis = judged.diagnosis
        self._windows += 1
        self._label_counts[diagnosis.label] = self._label_counts.get(diagnosis.label, 0) + 1
        if diagnosis.label != self._label:
            notify = rank_zero_info if diagnosis.label == "compute_bound" else rank_zero_warn
            notify(f"UtilizationMonitor: {diagnosis.advice}")
        self._label, self._advice = diagnosis.label, diagnosis.advice
        if judged.mfu is not None and judged.mfu > 1 and not self._warned_mfu:
            self._warned_mfu = True
            rank_zero_warn(
                f"UtilizationMonitor: MFU {judged.mfu:.2f} > 1 is impossible: the peak ({self._peak:.3g} FLOP/s for"
                f" {self._device_name!r}) or flops_per_batch ({flops:.3g}) is wrong; pass the right `peak_flops`."
            )
        self._last = {**judged.figures, "steps": trainer.global_step}
        log_rank_zero(trainer, {f"speedkit/monitor/{name}": value for name, value in judged.metrics.items()})

    def _mfu_reason(self) -> str | None:
        """Why there is no MFU: no peak FLOP/s, or FLOPs that could not be counted; None when it can be had."""
        if not self._peak:
            return f"no peak FLOP/s known for {self._device_name!r}: pass `peak_flops`"
        return None if self.flops_per_batch or self._flops else self._flops_error or None

    def _measure_flops(self, pl_module: pl.LightningModule, first: torch.Tensor) -> None:
        self._flops_input = None
        try:
            self._flops = float(measure_flops(pl_module, [first]))
        except Exception as err:  # an unusual forward signature: MFU is a nicety, not a reason to stop
            self._flops, self._flops_error = None, f"could not count FLOPs ({err}): pass `flops_per_batch`"
            rank_zero_warn(f"UtilizationMonitor: could not count FLOPs ({err}); pass `flops_per_batch` for MFU.")

    def _alloc_retries(self, device: torch.device) -> int:
        if device.type != "cuda":
            return 0
        return int(torch.cuda.memory_stats(device).get("num_alloc_retries", 0))

    def _stop(self) -> None:
        self._readings.stop()
        self._seams.restore()

    def _copied(self, seconds: float) -> None:
        if self._timer is not None:
            self._timer.add_h2d(seconds)

    def _fetching(self) -> None:
        if self._timer is not None:
            self._timer.fetch_start()


def _gather(trainer: pl.Trainer, mine: RankWindow) -> list[RankWindow]:
    """Every rank's figures for the window, in rank order (every rank gets here at the same batch)."""
    if trainer.world_size == 1:
        return [mine]
    utilization = -1.0 if mine.utilization is None else mine.utilization
    row = [*mine[:2], utilization, mine.step_time_s, mine.alloc_retries, mine.between_fraction]
    local = torch.tensor(row, dtype=torch.float64, device=trainer.strategy.root_device)
    rows = trainer.strategy.all_gather(local).cpu().reshape(-1, len(row)).tolist()
    return [RankWindow(w, h, None if u < 0 else u, t, int(r), b) for w, h, u, t, r, b in rows]
