"""What this machine has: CPU cores and ISA features, CUDA GPUs, and whether NVML answers.

This is the one seam between speedkit and the hardware's facts. Everything here reads facts and never raises on a
machine that lacks a GPU, NVML or ``/proc/cpuinfo``; callers receive plain frozen dataclasses. What the devices are
doing right now (utilisation, memory, power) is read by `lightning_speedkit.sampling`; what speedkit decides from
these facts is in `lightning_speedkit.machine`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import platform
from dataclasses import dataclass, field
from pathlib import Path

import torch

log = logging.getLogger(__name__)

__all__ = [
    "BF16_CPU_FLAGS",
    "CpuInfo",
    "GpuInfo",
    "cpu_info",
    "gpu_infos",
    "has_tensor_cores",
    "nvml_status",
    "parse_cpu_flags",
    "supports_bf16",
]

BF16_CPU_FLAGS: tuple[str, ...] = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")
"""The ``/proc/cpuinfo`` flags that decide whether bf16 is worth using on a CPU, weakest first."""

_PROC_CPUINFO = Path("/proc/cpuinfo")

# What torch.backends.cpu.get_cpu_capability() implies when /proc/cpuinfo is missing (macOS, Windows): a lower bound.
_FLAGS_FROM_TORCH_CAPABILITY: dict[str, frozenset[str]] = {
    "AVX2": frozenset({"avx2"}),
    "AVX512": frozenset({"avx2", "avx512f"}),
}


def parse_cpu_flags(text: str) -> frozenset[str]:
    r"""CPU feature flags from the text of ``/proc/cpuinfo`` (``flags`` on x86, ``Features`` on Arm).

    With several processors listed, only the flags that every one of them has are kept, since this process may run
    on any of them.

    Args:
        text: the contents of ``/proc/cpuinfo``.

    Returns:
        The flags, lower case; empty when the text lists none.

    Example:
        >>> text = "processor\t: 0\nflags\t\t: fpu avx2 amx_bf16\n\nprocessor\t: 1\nflags\t\t: fpu avx2\n"
        >>> sorted(parse_cpu_flags(text))
        ['avx2', 'fpu']
        >>> parse_cpu_flags("")
        frozenset()
    """
    common: frozenset[str] | None = None
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if not sep or key.strip().lower() not in ("flags", "features"):
            continue
        flags = frozenset(value.lower().split())
        common = flags if common is None else common & flags
    return common or frozenset()


def supports_bf16(capability: tuple[int, int]) -> bool:
    """Whether a CUDA GPU of this compute capability runs bf16 on tensor cores (Ampere, 8.0, and later).

    Example:
        >>> supports_bf16((8, 0)), supports_bf16((7, 5))
        (True, False)
    """
    return capability >= (8, 0)


def has_tensor_cores(capability: tuple[int, int]) -> bool:
    """Whether a CUDA GPU of this compute capability has tensor cores (Volta, 7.0, and later).

    Example:
        >>> has_tensor_cores((7, 0)), has_tensor_cores((6, 1))
        (True, False)
    """
    return capability >= (7, 0)


@dataclass(frozen=True)
class CpuInfo:
    """The CPU as this process sees it.

    Args:
        logical_cores: logical cores in the machine (``os.cpu_count()``).
        available_cores: cores this process may run on (its affinity mask where the OS has one), at most
            ``logical_cores`` on a plain machine; containers can lower it further.
        model: the CPU model name, or ``""`` when the OS does not say.
        flags: which of :data:`BF16_CPU_FLAGS` the CPU has, in that order.
        torch_capability: ``torch.backends.cpu.get_cpu_capability()``, the kernel set torch dispatches to.
    """

    logical_cores: int
    available_cores: int
    model: str
    flags: tuple[str, ...]
    torch_capability: str

    @property
    def has_amx_bf16(self) -> bool:
        """Whether the CPU has AMX with bf16 (Intel Sapphire Rapids and later)."""
        return "amx_bf16" in self.flags

    @property
    def bf16_instructions(self) -> list[str]:
        """The CPU's bf16 instructions (``avx512_bf16``, ``amx_bf16``): without them bf16 autocast is emulated.

        Example:
            >>> CpuInfo(2, 2, "EPYC", ("avx2", "avx512_bf16"), "AVX512").bf16_instructions
            ['avx512_bf16']
        """
        return [flag for flag in ("avx512_bf16", "amx_bf16") if flag in self.flags]


@dataclass(frozen=True)
class GpuInfo:
    """One CUDA device; ``bf16`` and ``tensor_cores`` follow from ``capability``.

    Args:
        index: the CUDA device index.
        name: the device name, e.g. ``"NVIDIA H100 80GB HBM3"``.
        capability: the compute capability, e.g. ``(9, 0)``.
        total_memory_bytes: the device's total memory.

    Example:
        >>> GpuInfo(0, "Tesla V100", (7, 0), 16 * 2**30).bf16
        False
    """

    index: int
    name: str
    capability: tuple[int, int]
    total_memory_bytes: int
    bf16: bool = field(init=False)
    tensor_cores: bool = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "bf16", supports_bf16(self.capability))
        object.__setattr__(self, "tensor_cores", has_tensor_cores(self.capability))


def cpu_info(proc_cpuinfo: str | os.PathLike[str] = _PROC_CPUINFO) -> CpuInfo:
    """Read this machine's CPU facts.

    Args:
        proc_cpuinfo: where to read the CPU description; when it cannot be read (not Linux), the flags fall back to
            what ``torch.backends.cpu.get_cpu_capability()`` implies, which never includes the bf16 or AMX flags.

    Returns:
        The CPU facts.

    Example:
        >>> info = cpu_info()
        >>> 1 <= info.available_cores <= info.logical_cores
        True
    """
    capability = torch.backends.cpu.get_cpu_capability()
    try:
        text = Path(proc_cpuinfo).read_text(encoding="utf-8", errors="replace")
    except OSError:
        text = ""
    found = parse_cpu_flags(text) or _FLAGS_FROM_TORCH_CAPABILITY.get(capability, frozenset())
    logical = os.cpu_count() or 1
    available = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else logical
    return CpuInfo(
        logical_cores=logical,
        available_cores=available,
        model=_cpu_model(text) or platform.processor(),
        flags=tuple(flag for flag in BF16_CPU_FLAGS if flag in found),
        torch_capability=capability,
    )


def gpu_infos() -> list[GpuInfo]:
    """The CUDA devices torch can use, in index order; empty without CUDA.

    Example:
        >>> isinstance(gpu_infos(), list)
        True
    """
    if not torch.cuda.is_available():
        return []
    infos = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        infos.append(GpuInfo(index, props.name, (props.major, props.minor), props.total_memory))
    return infos


def nvml_status() -> tuple[bool, str]:
    """Whether NVML (the library behind ``nvidia-smi``) answers, and why not when it does not; never raises.

    Returns:
        ``(True, "driver <version>, <n> device(s)")`` when ``nvmlInit`` succeeds, else ``(False, reason)``.

    Example:
        >>> ok, reason = nvml_status()
        >>> isinstance(ok, bool) and bool(reason)
        True
    """
    try:
        import pynvml
    except ImportError:
        return False, "nvidia-ml-py is not installed (pip install 'lightning-speedkit[gpu]')"
    try:
        pynvml.nvmlInit()
    except Exception as err:  # NVMLError, or OSError from a broken driver install: report it, never raise
        return False, f"nvmlInit failed: {err}"
    try:
        driver = pynvml.nvmlSystemGetDriverVersion()
        count = pynvml.nvmlDeviceGetCount()
        if isinstance(driver, bytes):  # nvidia-ml-py < 11.5 returns bytes
            driver = driver.decode()
        return True, f"driver {driver}, {count} device(s)"
    except Exception as err:
        return True, f"initialised, but a query failed: {err}"
    finally:
        with contextlib.suppress(Exception):  # shutting down is best effort
            pynvml.nvmlShutdown()


def _cpu_model(text: str) -> str:
    """The first ``model name`` in ``/proc/cpuinfo`` text, or ``""``."""
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip().lower() == "model name":
            return value.strip()
    return ""
