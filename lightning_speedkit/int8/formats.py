"""Which INT8 format to quantize to, chosen from the CPU the model is verified on (ONNX Runtime's guidance).

ONNX Runtime's x86 kernels multiply uint8 activations by int8 weights (U8S8). Without the int8 dot-product
instructions (VNNI, AMX-INT8) they do it with ``VPMADDUBSW``, which adds two u8 x s8 products into a saturating
16-bit sum: 255 x 127 x 2 = 64,770 does not fit in 32,767, so large activations meeting large weights are clipped.
ORT's guidance ("Quantize ONNX models", and ``quantize_static``'s docstring): on such CPUs quantize the weights to
7 bits (``reduce_range=True``: 255 x 64 x 2 = 32,640 fits) or use U8U8; with VNNI, plain U8S8; on Arm, S8S8.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lightning_speedkit.checks import check_bool, check_choice
from lightning_speedkit.hardware import CpuInfo

__all__ = ["X86_MACHINES", "Int8Format", "int8_format"]

X86_MACHINES = ("x86_64", "amd64", "i386", "i686", "x86")
"""``platform.machine()`` values (lower case) of the CPUs whose ONNX Runtime kernels can saturate without VNNI."""

_ORT_TYPES = {"uint8": "QUInt8", "int8": "QInt8"}


@dataclass(frozen=True)
class Int8Format:
    """The types an INT8 model is quantized to, and why.

    Args:
        activation_type: ``"uint8"`` or ``"int8"``.
        weight_type: ``"int8"`` or ``"uint8"``.
        reduce_range: Weights quantized to 7 bits (ORT's ``reduce_range``).
        reason: One line: why these, from which CPU facts.
    """

    activation_type: str
    weight_type: str
    reduce_range: bool
    reason: str

    @property
    def name(self) -> str:
        """``"U8S8"`` style: activations then weights, ``+reduce_range`` when set.

        Example:
            >>> Int8Format("uint8", "int8", True, "").name
            'U8S8+reduce_range'
        """
        short = {"uint8": "U8", "int8": "S8"}
        return short[self.activation_type] + short[self.weight_type] + ("+reduce_range" if self.reduce_range else "")

    def settings(self) -> dict[str, Any]:
        """The report's entries: ``activation_type`` and ``weight_type`` (ORT's names), ``reduce_range``, the reason."""
        return {
            "int8_format": self.name,
            "activation_type": _ORT_TYPES[self.activation_type],
            "weight_type": _ORT_TYPES[self.weight_type],
            "reduce_range": self.reduce_range,
            "format_reason": self.reason,
        }


def int8_format(
    cpu: CpuInfo,
    symmetric: bool = False,
    activation_type: str | None = None,
    *,
    reduce_range: bool | None = None,
    machine: str = "x86_64",
) -> Int8Format:
    """The INT8 format for a model verified on ``cpu``, following ONNX Runtime's guidance, and the reason.

    - x86 with VNNI or AMX-INT8: U8S8 (no saturation).
    - x86 without them (AVX2, AVX-512 without VNNI): U8S8 with ``reduce_range=True``, so that ``VPMADDUBSW`` cannot
      saturate. Measured on an AVX2-only EPYC (``benchmarks/int8.py``, ``formats``): it kept agreement where S8S8
      and U8U8 did, and was the fastest of those (U8U8 is slower at batch 32, S8S8 at batch 1).
    - Arm and other CPUs: S8S8, ORT's advice there (not measured here).

    An explicit ``activation_type`` or ``symmetric=True`` (int8 activations, every zero point 0) is kept, and so is
    an explicit ``reduce_range``; the reason says so. Weights are always per-channel symmetric.

    Args:
        cpu: The CPU as `lightning_speedkit.hardware.cpu_info` sees it (a forced ISA hides VNNI).
        symmetric: Zero points 0 (TensorRT's rule): int8 activations.
        activation_type: ``"uint8"``, ``"int8"`` or None (chosen here).
        reduce_range: 7-bit weights, or None (chosen here).
        machine: ``platform.machine()`` of that CPU.

    Example:
        >>> avx2 = CpuInfo(2, 2, "AMD EPYC", ("avx2",), "AVX2")
        >>> fmt = int8_format(avx2)
        >>> fmt.name
        'U8S8+reduce_range'
        >>> print(fmt.reason)
        x86 without VNNI or AMX-INT8 (flags: avx2): 7-bit weights so that u8 x s8 sums cannot saturate
        >>> int8_format(CpuInfo(2, 2, "Xeon", ("avx2", "avx512f", "avx512_vnni"), "AVX512")).name
        'U8S8'
        >>> for part in int8_format(avx2, symmetric=True).reason.split("; "):
        ...     print(part)
        symmetric=True asks for int8 activations
        x86 without VNNI or AMX-INT8 (flags: avx2): 7-bit weights so that u8 x s8 sums cannot saturate
    """
    if not isinstance(cpu, CpuInfo):
        raise ValueError(f"`cpu` must be a lightning_speedkit.hardware.CpuInfo (see cpu_info()), got {cpu!r}.")
    check_bool("symmetric", symmetric)
    if activation_type is not None:
        check_choice("activation_type", activation_type, ("int8", "uint8"))
    if reduce_range is not None:
        check_bool("reduce_range", reduce_range)
    if not isinstance(machine, str) or not machine:
        raise ValueError(f"`machine` must be platform.machine() of the CPU, such as 'x86_64', got {machine!r}.")
    x86 = machine.lower() in X86_MACHINES
    dot = cpu.int8_dot_instructions
    forced = f", ISA forced: {cpu.isa_limit}" if cpu.isa_limit else ""
    if not x86:
        chosen, rr, why = "int8", False, f"{machine} CPU: S8S8, ONNX Runtime's advice for Arm (not measured here)"
    elif dot:
        chosen, rr, why = "uint8", False, f"x86 with {'/'.join(dot)}: U8S8 accumulates without saturation"
    else:
        shown = " ".join(cpu.flags) or "none"
        chosen, rr = "uint8", True
        why = f"x86 without VNNI or AMX-INT8 (flags: {shown}{forced}): 7-bit weights so that u8 x s8 sums"
        why += " cannot saturate"
    asked = []
    if symmetric or activation_type is not None:
        chosen = "int8" if symmetric else str(activation_type)
        asked.append("symmetric=True asks for int8 activations" if symmetric else f"activation_type={chosen!r} given")
    if reduce_range is not None:
        asked.append(f"reduce_range={reduce_range} given")
        rr = reduce_range
    return Int8Format(chosen, "int8", rr, "; ".join([*asked, why]))
