"""ChannelsLast: keep a conv net's weights in the channels-last (NHWC) memory layout, which oneDNN and cuDNN run faster.

Converting the weights is enough: a convolution whose weight is channels-last returns a channels-last output, so the
layout propagates through the network without touching the user's batches. ``benchmarks/channels_last.py`` measures
the gain against the default layout in the same run (1.2-1.4x per training step for the demo ResNet on this CPU).
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from torch import nn
from torch.nn.parameter import is_lazy
from typing_extensions import override

__all__ = ["ChannelsLast", "has_convolutions", "is_channels_last", "to_channels_last"]

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


class ChannelsLast(Callback):
    """Run a convolutional LightningModule in the channels-last memory layout (NHWC), with no change to the model.

    Converts the module's weights when ``fit``/``validate``/``test``/``predict`` sets up, before the optimizer and
    any DDP wrapper are built; `StructuredPruning` keeps the layout of the layers it shrinks. Models without
    convolutions are left alone. Values never change, so checkpoints load into a model in either layout.

    Args:
        enabled: ``False`` makes the callback a no-op (how `~lightning_speedkit.preset` switches it off).

    Example:
        >>> from lightning_speedkit import preset
        >>> trainer = preset(logger=False, verbose=False, channels_last=False)
        >>> any(isinstance(c, ChannelsLast) for c in trainer.callbacks)
        False
    """

    def __init__(self, enabled: bool = True) -> None:
        if not isinstance(enabled, bool):
            raise ValueError(f"`enabled` must be True or False, got {enabled!r}.")
        self.enabled = enabled
        self.converted = 0

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if not self.enabled:
            return
        if not has_convolutions(pl_module):
            rank_zero_info("ChannelsLast: the model has no convolutions; layout left as it is.")
            return
        self.converted = to_channels_last(pl_module)
        rank_zero_info(f"ChannelsLast: {self.converted} weight tensors moved to the channels-last layout.")
