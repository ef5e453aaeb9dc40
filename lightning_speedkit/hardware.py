"""What this machine has: CPU cores and ISA features, CUDA GPUs, and whether NVML answers.

This is the one seam between speedkit and the hardware's facts. Everything here reads facts and never raises on a
machine that lacks a GPU, NVML or ``/proc/cpuinfo``; callers receive plain frozen dataclasses. What the devices are
doing right now (utilisation, memory, power) is read by `lightning_speedkit.sampling`; what speedkit decides from
these facts is in `lightning_speedkit.recommend`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import platform
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

__all__ = [
    "CPU_FLAGS",
    "ISA_ENV",
    "CpuInfo",
    "GpuInfo",
    "cpu_info",
    "forced_isa",
    "gpu_infos",
    "has_tensor_cores",
    "nvml_status",
    "parse_cpu_flags",
    "supports_bf16",
]

# The x86 ISA levels that torch's kernel dispatch (ATEN_CPU_CAPABILITY) and oneDNN (ONEDNN_MAX_CPU_ISA) can be capped
# at, weakest first; each flag below needs at least its level. oneDNN's names, from its documentation.
_ISA_LEVELS = ("SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI",
               "AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX512_CORE_AMX", "AVX512_CORE_AMX_FP16")  # fmt: skip
_ISA_ALIASES = {"AVX10_1_512": "AVX512_CORE_FP16", "AVX10_1_512_AMX": "AVX512_CORE_AMX",
                "AVX10_1_512_AMX_FP16": "AVX512_CORE_AMX_FP16"}  # fmt: skip
_FLAG_LEVEL: dict[str, str] = {
    "avx2": "AVX2",
    "avx512f": "AVX512_CORE",
    "avx_vnni": "AVX2_VNNI",
    "avx512_vnni": "AVX512_CORE_VNNI",
    "avx512_bf16": "AVX512_CORE_BF16",
    "amx_tile": "AVX512_CORE_AMX",
    "amx_int8": "AVX512_CORE_AMX",
    "amx_bf16": "AVX512_CORE_AMX",
}
ISA_ENV = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")
"""The environment variables that force the ISA down (`forced_isa`): torch's, oneDNN's, and oneDNN's old name."""

# ATEN_CPU_CAPABILITY's values as caps: "default" means below AVX2; "avx512" is torch's top, so no cap.
_ATEN_CAPS = {"default": "AVX", "avx2": "AVX2"}

CPU_FLAGS: tuple[str, ...] = tuple(_FLAG_LEVEL)
"""The ``/proc/cpuinfo`` flags that decide what is worth using on a CPU: AVX2 and AVX-512, the int8 dot-product
instructions (VNNI, AMX-INT8: `lightning_speedkit.int8`) and bf16 (AVX-512 BF16, AMX-BF16: `PrecisionTuner`)."""

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
        flags: which of :data:`CPU_FLAGS` the CPU has and this process may use, in that order: a flag above a
            forced ISA (`forced_isa`) is left out.
        torch_capability: ``torch.backends.cpu.get_cpu_capability()``, the kernel set torch dispatches to.
        isa_limit: what forces the ISA below the CPU's (``"ONEDNN_MAX_CPU_ISA=AVX2"``) and the flags it hides,
            e.g. ``"ONEDNN_MAX_CPU_ISA=AVX2 (hides avx512f avx512_bf16)"``; ``""`` when nothing does.
    """

    logical_cores: int
    available_cores: int
    model: str
    flags: tuple[str, ...]
    torch_capability: str
    isa_limit: str = ""

    def machine(self) -> dict[str, Any]:
        """What a benchmark's results file records of the CPU: the figures in it are this machine's.

        Example:
            >>> CpuInfo(2, 2, "AMD EPYC", ("avx2",), "AVX2").machine()
            {'cpu': 'AMD EPYC', 'isa': 'AVX2', 'isa_limit': '', 'cores': 2, 'bf16': []}
        """
        return {
            "cpu": self.model,
            "isa": self.torch_capability,
            "isa_limit": self.isa_limit,
            "cores": self.available_cores,
            "bf16": self.bf16_instructions,
        }

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

    @property
    def int8_dot_instructions(self) -> list[str]:
        """The CPU's int8 dot-product instructions (VNNI, AMX-INT8); without them u8 x s8 products can saturate.

        Example:
            >>> CpuInfo(2, 2, "EPYC", ("avx2",), "AVX2").int8_dot_instructions
            []
        """
        return [flag for flag in ("avx_vnni", "avx512_vnni", "amx_int8") if flag in self.flags]


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


def forced_isa(environ: Mapping[str, str] | None = None) -> tuple[str | None, str]:
    """The ISA level this process is forced down to, if anything forces it, and what does.

    ``ATEN_CPU_CAPABILITY=avx2`` makes torch dispatch its AVX2 kernels and ``ONEDNN_MAX_CPU_ISA=AVX2`` stops oneDNN's
    matmuls and convolutions above AVX2: together they make an AVX-512 machine behave like an AVX2-only one, while
    ``/proc/cpuinfo`` still lists every flag. The lower cap wins. ONNX Runtime has no such switch; speedkit follows
    the forced ISA there too (its INT8 format), so a run under it decides as the AVX2-only machine would.

    Args:
        environ: the environment to read ``ATEN_CPU_CAPABILITY`` and ``ONEDNN_MAX_CPU_ISA`` (or its old name
            ``DNNL_MAX_CPU_ISA``) from; default ``os.environ``.

    Returns:
        ``(level, why)``: one of oneDNN's ISA names (``"AVX2"``), or None with ``""`` when nothing forces one.

    Example:
        >>> forced_isa({"ONEDNN_MAX_CPU_ISA": "avx2", "ATEN_CPU_CAPABILITY": "avx2"})
        ('AVX2', 'ATEN_CPU_CAPABILITY=avx2, ONEDNN_MAX_CPU_ISA=AVX2')
        >>> forced_isa({"ONEDNN_MAX_CPU_ISA": "AVX512_CORE", "ATEN_CPU_CAPABILITY": "avx2"})
        ('AVX2', 'ATEN_CPU_CAPABILITY=avx2')
        >>> forced_isa({"ONEDNN_MAX_CPU_ISA": "ALL"})
        (None, '')
    """
    env = os.environ if environ is None else environ
    caps: list[tuple[str, str]] = []
    aten = env.get(ISA_ENV[0], "").strip().lower()
    if aten in _ATEN_CAPS:
        caps.append((_ATEN_CAPS[aten], f"{ISA_ENV[0]}={aten}"))
    for name in ISA_ENV[1:]:
        value = env.get(name, "").strip().upper()
        level = _ISA_ALIASES.get(value, value)
        if level in _ISA_LEVELS:
            caps.append((level, f"{name}={value}"))
            break
    if not caps:
        return None, ""
    lowest = min(_ISA_LEVELS.index(level) for level, _ in caps)
    return _ISA_LEVELS[lowest], ", ".join(why for level, why in caps if _ISA_LEVELS.index(level) == lowest)


def cpu_info(proc_cpuinfo: str | os.PathLike[str] = _PROC_CPUINFO) -> CpuInfo:
    """Read this machine's CPU facts, as this process may use them.

    A forced ISA (`forced_isa`: ``ATEN_CPU_CAPABILITY`` / ``ONEDNN_MAX_CPU_ISA``) hides the flags above it, so that
    on an AVX-512 bf16 machine ``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2`` gives the facts, the precision
    candidates and the doctor report of an AVX2-only machine.

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
    present = [flag for flag in CPU_FLAGS if flag in found]
    level, why = forced_isa()
    allowed = present if level is None else [f for f in present if _allows(level, f)]
    hidden = [flag for flag in present if flag not in allowed]
    logical = os.cpu_count() or 1
    available = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else logical
    return CpuInfo(
        logical_cores=logical,
        available_cores=available,
        model=_cpu_model(text) or platform.processor(),
        flags=tuple(allowed),
        torch_capability=capability,
        isa_limit=f"{why} (hides {' '.join(hidden)})" if hidden else "",
    )


def _allows(level: str, flag: str) -> bool:
    """Whether an ISA capped at ``level`` may use ``flag``."""
    return _ISA_LEVELS.index(_FLAG_LEVEL[flag]) <= _ISA_LEVELS.index(level)


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
