"""Memory layout of a module's weights: which tensors are channels-last (NHWC), and moving them there in place.

Foundation shared by `~lightning_speedkit.ChannelsLast` (which converts a model) and `StructuredPruning` (which keeps
the layout of the layers it shrinks).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.parameter import is_lazy

__all__ = ["has_convolutions", "is_channels_last", "to_channels_last"]

_CONVS = (nn.Conv2d, nn.Conv3d, nn.ConvTranspose2d, nn.ConvTranspose3d)


def _layouts(module: nn.Module) -> list[tuple[torch.Tensor, torch.memory_format]]:
    """Each initialised 4-D/5-D parameter and buffer, with its channels-last layout (lazy ones are skipped)."""
    formats = {4: torch.channels_last, 5: torch.channels_last_3d}
    tensors = (t for t in (*module.parameters(), *module.buffers()) if not is_lazy(t))
    return [(t, formats[t.dim()]) for t in tensors if t.dim() in formats]


def _is_laid_out(tensor: torch.Tensor, layout: torch.memory_format) -> bool:
    """Whether ``tensor`` has exactly the strides ``layout`` gives it.

    ``is_contiguous(memory_format=...)`` also accepts a 1x1 conv weight left in NCHW strides, whose gradient then
    comes back NHWC-strided and costs DDP a copy per step (its "grad strides do not match bucket view" warning).
    """
    canonical = torch.empty(tensor.shape, device="meta", memory_format=layout).stride()
    return tensor.stride() == canonical


def has_convolutions(module: nn.Module) -> bool:
    """Whether ``module`` holds a 2-D or 3-D (transposed) convolution, the layers channels-last speeds up.

    Example:
        >>> has_convolutions(nn.Sequential(nn.Conv2d(3, 8, 3))), has_convolutions(nn.Linear(4, 2))
        (True, False)
    """
    return any(isinstance(m, _CONVS) for m in module.modules())


def is_channels_last(module: nn.Module) -> bool:
    """Whether ``module`` has 4-D/5-D parameters or buffers and all of them are in the channels-last layout.

    Example:
        >>> net = nn.Conv2d(3, 8, 3)
        >>> is_channels_last(net), is_channels_last(net.to(memory_format=torch.channels_last))
        (False, True)
    """
    layouts = _layouts(module)
    return bool(layouts) and all(_is_laid_out(t, f) for t, f in layouts)


def to_channels_last(module: nn.Module) -> int:
    """Move every initialised 4-D/5-D parameter and buffer of ``module`` to the channels-last layout, in place.

    The values are unchanged, and so are the ``Parameter`` objects (only their ``.data`` is replaced), so an
    optimizer built before the call keeps working.

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
    changed = 0
    for tensor, layout in _layouts(module):
        if _is_laid_out(tensor, layout):
            continue
        with torch.no_grad():
            tensor.data = torch.empty_like(tensor.data, memory_format=layout).copy_(tensor.data)
        changed += 1
    return changed
