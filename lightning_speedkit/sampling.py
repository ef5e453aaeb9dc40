"""Live device readings: what a CUDA device (through NVML) or this process (CPU share, memory) is doing right now.

Facts that do not change during a run (cores, ISA flags, GPU capability) live in `lightning_speedkit.hardware`;
this module samples. Every reading goes through the `DeviceSampler` protocol, the one seam tests replace with a fake:
`NvmlSampler` for CUDA devices, `ProcessSampler` (this process's CPU and memory) everywhere else, `open_sampler` to
pick one, and `SamplerThread` to read one in the background.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from lightning_speedkit.hardware import cpu_info

log = logging.getLogger(__name__)

__all__ = ["DeviceSample", "DeviceSampler", "NvmlSampler", "ProcessSampler", "SamplerThread", "open_sampler"]


@dataclass(frozen=True)
class DeviceSample:
    """One reading of one device; a field is None when the device or sampler cannot tell.

    Args:
        device: ``"cuda:<index>"`` for a GPU, ``"cpu"`` for this process's share of the CPU.
        time_s: ``time.monotonic()`` when read.
        utilization: In [0, 1]: the share of time a kernel ran (GPU), or the process's CPU time over wall time
            divided by the cores it may use (CPU).
        memory_used_bytes: Device memory in use (GPU, all processes), or this process's resident memory (CPU).
        memory_total_bytes: Device memory (GPU), or the machine's memory (CPU).
        power_w: Board power draw in watts.
        temperature_c: GPU temperature in degrees Celsius.
        sm_clock_mhz: Streaming-multiprocessor clock in MHz.
    """

    device: str
    time_s: float
    utilization: float | None = None
    memory_used_bytes: int | None = None
    memory_total_bytes: int | None = None
    power_w: float | None = None
    temperature_c: float | None = None
    sm_clock_mhz: float | None = None


@runtime_checkable
class DeviceSampler(Protocol):
    """Reads the devices it was opened for; the one interface tests replace (with a fake) instead of NVML."""

    def sample(self) -> list[DeviceSample]:
        """One reading per device; may raise if the driver fails (callers handle that)."""
        ...

    def close(self) -> None:
        """Release the driver; the sampler is not used afterwards."""
        ...


class NvmlSampler:
    """Reads utilisation, memory, power, temperature and SM clock of CUDA devices through NVML (nvidia-ml-py).

    CUDA indices are mapped to NVML devices by UUID, else by PCI bus id, so ``CUDA_VISIBLE_DEVICES`` is respected.
    When neither is found, the CUDA index is used only where it cannot name another GPU (`_nvml_handle` says when);
    otherwise this refuses rather than watch the wrong GPU.

    Args:
        indices: CUDA device indices (as torch numbers them) to read.

    Raises:
        ImportError: If nvidia-ml-py is not installed (names the extra to install).
        RuntimeError: If NVML cannot be initialised (no driver), or a device cannot be told apart from the others,
            with the reason.
    """

    def __init__(self, indices: Sequence[int]) -> None:
        try:
            import pynvml
        except ImportError as err:
            raise ImportError('NvmlSampler needs nvidia-ml-py: pip install "lightning-speedkit[gpu]"') from err
        try:
            pynvml.nvmlInit()
        except Exception as err:  # NVMLError or OSError: say why, as one error type
            raise RuntimeError(f"NvmlSampler: nvmlInit failed: {err}") from err
        self._nvml: Any = pynvml
        try:
            self._handles = [(index, _nvml_handle(pynvml, index)) for index in indices]
        except Exception as err:  # NVMLError, or a refusal to guess the device: release NVML, one error type
            with contextlib.suppress(Exception):
                pynvml.nvmlShutdown()
            if isinstance(err, RuntimeError):
                raise
            raise RuntimeError(f"NvmlSampler: no NVML device for CUDA device(s) {list(indices)}: {err}") from err
        self._closed = False

    def sample(self) -> list[DeviceSample]:
        """One reading per device; a query the device does not support (e.g. power on some boards) gives None."""
        nvml, now, out = self._nvml, time.monotonic(), []
        for index, handle in self._handles:
            util = nvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100.0  # the one reading that must work
            memory = nvml.nvmlDeviceGetMemoryInfo(handle)
            power = _optional(nvml.nvmlDeviceGetPowerUsage, handle)  # milliwatts
            temp = _optional(nvml.nvmlDeviceGetTemperature, handle, nvml.NVML_TEMPERATURE_GPU)
            clock = _optional(nvml.nvmlDeviceGetClockInfo, handle, nvml.NVML_CLOCK_SM)
            power = None if power is None else power / 1000.0
            out.append(
                DeviceSample(f"cuda:{index}", now, util, int(memory.used), int(memory.total), power, temp, clock)
            )
        return out

    def close(self) -> None:
        """Shut NVML down (once)."""
        if not self._closed:
            self._closed = True
            with contextlib.suppress(Exception):
                self._nvml.nvmlShutdown()


MIN_CPU_INTERVAL_S = 0.1
"""The shortest interval a CPU share is read over: the sampler thread's first reading came microseconds after the
sampler was opened, and psutil read 0.0 there (a short fit's monitor then reported 0% utilization)."""


class ProcessSampler:
    """This process's CPU use and resident memory (psutil): the reading when there is no GPU or no NVML.

    Args:
        fallback_reason: Why this reading stands in for a GPU's (`open_sampler` sets it when NVML fails), else None.

    Example:
        >>> sampler = ProcessSampler()
        >>> [s.device for s in sampler.sample()], sampler.fallback_reason
        (['cpu'], None)
    """

    def __init__(self, fallback_reason: str | None = None) -> None:
        import psutil

        self.fallback_reason = fallback_reason
        self._process = psutil.Process()
        self._process.cpu_percent(None)  # the first call only starts the measurement interval
        self._since = time.monotonic()
        self._total = int(psutil.virtual_memory().total)
        self._cores = cpu_info().available_cores

    def sample(self) -> list[DeviceSample]:
        """One reading of this process: CPU share of the cores it may use, and resident memory.

        The share is None until `MIN_CPU_INTERVAL_S` has passed since the last one was read.
        """
        now, busy = time.monotonic(), None
        if now - self._since >= MIN_CPU_INTERVAL_S:  # over a shorter interval psutil reads 0.0 (or a capped 1.0)
            busy, self._since = min(1.0, self._process.cpu_percent(None) / 100.0 / self._cores), now
        return [DeviceSample("cpu", now, busy, int(self._process.memory_info().rss), self._total)]

    def close(self) -> None:
        """Nothing to release."""


def open_sampler(device: torch.device | str) -> DeviceSampler:
    """The best sampler for ``device``: `NvmlSampler` for a CUDA device when NVML works, else `ProcessSampler`.

    Never raises for a missing GPU, driver or nvidia-ml-py. A CUDA device whose NVML fails is not skipped silently:
    a ``RuntimeWarning`` says why, and the `ProcessSampler` returned carries the reason in ``fallback_reason``.

    Example:
        >>> type(open_sampler("cpu")).__name__
        'ProcessSampler'
    """
    device = torch.device(device)
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        try:
            return NvmlSampler([index])
        except (ImportError, RuntimeError) as err:
            reason = f"NVML unavailable for {device}: {err}"
            warnings.warn(
                f"open_sampler: {reason}; reading this process's CPU and memory instead (no GPU utilisation, memory,"
                " power, temperature or clock readings).",
                RuntimeWarning,
                stacklevel=2,
            )
            return ProcessSampler(fallback_reason=reason)
    return ProcessSampler()


class SamplerThread:
    """Reads a `DeviceSampler` every ``interval_s`` seconds in a daemon thread and keeps the readings until drained.

    If the sampler raises, the thread records the error in ``error``, closes the sampler and ends; training goes
    on. `stop` is idempotent and always closes the sampler.

    Args:
        sampler: What to read.
        interval_s: Seconds between readings.
        max_samples: Readings kept until `drain` (older ones are dropped).

    Example:
        >>> thread = SamplerThread(ProcessSampler(), interval_s=0.01)
        >>> thread.start(); time.sleep(0.05); thread.stop()
        >>> len(thread.drain()) > 0, thread.error, thread.is_alive()
        (True, None, False)
    """

    def __init__(self, sampler: DeviceSampler, interval_s: float = 0.5, max_samples: int = 10_000) -> None:
        if not interval_s > 0:
            raise ValueError(f"`interval_s` must be positive, got {interval_s!r}.")
        self.sampler = sampler
        self.interval_s = interval_s
        self.error: str | None = None
        self._samples: deque[DeviceSample] = deque(maxlen=max_samples)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="speedkit-device-sampler", daemon=True)
        self._closed = False

    def start(self) -> None:
        """Take the first reading now, in the background, and then one every ``interval_s``."""
        self._thread.start()

    def is_alive(self) -> bool:
        """Whether the thread is still reading."""
        return self._thread.is_alive()

    def drain(self) -> list[DeviceSample]:
        """The readings since the last call, oldest first."""
        with self._lock:
            out = list(self._samples)
            self._samples.clear()
        return out

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the thread, wait for it (up to ``timeout_s``) and close the sampler."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)
        self._close()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                readings = self.sampler.sample()
            except Exception as err:  # a driver failing mid-run must not reach the training loop
                self.error = f"{type(err).__name__}: {err}"
                break
            with self._lock:
                self._samples.extend(readings)
            self._stop.wait(self.interval_s)
        self._close()

    def _close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        with contextlib.suppress(Exception):
            self.sampler.close()


def _cuda_ids(index: int) -> tuple[str, str]:
    """The UUID and PCI bus id (``domain:bus:device.0``) torch gives CUDA device ``index``; ``""`` where unknown."""
    if not torch.cuda.is_available():
        return "", ""
    props = torch.cuda.get_device_properties(index)
    pci: list[int] = [getattr(props, f"pci_{part}_id", -1) for part in ("domain", "bus", "device")]
    bus = "" if -1 in pci else "{:08X}:{:02X}:{:02X}.0".format(*pci)
    return str(getattr(props, "uuid", "") or ""), bus


def _nvml_handle(
    pynvml: Any, index: int, ids: tuple[str, str] | None = None, env: Mapping[str, str] | None = None
) -> Any:
    """The NVML handle of CUDA device ``index`` (``ids``: its UUID and PCI bus id, default `_cuda_ids`).

    By UUID, else by PCI bus id. Failing both, NVML's numbering (every GPU, in PCI order) may not be CUDA's (the
    visible ones, fastest first unless ``CUDA_DEVICE_ORDER=PCI_BUS_ID``), so the index is used only where it cannot
    name another GPU: NVML sees one device; no ``CUDA_VISIBLE_DEVICES`` (with a warning unless PCI order is set); or
    plain indices in ``CUDA_VISIBLE_DEVICES`` under PCI order, translated. Otherwise RuntimeError: watching the wrong
    GPU is worse than watching none.
    """
    uuid, bus = _cuda_ids(index) if ids is None else ids
    lookups = [(pynvml.nvmlDeviceGetHandleByUUID, key) for key in ((uuid, f"GPU-{uuid}") if uuid else ())]
    lookups += [(pynvml.nvmlDeviceGetHandleByPciBusId, bus)] if bus else []
    for lookup, key in lookups:
        with contextlib.suppress(Exception):
            return lookup(key)
    env = os.environ if env is None else env
    count, visible = int(pynvml.nvmlDeviceGetCount()), env.get("CUDA_VISIBLE_DEVICES")
    pci_order = env.get("CUDA_DEVICE_ORDER") == "PCI_BUS_ID"
    if count == 1:
        return pynvml.nvmlDeviceGetHandleByIndex(0)
    if visible is None:
        if not pci_order:
            warnings.warn(
                f"NvmlSampler: CUDA device {index} is read as NVML device {index} (no UUID or PCI bus id matched);"
                f" CUDA may number the {count} GPUs differently: set CUDA_DEVICE_ORDER=PCI_BUS_ID to be sure.",
                RuntimeWarning,
                stacklevel=3,
            )
        return pynvml.nvmlDeviceGetHandleByIndex(index)
    entries = [entry.strip() for entry in visible.split(",")]
    if pci_order and index < len(entries) and entries[index].isdigit():
        return pynvml.nvmlDeviceGetHandleByIndex(int(entries[index]))
    raise RuntimeError(
        f"NvmlSampler: cannot tell which of {count} NVML devices is CUDA device {index}: no UUID or PCI bus id"
        f" matched, and CUDA_VISIBLE_DEVICES={visible!r} renumbers the GPUs; not reading a GPU that may be another"
        " (plain indices in CUDA_VISIBLE_DEVICES with CUDA_DEVICE_ORDER=PCI_BUS_ID let it translate them)."
    )


def _optional(read: Callable[..., Any], *args: Any) -> float | None:
    """``read(*args)`` as a float, or None when the device does not support that query."""
    try:
        return float(read(*args))
    except Exception:
        return None
