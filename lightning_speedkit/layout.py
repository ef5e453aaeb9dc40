"""Memory layout of a module's weights: which tensors are channels-last (NHWC), and moving them there in place.

Foundation shared by `~lightning_speedkit.ChannelsLast` (which converts a model) and `StructuredPruning` (which keeps
the layout of the layers it shrinks).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.parameter import is_lazy

from lightning_speedkit.hardware import CpuInfo

__all__ = [
    "align_optimizer_state",
    "has_convolutions",
    "is_channels_last",
    "nhwc_unsafe_convs",
    "to_channels_last",
    "to_default_layout",
]

_CONVS = (nn.Conv2d, nn.Conv3d, nn.ConvTranspose2d, nn.ConvTranspose3d)
_CHANNELS_LAST = {4: torch.channels_last, 5: torch.channels_last_3d}


def _layouts(module: nn.Module) -> list[tuple[nn.Parameter, torch.memory_format]]:
    """The initialised 4-D/5-D parameters of the convolutions in ``module`` (lazy ones are skipped), each once."""
    seen: set[int] = set()
    found = []
    for conv in (m for m in module.modules() if isinstance(m, _CONVS)):
        for param in conv.parameters(recurse=False):
            if not is_lazy(param) and param.dim() in _CHANNELS_LAST and id(param) not in seen:
                seen.add(id(param))
                found.append((param, _CHANNELS_LAST[param.dim()]))
    return found


def _is_laid_out(tensor: torch.Tensor, layout: torch.memory_format) -> bool:
    """Whether ``tensor`` has exactly the strides ``layout`` gives it.

    ``is_contiguous(memory_format=...)`` also accepts a 1x1 conv weight left in NCHW strides, whose gradient then
    comes back NHWC-strided and costs DDP a copy per step (its "grad strides do not match bucket view" warning).
    """
    canonical = torch.empty(tensor.shape, device="meta", memory_format=layout).stride()
    return tensor.stride() == canonical


def _relayout(module: nn.Module, channels_last: bool) -> int:
    changed = 0
    for param, nhwc in _layouts(module):
        layout = nhwc if channels_last else torch.contiguous_format
        if _is_laid_out(param, layout):
            continue
        with torch.no_grad():
            param.data = torch.empty_like(param.data, memory_format=layout).copy_(param.data)
            if param.grad is not None:  # a gradient keeps its parameter's layout (autograd's layout contract)
                param.grad = torch.empty_like(param.grad, memory_format=layout).copy_(param.grad)
        changed += 1
    return changed


def has_convolutions(module: nn.Module) -> bool:
    """Whether ``module`` holds a 2-D or 3-D (transposed) convolution, the layers channels-last speeds up.

    Example:
        >>> has_convolutions(nn.Sequential(nn.Conv2d(3, 8, 3))), has_convolutions(nn.Linear(4, 2))
        (True, False)
    """
    return any(isinstance(m, _CONVS) for m in module.modules())


def nhwc_unsafe_convs(module: nn.Module, cpu: CpuInfo) -> list[str]:
    """The convolutions that oneDNN cannot train channels-last on this x86 CPU without corrupting memory.

    oneDNN's 1x1 convolution computes its weight gradient for a strided (``stride > 1``) NHWC input through a copy
    into a per-thread workspace, and for fewer input channels per group than its channel block (8 on AVX2, 16 on
    AVX-512) it writes past that workspace (oneDNN issue #6035, open; torch 2.13 ships it): wrong gradients, then a
    corrupted heap (``munmap_chunk(): invalid pointer``, ``double free or corruption``, SIGABRT or SIGSEGV, often only
    at a later ``free``). Measured here on an AVX2-only EPYC: a 1x1 stride-2 convolution with 1-6 input channels
    aborted, with 7-20 it trained alike in both layouts. The default layout takes another path and is safe. A model
    holding such a layer is therefore not moved to NHWC on a CPU; on a GPU (cuDNN) this does not apply.

    Args:
        module: The model.
        cpu: The CPU facts (`lightning_speedkit.hardware.cpu_info`, a forced ISA included): the block is 16 with
            ``avx512f``, 8 with ``avx2``; without either (not x86, or older) nothing is known to fail.

    Returns:
        The names of the unsafe convolutions (``""`` for ``module`` itself), in module order.

    Example:
        >>> from lightning_speedkit.hardware import CpuInfo
        >>> net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Conv2d(4, 8, 1, stride=2), nn.Conv2d(8, 8, 1, stride=2))
        >>> nhwc_unsafe_convs(net, CpuInfo(2, 2, "EPYC", ("avx2",), "AVX2"))
        ['1']
        >>> nhwc_unsafe_convs(net, CpuInfo(2, 2, "EPYC", ("avx2", "avx512f"), "AVX512"))
        ['1', '2']
    """
    block = 16 if "avx512f" in cpu.flags else 8 if "avx2" in cpu.flags else 0
    unsafe = []
    for name, conv in module.named_modules():
        if not isinstance(conv, (nn.Conv2d, nn.Conv3d)):
            continue
        one_by_one = all(k == 1 for k in conv.kernel_size)
        if one_by_one and any(s > 1 for s in conv.stride) and conv.in_channels // conv.groups < block:
            unsafe.append(name)
    return unsafe


def is_channels_last(module: nn.Module) -> bool:
    """Whether ``module`` has 2-D/3-D convolutions and all their weights are in the channels-last layout.

    Example:
        >>> net = nn.Conv2d(3, 8, 3)
        >>> is_channels_last(net), is_channels_last(net.to(memory_format=torch.channels_last))
        (False, True)
    """
    layouts = _layouts(module)
    return bool(layouts) and all(_is_laid_out(t, f) for t, f in layouts)


def to_channels_last(module: nn.Module) -> int:
    """Move the weights of every 2-D/3-D (transposed) convolution in ``module`` to the channels-last layout, in place.

    Only convolution weights (and their gradients, if any) change, and only their strides: the values are unchanged,
    and so are the ``Parameter`` objects (only ``.data`` is replaced), so an optimizer built before the call keeps
    working (`align_optimizer_state` gives state it already holds the new strides). Lazy parameters are skipped.

    Returns:
        How many tensors changed layout (0 when there was nothing to do).

    Example:
        >>> net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(), nn.LazyLinear(2))
        >>> before = list(net.parameters())
        >>> to_channels_last(net), is_channels_last(net), to_channels_last(net)
        (1, True, 0)
        >>> all(a is b for a, b in zip(before, net.parameters()))
        True
    """
    return _relayout(module, channels_last=True)


def to_default_layout(module: nn.Module) -> int:
    """Undo `to_channels_last`: convolution weights (and gradients) back to the default contiguous layout, in place.

    Example:
        >>> net = nn.Conv2d(3, 8, 3)
        >>> to_channels_last(net), to_default_layout(net), is_channels_last(net)
        (1, 1, False)
    """
    return _relayout(module, channels_last=False)


def align_optimizer_state(optimizer: torch.optim.Optimizer) -> int:
    """Give each optimizer state tensor shaped like its parameter the parameter's strides (values unchanged).

    Needed when the state was created, or loaded from a checkpoint, before the parameters changed layout: fused and
    foreach optimizer kernels expect parameters, gradients and state in one layout.

    Returns:
        How many state tensors were re-laid out.

    Example:
        >>> net = nn.Conv2d(3, 8, 3)
        >>> opt = torch.optim.AdamW(net.parameters())
        >>> net(torch.randn(1, 3, 8, 8)).sum().backward(); opt.step()
        >>> to_channels_last(net), align_optimizer_state(opt)
        (1, 2)
    """
    changed = 0
    for group in optimizer.param_groups:
        for param in group["params"]:
            state = optimizer.state.get(param, {})
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.shape == param.shape and value.stride() != param.stride():
                    state[key] = torch.empty_like(param, dtype=value.dtype).copy_(value)
                    changed += 1
    return changed
