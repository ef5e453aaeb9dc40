"""Tests of ``lightning_speedkit.sampling``: device readings, the NVML seam and the background sampler thread."""

from __future__ import annotations

import sys
import time
import types
import warnings
from typing import Any

import pytest
import torch

from lightning_speedkit.hardware import nvml_status
from lightning_speedkit.sampling import (
    MIN_CPU_INTERVAL_S,
    DeviceSample,
    DeviceSampler,
    NvmlSampler,
    ProcessSampler,
    SamplerThread,
    open_sampler,
)
from lightning_speedkit.sampling import _cuda_ids as cuda_ids
from lightning_speedkit.sampling import _nvml_handle as nvml_handle


class FlakySampler:
    """Stands in for NVML at the `DeviceSampler` seam: one GPU-like reading, then the driver fails."""

    def __init__(self, good: int = 1) -> None:
        self.good = good
        self.calls = 0
        self.closed = 0

    def sample(self) -> list[DeviceSample]:
        """A reading while calls remain, then an NVML-like error."""
        self.calls += 1
        if self.calls > self.good:
            raise RuntimeError("NVML_ERROR_GPU_IS_LOST")
        return [DeviceSample("cuda:0", time.monotonic(), 0.5, 2**30, 2**34, 250.0, 60.0, 1800.0)]

    def close(self) -> None:
        """Count the closes."""
        self.closed += 1


def test_process_sampler_reads_this_process() -> None:
    """Without a GPU the process reading gives a CPU share in [0, 1] and a resident size within the machine's memory.

    The share is None at once (psutil read 0.0 over the microseconds since the sampler opened: a short fit reported
    0% utilization), and read once `MIN_CPU_INTERVAL_S` of this process's work has passed.
    """
    sampler = ProcessSampler()
    assert isinstance(sampler, DeviceSampler)
    assert sampler.sample()[0].utilization is None
    began = time.monotonic()
    while time.monotonic() - began < 1.5 * MIN_CPU_INTERVAL_S:
        sum(range(10_000))  # busy: a share above 0
    (reading,) = sampler.sample()
    assert reading.device == "cpu"
    assert reading.utilization is not None
    assert 0.0 < reading.utilization <= 1.0
    assert reading.memory_used_bytes is not None
    assert reading.memory_total_bytes is not None
    assert 0 < reading.memory_used_bytes < reading.memory_total_bytes
    assert reading.power_w is None
    assert reading.temperature_c is None
    assert reading.sm_clock_mhz is None
    sampler.close()


class FakeNvml(types.ModuleType):
    """Stands in for ``pynvml`` at the one NVML seam: four GPUs, known by NVML index, UUID and PCI bus id."""

    class NVMLError(Exception):
        """NVML's error type."""

    NVML_TEMPERATURE_GPU = 0
    NVML_CLOCK_SM = 1

    def __init__(self, fail_init: str | None = None, count: int = 4) -> None:
        super().__init__("pynvml")
        self.fail_init, self.count, self.shutdowns = fail_init, count, 0

    def nvmlInit(self) -> None:
        """Fail like a missing driver library when told to."""
        if self.fail_init is not None:
            raise self.NVMLError(self.fail_init)

    def nvmlShutdown(self) -> None:
        """Count shutdowns."""
        self.shutdowns += 1

    def nvmlDeviceGetCount(self) -> int:
        """The GPUs NVML sees (all of the machine's)."""
        return self.count

    def nvmlDeviceGetHandleByIndex(self, index: int) -> str:
        """``"nvml<i>"`` for an NVML index."""
        if not 0 <= index < self.count:
            raise self.NVMLError("NVML_ERROR_INVALID_ARGUMENT")
        return f"nvml{index}"

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> str:
        """Only ``GPU-uuid<i>`` is known."""
        if uuid.startswith("GPU-uuid") and uuid[8:].isdigit():
            return self.nvmlDeviceGetHandleByIndex(int(uuid[8:]))
        raise self.NVMLError("NVML_ERROR_NOT_FOUND")

    def nvmlDeviceGetHandleByPciBusId(self, bus: str) -> str:
        """Only ``00000000:0<i>:00.0`` is known."""
        if bus.startswith("00000000:0") and bus.endswith(":00.0"):
            return self.nvmlDeviceGetHandleByIndex(int(bus[10]))
        raise self.NVMLError("NVML_ERROR_NOT_FOUND")


@pytest.mark.parametrize(
    ("ids", "env", "count", "expected"),
    [
        (("uuid2", ""), {"CUDA_VISIBLE_DEVICES": "2,3"}, 4, "nvml2"),  # torch's UUID lacks NVML's "GPU-" prefix
        (("GPU-uuid3", ""), {}, 4, "nvml3"),
        (("unknown", "00000000:01:00.0"), {"CUDA_VISIBLE_DEVICES": "1"}, 4, "nvml1"),  # then the PCI bus id
        (("", ""), {"CUDA_VISIBLE_DEVICES": "3"}, 1, "nvml0"),  # one GPU in sight: it is the one
        (("", ""), {"CUDA_VISIBLE_DEVICES": "2,3", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}, 4, "nvml2"),  # translated
        (("", ""), {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}, 4, "nvml0"),
    ],
)
def test_nvml_handle_finds_the_cuda_device(
    ids: tuple[str, str], env: dict[str, str], count: int, expected: str
) -> None:
    """CUDA device 0 is found by UUID, else PCI bus id, else an index that cannot name another GPU, silently."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert nvml_handle(FakeNvml(count=count), 0, ids, env) == expected


@pytest.mark.parametrize(
    ("props", "expected"),
    [
        ({"uuid": "abc", "pci_domain_id": 0, "pci_bus_id": 0x3B, "pci_device_id": 0}, ("abc", "00000000:3B:00.0")),
        ({"uuid": "abc"}, ("abc", "")),  # a torch without the PCI fields: the UUID alone
    ],
)
def test_cuda_ids_in_nvml_form(
    monkeypatch: pytest.MonkeyPatch, props: dict[str, Any], expected: tuple[str, str]
) -> None:
    """The device properties torch gives become the UUID and the ``domain:bus:device.function`` bus id NVML looks up."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: types.SimpleNamespace(**props))
    assert cuda_ids(0) == expected


@pytest.mark.parametrize(
    "env",
    [{"CUDA_VISIBLE_DEVICES": "2,3"}, {"CUDA_VISIBLE_DEVICES": "GPU-abc"}, {"CUDA_VISIBLE_DEVICES": "MIG-1,2"}],
)
def test_nvml_handle_refuses_to_guess_under_cuda_visible_devices(env: dict[str, str]) -> None:
    """When only the index is left and CUDA_VISIBLE_DEVICES renumbers the GPUs, it refuses instead of reading NVML 0."""
    with pytest.raises(RuntimeError, match="CUDA_VISIBLE_DEVICES"):
        nvml_handle(FakeNvml(), 0, ("", ""), env)


def test_nvml_handle_warns_when_the_orders_may_differ() -> None:
    """Without CUDA_VISIBLE_DEVICES or PCI order, several GPUs read by index come with a warning saying what to set."""
    with pytest.warns(RuntimeWarning, match="CUDA_DEVICE_ORDER=PCI_BUS_ID"):
        assert nvml_handle(FakeNvml(), 1, ("", ""), {}) == "nvml1"


def test_nvml_sampler_refuses_the_wrong_gpu_and_open_sampler_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the real NvmlSampler: a refused device shuts NVML down, and open_sampler falls back with the reason."""
    fake = FakeNvml()
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)
    monkeypatch.setattr("lightning_speedkit.sampling._cuda_ids", lambda index: ("", ""))
    with pytest.raises(RuntimeError, match="cannot tell which of 4 NVML devices is CUDA device 0"):
        NvmlSampler([0])
    assert fake.shutdowns == 1
    with pytest.warns(RuntimeWarning, match="NVML unavailable for cuda:0"):
        sampler = open_sampler("cuda:0")
    assert isinstance(sampler, ProcessSampler)
    assert sampler.fallback_reason is not None
    assert "CUDA_VISIBLE_DEVICES='2,3'" in sampler.fallback_reason


@pytest.mark.parametrize(
    ("module", "match"),
    [
        (FakeNvml(fail_init="NVML Shared Library Not Found"), "nvmlInit failed: NVML Shared Library Not Found"),
        (None, "needs nvidia-ml-py"),  # nvidia-ml-py not installed
    ],
)
def test_open_sampler_reports_an_nvml_that_fails_to_load(
    monkeypatch: pytest.MonkeyPatch, module: Any, match: str
) -> None:
    """A CUDA device whose NVML fails to load is not skipped silently: a warning and the sampler both say why."""
    monkeypatch.setitem(sys.modules, "pynvml", module)  # None makes `import pynvml` raise ImportError
    with pytest.warns(RuntimeWarning, match=match):
        sampler = open_sampler("cuda:0")
    assert isinstance(sampler, ProcessSampler)
    assert sampler.fallback_reason is not None
    assert match in sampler.fallback_reason
    ok, reason = nvml_status()
    assert not ok
    assert reason.startswith(("nvmlInit failed", "nvidia-ml-py is not installed"))
    assert isinstance(open_sampler("cpu"), ProcessSampler)  # the CPU never needed NVML: no reason to report


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only fallback")
def test_open_sampler_falls_back_without_nvml() -> None:
    """On this machine (no driver) a CUDA device gets the process sampler and a warning, not an error."""
    assert isinstance(open_sampler("cpu"), ProcessSampler)
    with pytest.warns(RuntimeWarning, match="NVML unavailable"):
        assert isinstance(open_sampler("cuda:0"), ProcessSampler)
    with pytest.raises((RuntimeError, ImportError), match=r"nvmlInit|nvidia-ml-py"):
        NvmlSampler([0])


def test_sampler_thread_collects_and_stops() -> None:
    """Readings come out once each through `drain`; `stop` ends the thread, closes the sampler once, and repeats."""
    sampler = FlakySampler(good=10**9)
    thread = SamplerThread(sampler, interval_s=0.001)
    thread.start()
    while sampler.calls < 3:
        time.sleep(0.001)
    thread.stop()
    thread.stop()
    first = thread.drain()
    assert len(first) >= 3
    assert all(reading.utilization == 0.5 for reading in first)
    assert thread.drain() == []
    assert not thread.is_alive()
    assert (thread.error, sampler.closed) == (None, 1)


def test_sampler_thread_survives_a_failing_driver() -> None:
    """A sampler that raises mid-run ends the thread with the error recorded and the sampler closed, never raising."""
    sampler = FlakySampler(good=2)
    thread = SamplerThread(sampler, interval_s=0.001)
    thread.start()
    thread._thread.join(timeout=30)  # it ends by itself once the sampler raises
    assert not thread.is_alive()
    assert thread.error == "RuntimeError: NVML_ERROR_GPU_IS_LOST"
    assert len(thread.drain()) == 2
    thread.stop()
    assert sampler.closed == 1


def test_sampler_thread_checks_its_interval() -> None:
    """A non-positive interval is refused with the argument's name."""
    with pytest.raises(ValueError, match="`interval_s`"):
        SamplerThread(ProcessSampler(), interval_s=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_real_nvml_sampler() -> None:
    """On a real GPU, NVML gives utilisation, memory, power, temperature and SM clock in plausible ranges."""
    assert isinstance(open_sampler("cuda:0"), NvmlSampler)
    sampler = NvmlSampler([0])
    x = torch.randn(4096, 4096, device="cuda")
    for _ in range(20):
        x = (x @ x).clamp_(-1, 1)
    (reading,) = sampler.sample()
    sampler.close()
    assert reading.device == "cuda:0"
    assert reading.utilization is not None
    assert 0.0 <= reading.utilization <= 1.0
    assert reading.memory_total_bytes == pytest.approx(torch.cuda.get_device_properties(0).total_memory, rel=0.1)
    assert reading.memory_used_bytes is not None
    assert 0 < reading.memory_used_bytes <= reading.memory_total_bytes
    assert reading.temperature_c is not None
    assert 0 < reading.temperature_c < 120
    assert reading.sm_clock_mhz is not None
    assert reading.sm_clock_mhz > 0
    assert reading.power_w is None or reading.power_w > 0
