"""UtilizationMonitor: why is training slow, data wait vs compute per step, device readings, a diagnosis and MFU."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_speedkit.batch import first_tensor
from lightning_speedkit.hardware import DeviceSample, DeviceSampler, SamplerThread, cpu_info, open_sampler
from lightning_speedkit.monitor.diagnosis import LABELS, LoaderSettings, diagnose, format_summary
from lightning_speedkit.monitor.flops import measure_flops, mfu, training_peak_flops
from lightning_speedkit.timing import StepTimer, WindowStats, median_fractions

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["UtilizationMonitor"]


class UtilizationMonitor(Callback):
    """Time every training step (data wait vs compute), read the device in the background, diagnose each window.

    Every ``window`` training batches it takes the last ``window`` completed steps, the device readings since the
    previous window and the CUDA allocator's retry count, labels them with `diagnose` (one of `LABELS`, with
    advice built from the training dataloader's settings read at train start), logs the figures and warns once
    each time the label changes (rank zero). The diagnosis uses the median step's data-wait share
    (`lightning_speedkit.timing.median_fractions`), so one slow step (warm-up, a checkpoint write, the process
    being descheduled) cannot flip it; the logged fractions are shares of the window's summed time. At the end of
    fit it prints a summary table (`format_summary`) and `report` returns the figures as a dict.

    Timing goes through `lightning_speedkit.timing.StepTimer`: wall clock on CPU; on CUDA, events read only once
    the GPU has passed them, so no step waits for the GPU. Host time in ``strategy.batch_to_device`` is timed as the
    host-to-device copy (the method is wrapped on the strategy instance during fit and restored at teardown).
    Device readings come from a `lightning_speedkit.hardware.DeviceSampler` (NVML on CUDA, else this process's CPU
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
        sampler: Opens the `DeviceSampler` for a device (default `lightning_speedkit.hardware.open_sampler`).
        summary: Print the summary table at the end of fit.

    Raises:
        ValueError: In ``__init__`` for a bad argument (the message names it and its value).

    Logged metrics (to every Trainer logger, rank zero, each window, at ``step=trainer.global_step``), all under
    ``speedkit/monitor/``: ``data_wait_fraction``, ``h2d_fraction``, ``step_time_s``, ``samples_per_second``,
    ``diagnosis`` (index in `LABELS`); with readings ``gpu_utilization``, ``gpu_memory_used_gb``, ``gpu_power_w``,
    ``gpu_temperature_c``, ``gpu_sm_clock_mhz`` (NVML) or ``cpu_utilization``, ``rss_gb`` (process); on CUDA
    ``alloc_retries``; with FLOPs and a peak ``mfu``; under DDP ``slowest_rank``, ``step_time_max_s``,
    ``median_data_wait_fraction_max``, ``utilization_min``, ``utilization_max``.

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
        if not isinstance(window, int) or isinstance(window, bool) or window < 1:
            raise ValueError(f"`window` must be a positive int, got {window!r}.")
        if not 0.0 < warn_util_below <= 1.0:
            raise ValueError(f"`warn_util_below` must be in (0, 1], got {warn_util_below!r}.")
        if not 0.0 <= warn_data_wait_above < 1.0:
            raise ValueError(f"`warn_data_wait_above` must be in [0, 1), got {warn_data_wait_above!r}.")
        for name, value in (("peak_flops", peak_flops), ("flops_per_batch", flops_per_batch)):
            if value is not None and not (isinstance(value, (int, float)) and value > 0 and math.isfinite(value)):
                raise ValueError(f"`{name}` must be a positive number or None, got {value!r}.")
        if not (isinstance(sample_interval, (int, float)) and sample_interval > 0):
            raise ValueError(f"`sample_interval` must be a positive number of seconds, got {sample_interval!r}.")
        self.window = window
        self.warn_util_below = warn_util_below
        self.warn_data_wait_above = warn_data_wait_above
        self.peak_flops = peak_flops
        self.flops_per_batch = flops_per_batch
        self.sample_interval = sample_interval
        self.sampler = sampler
        self.summary = summary
        self._state_key: tuple[tuple[float, ...], str] | None = None
        self._timer: StepTimer | None = None
        self._thread: SamplerThread | None = None
        self._wrapped: tuple[Any, Any] | None = None
        self._loader: LoaderSettings | None = None
        self._base = WindowStats(0, 0, 0.0, 0.0, 0.0)
        self._batches = self._windows = self._retries = 0
        self._label: str | None = None
        self._advice = ""
        self._label_counts: dict[str, int] = {}
        self._last: dict[str, Any] = {}
        self._flops: float | None = None
        self._flops_input: torch.Tensor | None = None
        self._peak: float | None = None
        self._cuda = False
        self._device_name = "cpu"
        self._sampling_error: str | None = None
        self._warned_mfu = False

    @property
    @override
    def state_key(self) -> str:
        # Lightning reads state_key on every hook call (for its profiler's action name): build it once per settings.
        settings = (self.window, self.warn_util_below, self.warn_data_wait_above)
        if self._state_key is None or self._state_key[0] != settings:
            key = self._generate_state_key(
                window=self.window, warn_util_below=self.warn_util_below, warn_data_wait_above=self.warn_data_wait_above
            )
            self._state_key = (settings, key)
        return self._state_key[1]

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._stop()
        self._reset()  # a checkpoint's state, if any, is loaded after this
        strategy, original = trainer.strategy, trainer.strategy.batch_to_device

        def timed_batch_to_device(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            out = original(*args, **kwargs)
            if self._timer is not None:
                self._timer.add_h2d(time.perf_counter() - start)
            return out

        strategy.batch_to_device = timed_batch_to_device  # type: ignore[method-assign]
        self._wrapped = (strategy, timed_batch_to_device)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        device = pl_module.device
        self._timer = StepTimer(self.window, device)
        self._timer.restore(self._base)
        self._cuda = device.type == "cuda"
        self._device_name = torch.cuda.get_device_name(device) if self._cuda else "cpu"
        loader = _first_loader(trainer.train_dataloader)
        if loader is not None:
            cores = cpu_info().available_cores
            self._loader = LoaderSettings.from_loader(loader, cores, trainer.num_devices, device.type)
        self._peak = self.peak_flops
        if self._peak is None and self._cuda:  # TF32's peak for a conv net in 32-true: cuDNN runs its convs in TF32
            self._peak = training_peak_flops(self._device_name, str(trainer.precision), pl_module)[0]
        self._retries = self._alloc_retries(device)
        self._start_sampling(self.sampler or open_sampler, device)

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
        if self._flops is None and self.flops_per_batch is None and self._peak is not None and first is not None:
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
            self._readings()  # notice a sampler that failed after the last window
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
        ``utilization``, ``mfu``, ``flops_per_batch``, ``peak_flops``, ``device``, ``loader`` (settings dict or
        None), ``sampling_error`` (why readings stopped, or why NVML was not used); figures not available are None.
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
            "total": {
                "steps": totals.steps,
                "samples": totals.samples,
                "data_wait_s": totals.data_wait_s,
                "h2d_s": totals.h2d_s,
                "compute_s": totals.compute_s,
                "data_wait_fraction": totals.data_wait_fraction,
                "h2d_fraction": totals.h2d_fraction,
                "samples_per_second": totals.samples_per_second,
            },
            "utilization": last.get("utilization"),
            "mfu": last.get("mfu"),
            "flops_per_batch": self.flops_per_batch or self._flops,
            "peak_flops": self._peak,
            "device": self._device_name,
            "loader": asdict(self._loader) if self._loader is not None else None,
            "sampling_error": self._sampling_error,
        }

    def _reset(self) -> None:
        self._timer = None
        self._thread = None
        self._wrapped = None
        self._loader = None
        self._base = WindowStats(0, 0, 0.0, 0.0, 0.0)
        self._batches = self._windows = self._retries = 0
        self._label = None
        self._advice = ""
        self._label_counts = {}
        self._last = {}
        self._flops = None
        self._flops_input = None
        self._peak = None
        self._cuda = False
        self._device_name = "cpu"
        self._sampling_error = None
        self._warned_mfu = False

    def _totals(self) -> WindowStats:
        return self._timer.total_stats() if self._timer is not None else self._base

    def _start_sampling(self, factory: Callable[[torch.device], DeviceSampler], device: torch.device) -> None:
        try:
            self._thread = SamplerThread(sampler := factory(device), self.sample_interval)
            self._sampling_error = self._sampling_error or getattr(sampler, "fallback_reason", None)
            self._thread.start()
        except Exception as err:  # no readings is no reason to stop training
            self._sampling_error = f"{type(err).__name__}: {err}"
            rank_zero_warn(f"UtilizationMonitor: device sampling unavailable ({self._sampling_error}).")
            self._thread = None

    def _readings(self) -> dict[str, float]:
        thread = self._thread
        if thread is None:
            return {}
        samples = thread.drain()
        if thread.error is not None and thread.error != self._sampling_error:  # once per failure
            self._sampling_error = thread.error
            rank_zero_warn(
                f"UtilizationMonitor: device sampling failed ({thread.error}); training goes on with the process's"
                " CPU and memory readings instead."
            )
            thread.stop()
            self._start_sampling(open_sampler, torch.device("cpu"))
        return _aggregate(samples)

    def _close_window(self, trainer: pl.Trainer) -> None:
        assert self._timer is not None  # only called while timing
        stats = self._timer.window_stats()
        if stats.steps == 0:
            return
        readings = self._readings()
        device_util = readings.get("gpu_utilization") if self._cuda else None
        retries_now = self._alloc_retries(trainer.strategy.root_device)
        retries, self._retries = retries_now - self._retries, retries_now
        step_time = stats.total_s / stats.steps
        (wait, h2d), util, slowest = median_fractions(self._timer.recent_steps()), device_util, None
        metrics: dict[str, float] = {}
        if trainer.world_size > 1:  # every rank gets here at the same batch: gather and judge by the worst rank
            mine = [wait, h2d, -1.0 if util is None else util, step_time, float(retries)]
            mine_t = torch.tensor(mine, dtype=torch.float64, device=trainer.strategy.root_device)
            rows = trainer.strategy.all_gather(mine_t).cpu().reshape(-1, len(mine))
            utils = rows[:, 2][rows[:, 2] >= 0]
            wait, h2d, retries = float(rows[:, 0].max()), float(rows[:, 1].max()), int(rows[:, 4].max())
            util = float(utils.min()) if len(utils) else None
            slowest = int(rows[:, 3].argmax())
            metrics.update(
                slowest_rank=float(slowest), step_time_max_s=float(rows[:, 3].max()), median_data_wait_fraction_max=wait
            )
            if len(utils):
                metrics.update(utilization_min=float(utils.min()), utilization_max=float(utils.max()))
        diagnosis = diagnose(wait, h2d, util, retries, self._loader, self.warn_util_below, self.warn_data_wait_above)
        self._windows += 1
        self._label_counts[diagnosis.label] = self._label_counts.get(diagnosis.label, 0) + 1
        if diagnosis.label != self._label:
            notify = rank_zero_info if diagnosis.label == "compute_bound" else rank_zero_warn
            notify(f"UtilizationMonitor: {diagnosis.advice}")
        self._label, self._advice = diagnosis.label, diagnosis.advice
        flops = self.flops_per_batch or self._flops
        value = mfu(flops, step_time, self._peak) if flops and self._peak else None
        if value is not None and value > 1 and not self._warned_mfu:
            self._warned_mfu = True
            rank_zero_warn(
                f"UtilizationMonitor: MFU {value:.2f} > 1 is impossible: the peak ({self._peak:.3g} FLOP/s for"
                f" {self._device_name!r}) or flops_per_batch ({flops:.3g}) is wrong; pass the right `peak_flops`."
            )
        metrics.update(
            data_wait_fraction=stats.data_wait_fraction,
            h2d_fraction=stats.h2d_fraction,
            step_time_s=step_time,
            samples_per_second=stats.samples_per_second,
            diagnosis=float(LABELS.index(diagnosis.label)),
            **readings,
        )
        if self._cuda:
            metrics["alloc_retries"] = float(retries)
        if value is not None:
            metrics["mfu"] = value
        self._last = {
            "median_data_wait_fraction": wait,
            "data_wait_fraction": stats.data_wait_fraction,
            "h2d_fraction": stats.h2d_fraction,
            "samples_per_second": stats.samples_per_second,
            "step_time_s": step_time,
            "steps": trainer.global_step,
            "utilization": readings.get("gpu_utilization", readings.get("cpu_utilization")),
            "mfu": value,
            "slowest_rank": slowest,
        }
        if trainer.is_global_zero:
            keyed = {f"speedkit/monitor/{name}": v for name, v in metrics.items()}
            for logger in trainer.loggers:
                logger.log_metrics(keyed, step=trainer.global_step)

    def _measure_flops(self, pl_module: pl.LightningModule, first: torch.Tensor) -> None:
        self._flops_input = None
        try:
            self._flops = float(measure_flops(pl_module, [first]))
        except Exception as err:  # an unusual forward signature: MFU is a nicety, not a reason to stop
            self._flops = None
            self._peak = None if self.flops_per_batch is None else self._peak
            rank_zero_warn(f"UtilizationMonitor: could not count FLOPs ({err}); pass `flops_per_batch` for MFU.")

    def _alloc_retries(self, device: torch.device) -> int:
        if device.type != "cuda":
            return 0
        return int(torch.cuda.memory_stats(device).get("num_alloc_retries", 0))

    def _stop(self) -> None:
        if self._thread is not None:
            self._thread.stop()
            self._thread = None
        if self._wrapped is not None:
            strategy, wrapper = self._wrapped
            if strategy.__dict__.get("batch_to_device") is wrapper:
                del strategy.batch_to_device
            self._wrapped = None


def _aggregate(samples: Sequence[DeviceSample]) -> dict[str, float]:
    """Mean utilisation, power and clock, peak memory and temperature of readings, under logged metric names."""
    gpu = [s for s in samples if s.device != "cpu"]
    cpu = [s for s in samples if s.device == "cpu"]
    out: dict[str, float] = {}

    def mean(values: list[float | None]) -> float | None:
        known = [v for v in values if v is not None]
        return sum(known) / len(known) if known else None

    def peak(values: list[float | int | None]) -> float | None:
        known = [float(v) for v in values if v is not None]
        return max(known) if known else None

    figures = {
        "gpu_utilization": mean([s.utilization for s in gpu]),
        "gpu_memory_used_gb": peak([s.memory_used_bytes for s in gpu]),
        "gpu_power_w": mean([s.power_w for s in gpu]),
        "gpu_temperature_c": peak([s.temperature_c for s in gpu]),
        "gpu_sm_clock_mhz": mean([s.sm_clock_mhz for s in gpu]),
        "cpu_utilization": mean([s.utilization for s in cpu]),
        "rss_gb": peak([s.memory_used_bytes for s in cpu]),
    }
    for name, value in figures.items():
        if value is not None:
            out[name] = value / 2**30 if name.endswith("_gb") else value
    return out


def _first_loader(loaders: Any) -> Any:
    """The first ``DataLoader`` in what ``trainer.train_dataloader`` holds (a loader, or a list/dict of them)."""
    if loaders is None or hasattr(loaders, "num_workers"):
        return loaders
    items = loaders.values() if isinstance(loaders, Mapping) else loaders if isinstance(loaders, (list, tuple)) else ()
    for item in items:
        found = _first_loader(item)
        if found is not None:
            return found
    return None
