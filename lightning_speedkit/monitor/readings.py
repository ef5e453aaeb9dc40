"""Device readings for the monitor: a background sampler, aggregated per window, that falls back if it fails."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from lightning.pytorch.utilities import rank_zero_warn

from lightning_speedkit.sampling import DeviceSample, DeviceSampler, SamplerThread, open_sampler

__all__ = ["DeviceReadings", "aggregate_readings"]


def aggregate_readings(samples: Sequence[DeviceSample]) -> dict[str, float]:
    """Mean utilisation, power and clock, peak memory and temperature of device readings, under logged names.

    Example:
        >>> from lightning_speedkit.sampling import DeviceSample
        >>> aggregate_readings([DeviceSample("cpu", 0.0, 0.5, 2**30), DeviceSample("cpu", 1.0, 0.7, 2**31)])
        {'cpu_utilization': 0.6, 'rss_gb': 2.0}
    """
    gpu = [s for s in samples if s.device != "cpu"]
    cpu = [s for s in samples if s.device == "cpu"]

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
    return {
        name: value / 2**30 if name.endswith("_gb") else value for name, value in figures.items() if value is not None
    }


class DeviceReadings:
    """Reads a device in a background `~lightning_speedkit.sampling.SamplerThread`; `take` aggregates what came in.

    If the sampler cannot be opened, there are no readings (and one warning); if it fails mid-run, one warning and
    the readings go on from this process's CPU and memory (`~lightning_speedkit.sampling.ProcessSampler`). Training
    goes on either way; ``error`` says why readings stopped, or why NVML was not used.

    Args:
        interval_s: Seconds between readings.

    Example:
        >>> readings = DeviceReadings(interval_s=0.01)
        >>> readings.start(open_sampler, torch.device("cpu"))
        >>> import time; time.sleep(0.15)  # a CPU share needs `MIN_CPU_INTERVAL_S` of readings
        >>> sorted(readings.take()), readings.error
        (['cpu_utilization', 'rss_gb'], None)
        >>> readings.stop()
    """

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self.error: str | None = None
        self._thread: SamplerThread | None = None

    def start(self, factory: Callable[[torch.device], DeviceSampler], device: torch.device) -> None:
        """Open the sampler for ``device`` and read it in the background."""
        try:
            sampler = factory(device)
        except Exception as err:  # no readings is no reason to stop training (a driver that fails, say)
            self.error = f"{type(err).__name__}: {err}"
            rank_zero_warn(f"UtilizationMonitor: device sampling unavailable ({self.error}).")
            self._thread = None
            return
        if not all(callable(getattr(sampler, method, None)) for method in ("sample", "close")):
            raise ValueError(
                f"`sampler` must return a DeviceSampler (with `sample()` and `close()`) for {device}, got {sampler!r}."
            )
        self._thread = SamplerThread(sampler, self.interval_s)
        self.error = self.error or getattr(sampler, "fallback_reason", None)
        self._thread.start()

    def take(self) -> dict[str, float]:
        """The readings since the last call, aggregated (`aggregate_readings`); switches to the process if failed."""
        thread = self._thread
        if thread is None:
            return {}
        samples = thread.drain()
        if thread.error is not None and thread.error != self.error:  # once per failure
            self.error = thread.error
            rank_zero_warn(
                f"UtilizationMonitor: device sampling failed ({thread.error}); training goes on with the process's"
                " CPU and memory readings instead."
            )
            thread.stop()
            self.start(open_sampler, torch.device("cpu"))
        return aggregate_readings(samples)

    def stop(self) -> None:
        """Stop reading (idempotent)."""
        if self._thread is not None:
            self._thread.stop()
            self._thread = None
