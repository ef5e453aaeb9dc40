"""Model FLOPs utilisation: the dense peak-FLOPs table, the peak a run can reach, FLOPs counted on the meta device."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from lightning_speedkit.batch import first_tensor

__all__ = [
    "DENSE_PEAK_FLOPS",
    "measure_flops",
    "mfu",
    "peak_flops",
    "precision_key",
    "tf32_allowed",
    "training_peak_flops",
    "uses_tf32",
]

_T = 1e12
DENSE_PEAK_FLOPS: dict[str, dict[str, float]] = {
    "V100": {"fp32": 15.7 * _T, "fp16": 125 * _T},
    "T4": {"fp32": 8.1 * _T, "fp16": 65 * _T},
    "A10": {"fp32": 31.2 * _T, "tf32": 62.5 * _T, "fp16": 125 * _T, "bf16": 125 * _T},
    "L4": {"fp32": 30.3 * _T, "tf32": 60 * _T, "fp16": 121 * _T, "bf16": 121 * _T, "fp8": 242 * _T},
    "L40S": {"fp32": 91.6 * _T, "tf32": 183 * _T, "fp16": 362 * _T, "bf16": 362 * _T, "fp8": 733 * _T},
    "A100": {"fp32": 19.5 * _T, "tf32": 156 * _T, "fp16": 312 * _T, "bf16": 312 * _T},
    "H100 PCIe": {"fp32": 51 * _T, "tf32": 378 * _T, "fp16": 756 * _T, "bf16": 756 * _T, "fp8": 1513 * _T},
    "H100 NVL": {"fp32": 60 * _T, "tf32": 418 * _T, "fp16": 835 * _T, "bf16": 835 * _T, "fp8": 1671 * _T},
    "H100": {"fp32": 67 * _T, "tf32": 495 * _T, "fp16": 989 * _T, "bf16": 989 * _T, "fp8": 1979 * _T},
    "H200 NVL": {"fp32": 60 * _T, "tf32": 418 * _T, "fp16": 835 * _T, "bf16": 835 * _T, "fp8": 1671 * _T},
    "H200": {"fp32": 67 * _T, "tf32": 495 * _T, "fp16": 989 * _T, "bf16": 989 * _T, "fp8": 1979 * _T},
}
"""Dense (no sparsity) peak FLOP/s per GPU and precision, from NVIDIA's data sheets (H100/H200: the SXM parts)."""

_NAME_PATTERNS = [  # first match wins: specific variants before the family
    (r"h200.*nvl", "H200 NVL"),
    (r"h200", "H200"),
    (r"h100.*nvl", "H100 NVL"),
    (r"h100.*pcie", "H100 PCIe"),
    (r"h100", "H100"),
    (r"a100", "A100"),
    (r"l40s", "L40S"),
    (r"\bl4\b", "L4"),
    (r"\ba10\b", "A10"),
    (r"\bt4\b", "T4"),
    (r"v100", "V100"),
]


def precision_key(precision: str, tf32: bool = False) -> str | None:
    """The `DENSE_PEAK_FLOPS` column for a Lightning ``precision`` string; None for 64-bit.

    Example:
        >>> precision_key("bf16-mixed"), precision_key("16-mixed"), precision_key("32-true", tf32=True)
        ('bf16', 'fp16', 'tf32')
    """
    p = str(precision)
    if p.startswith("transformer-engine"):
        return "fp8"
    if p.startswith("bf16"):
        return "bf16"
    if p.startswith("16"):
        return "fp16"
    if p.startswith("32"):
        return "tf32" if tf32 else "fp32"
    return None


def peak_flops(device_name: str, precision: str) -> float | None:
    """Dense peak FLOP/s of a GPU (by its CUDA name) at a `DENSE_PEAK_FLOPS` precision key; None when unknown.

    Example:
        >>> peak_flops("NVIDIA H200", "bf16")
        989000000000000.0
        >>> peak_flops("NVIDIA A10G", "bf16") is None  # not in the table: pass peak_flops yourself
        True
    """
    name = device_name.lower()
    for pattern, key in _NAME_PATTERNS:
        if re.search(pattern, name):
            return DENSE_PEAK_FLOPS[key].get(precision)
    return None


def tf32_allowed() -> dict[str, bool]:
    """Whether torch lets fp32 work run on TF32 tensor cores: ``matmul`` (cuBLAS) and ``cudnn`` (convolutions).

    The flags are ``torch.backends.cuda.matmul.allow_tf32`` (off by default; ``set_float32_matmul_precision("high")``
    turns it on) and ``torch.backends.cudnn.allow_tf32`` (on by default: cuDNN convolutions run in TF32 unless told
    not to). Where torch refuses to read a legacy flag (the ``fp32_precision`` API was mixed in), the new setting,
    most specific scope first, decides.

    Example:
        >>> sorted(tf32_allowed())
        ['cudnn', 'matmul']
    """
    backends = torch.backends
    return {
        "matmul": _tf32_setting(lambda: backends.cuda.matmul.allow_tf32, backends.cuda.matmul, backends),
        "cudnn": _tf32_setting(
            lambda: backends.cudnn.allow_tf32, getattr(backends.cudnn, "conv", None), backends.cudnn, backends
        ),
    }


def uses_tf32(module: nn.Module | None = None) -> bool:
    """Whether the fp32 work of ``module`` on a GPU may run on TF32 tensor cores under torch's current flags.

    True when TF32 matmuls are allowed, or when cuDNN may use TF32 (torch's default) and ``module`` has a convolution
    or an RNN (cuDNN's layers); a module not given counts as having one. Convolutions called functionally, outside
    ``nn.Conv*`` modules, are not seen.

    Example:
        >>> uses_tf32(nn.Linear(4, 2)) == tf32_allowed()["matmul"]
        True
    """
    flags = tf32_allowed()
    if flags["matmul"]:
        return True
    if not (flags["cudnn"] and torch.backends.cudnn.enabled):
        return False
    return module is None or any(isinstance(m, (nn.modules.conv._ConvNd, nn.RNNBase)) for m in module.modules())


def training_peak_flops(
    device_name: str, precision: str, module: nn.Module | None = None
) -> tuple[float | None, str | None]:
    """The dense peak FLOP/s to divide by for MFU when ``module`` trains in ``precision`` on a GPU, and its column.

    In ``32-true`` this is the TF32 peak where `uses_tf32` (a conv net under torch's defaults: its convolutions run
    in TF32, so the fp32 peak would make MFU up to 7x too high), and the fp32 peak on GPUs without TF32 (before
    Ampere). The peak is None for a GPU not in `DENSE_PEAK_FLOPS`.

    Example:
        >>> training_peak_flops("NVIDIA H200", "bf16-mixed")
        (989000000000000.0, 'bf16')
        >>> training_peak_flops("Tesla V100-SXM2-16GB", "32-true", nn.Conv2d(3, 8, 3))  # no TF32 before Ampere
        (15700000000000.0, 'fp32')
    """
    key = precision_key(precision, tf32=uses_tf32(module))
    if key == "tf32" and peak_flops(device_name, "tf32") is None and peak_flops(device_name, "fp32") is not None:
        key = "fp32"
    return (peak_flops(device_name, key) if key else None), key


def mfu(flops_per_batch: float, seconds_per_batch: float, peak: float) -> float:
    """Model FLOPs utilisation: achieved FLOP/s of one device over its peak.

    Example:
        >>> mfu(flops_per_batch=5e12, seconds_per_batch=0.1, peak=100e12)
        0.5
    """
    if seconds_per_batch <= 0 or peak <= 0:
        return 0.0
    return flops_per_batch / seconds_per_batch / peak


def measure_flops(module: nn.Module, inputs: Sequence[Any], backward: bool = True) -> int:
    """FLOPs of ``module(*inputs)`` (and its backward to the parameters) counted by ``torch.utils.flop_counter``.

    Runs on the meta device with stand-ins for the parameters, buffers and inputs, so nothing is computed and the
    module (weights, grads, BatchNorm statistics) is left untouched.

    Example:
        >>> measure_flops(nn.Linear(4, 2), [torch.zeros(3, 4)])  # forward 48 + weight gradient 48
        96
    """
    from torch.utils.flop_counter import FlopCounterMode

    params = {
        n: torch.empty_like(p, device="meta").requires_grad_(p.requires_grad) for n, p in module.named_parameters()
    }
    state: dict[str, torch.Tensor] = {n: torch.empty_like(b, device="meta") for n, b in module.named_buffers()}
    state.update(params)
    args = tuple(torch.empty_like(x, device="meta") if isinstance(x, torch.Tensor) else x for x in inputs)
    with FlopCounterMode(display=False) as counter:
        out = torch.func.functional_call(module, state, args)
        trainable = [p for p in params.values() if p.requires_grad]
        first = first_tensor(out)
        if backward and trainable and first is not None and first.requires_grad:
            torch.autograd.grad(first.float().sum(), trainable, allow_unused=True)
    return int(counter.get_total_flops())


def _tf32_setting(legacy: Callable[[], bool], *scopes: Any) -> bool:
    """A legacy ``allow_tf32`` flag, or, where torch refuses to read it, the first explicit ``fp32_precision``."""
    try:
        return bool(legacy())
    except RuntimeError:  # "you have used a mix of the legacy and new APIs to set the TF32 flags"
        for scope in scopes:
            value = getattr(scope, "fp32_precision", "none")
            if value != "none":
                return bool(value == "tf32")
        return False
