from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from lightning_speedkit.hardware import (
    BF16_CPU_FLAGS,
    DeviceSample,
    DeviceSampler,
    GpuInfo,
    NvmlSampler,
    ProcessSampler,
    SamplerThread,
    cpu_info,
    gpu_infos,
    has_tensor_cores,
    nvml_status,
    open_sampler,
    parse_cpu_flags,
    supports_bf16,
)

SAPPHIRE_RAPIDS = """\
processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu sse2 avx2 avx512f avx512_bf16 amx_bf16 amx_tile amx_int8

processor\t: 1
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu sse2 avx2 avx512f avx512_bf16 amx_bf16 amx_tile amx_int8
"""

EPYC = """\
processor\t: 0
model name\t: AMD EPYC
flags\t\t: fpu sse2 fma avx2 avx512f avx512_bf16 avx512_vnni
"""

ARM = """\
processor\t: 0
BogoMIPS\t: 243.75
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics bf16 sve
"""

MIXED = """\
processor\t: 0
flags\t\t: fpu avx2 avx512f
processor\t: 1
flags\t\t: fpu avx2
"""


@pytest.mark.parametrize(
    ("text", "present", "absent"),
    [
        (SAPPHIRE_RAPIDS, {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}, set()),
        (EPYC, {"avx2", "avx512f", "avx512_bf16"}, {"amx_bf16", "amx_tile"}),
        (ARM, {"asimd", "bf16", "sve"}, {"avx2"}),
        (MIXED, {"fpu", "avx2"}, {"avx512f"}),
        ("", set(), {"avx2"}),
        ("model name\t: no flags line here\n", set(), {"model"}),
    ],
)
def test_parse_cpu_flags(text: str, present: set[str], absent: set[str]) -> None:
    """Flags come from the `flags`/`Features` lines, only those every processor has."""
    flags = parse_cpu_flags(text)
    assert present <= flags
    assert not absent & flags


@pytest.mark.parametrize(
    ("capability", "bf16", "tensor_cores"),
    [
        ((6, 1), False, False),
        ((7, 0), False, True),
        ((7, 5), False, True),
        ((8, 0), True, True),
        ((8, 9), True, True),
        ((9, 0), True, True),
        ((10, 0), True, True),
    ],
)
def test_gpu_capability_rules(capability: tuple[int, int], bf16: bool, tensor_cores: bool) -> None:
    """bf16 needs compute capability >= 8.0 and tensor cores >= 7.0, and `GpuInfo` derives both from its capability."""
    assert supports_bf16(capability) is bf16
    assert has_tensor_cores(capability) is tensor_cores
    info = GpuInfo(0, "fake", capability, 2**30)
    assert (info.bf16, info.tensor_cores) == (bf16, tensor_cores)


@pytest.mark.parametrize(
    ("text", "flags", "has_amx"),
    [(SAPPHIRE_RAPIDS, BF16_CPU_FLAGS, True), (EPYC, ("avx2", "avx512f", "avx512_bf16"), False)],
)
def test_cpu_info_reads_given_cpuinfo(tmp_path: Path, text: str, flags: tuple[str, ...], has_amx: bool) -> None:
    """`cpu_info` keeps only the bf16-relevant flags, in BF16_CPU_FLAGS order, and reads the model name."""
    path = tmp_path / "cpuinfo"
    path.write_text(text)
    info = cpu_info(path)
    assert info.flags == flags
    assert info.has_amx_bf16 is has_amx
    assert info.model == text.split("model name\t: ")[1].splitlines()[0]


def test_cpu_info_falls_back_to_torch_without_proc_cpuinfo(tmp_path: Path) -> None:
    """Without /proc/cpuinfo the flags are the lower bound torch's CPU capability implies, never bf16 or AMX."""
    info = cpu_info(tmp_path / "missing")
    expected = {"AVX2": ("avx2",), "AVX512": ("avx2", "avx512f")}.get(torch.backends.cpu.get_cpu_capability(), ())
    assert info.flags == expected
    assert not info.has_amx_bf16


def test_cpu_info_on_this_machine() -> None:
    """On the real machine the core counts agree with the OS and the capability with torch."""
    info = cpu_info()
    assert info.logical_cores == os.cpu_count()
    assert 1 <= info.available_cores <= info.logical_cores
    assert info.torch_capability == torch.backends.cpu.get_cpu_capability()
    assert set(info.flags) <= set(BF16_CPU_FLAGS)


def test_nvml_status_never_raises() -> None:
    """`nvml_status` returns a bool and a non-empty reason on any machine."""
    ok, reason = nvml_status()
    assert isinstance(ok, bool)
    assert reason


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only answer")
def test_cpu_only_machine_has_no_gpus() -> None:
    """Without CUDA there are no GPUs and NVML does not answer, with a reason saying why."""
    assert gpu_infos() == []
    ok, reason = nvml_status()
    assert ok is False
    assert reason


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_real_gpu_info_and_nvml() -> None:
    """Each CUDA device is reported with torch's name, capability and memory, and NVML answers."""
    infos = gpu_infos()
    assert [info.index for info in infos] == list(range(torch.cuda.device_count()))
    for info in infos:
        assert info.name == torch.cuda.get_device_name(info.index)
        assert info.capability == torch.cuda.get_device_capability(info.index)
        assert info.total_memory_bytes == torch.cuda.get_device_properties(info.index).total_memory > 0
        assert info.bf16 is supports_bf16(info.capability)
    ok, reason = nvml_status()
    assert ok, reason
    assert reason.startswith("driver ")


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
    """Without a GPU the process reading gives a CPU share in [0, 1] and a resident size within the machine's memory."""
    sampler = ProcessSampler()
    assert isinstance(sampler, DeviceSampler)
    (reading,) = sampler.sample()
    assert reading.device == "cpu"
    assert reading.utilization is not None
    assert 0.0 <= reading.utilization <= 1.0
    assert reading.memory_used_bytes is not None
    assert reading.memory_total_bytes is not None
    assert 0 < reading.memory_used_bytes < reading.memory_total_bytes
    assert reading.power_w is None
    assert reading.temperature_c is None
    assert reading.sm_clock_mhz is None
    sampler.close()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only fallback")
def test_open_sampler_falls_back_without_nvml() -> None:
    """Asking for a CUDA device where NVML cannot start gives the process sampler, not an error."""
    assert isinstance(open_sampler("cpu"), ProcessSampler)
    assert isinstance(open_sampler("cuda:0"), ProcessSampler)
    with pytest.raises(RuntimeError, match="nvmlInit"):
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
