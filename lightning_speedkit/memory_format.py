"""ChannelsLast: keep a conv net's weights in the channels-last (NHWC) memory layout, which oneDNN and cuDNN run faster.

Converting the weights is enough: a convolution whose weight is channels-last returns a channels-last output, so the
layout propagates through the network without touching the user's batches. ``benchmarks/channels_last.py`` measures
the gain against the default layout in the same run (1.2-1.4x per training step for the demo ResNet on this CPU).
"""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from lightning_speedkit.layout import has_convolutions, to_channels_last

__all__ = ["ChannelsLast"]


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
