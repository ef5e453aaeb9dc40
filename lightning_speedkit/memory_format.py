"""ChannelsLast: keep a conv net's weights in the channels-last (NHWC) memory layout, which oneDNN and cuDNN run faster.

Converting the weights is enough: a convolution whose weight is channels-last returns a channels-last output, so the
layout propagates through the network without touching the user's batches. ``benchmarks/channels_last.py`` measures
the gain against the default layout in the same run (1.33-1.36x per training step for the demo ResNet on 2 CPU cores).
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_speedkit.batch import forward_example, modes_kept
from lightning_speedkit.layout import (
    align_optimizer_state,
    has_convolutions,
    is_channels_last,
    to_channels_last,
    to_default_layout,
)

__all__ = ["ChannelsLast"]


class ChannelsLast(Callback):
    """Run a convolutional LightningModule in the channels-last memory layout (NHWC), with no change to the model.

    When the Trainer sets up, before the optimizer and any DDP wrapper are built, the weights of the module's 2-D/3-D
    convolutions move to NHWC. With ``verify=True`` the module's ``example_input_array`` is run through it (eval mode,
    no grad) in both layouts first: if the NHWC run fails (``x.view(...)`` on an activation is the usual culprit:
    use ``reshape`` or ``flatten``) or its output differs, the model goes back to the default layout with a
    warning; a module without ``example_input_array`` is left alone unless ``verify=False``. At train start, any
    optimizer state loaded from a checkpoint of the default layout gets the parameters' strides. Convolutions built
    later (in ``configure_model`` or lazily) are reported at fit start; `StructuredPruning` keeps the layout of the
    layers it shrinks. Values never change, so checkpoints load into a model in either layout.

    Args:
        enabled: ``False`` makes the callback a no-op (how `~lightning_speedkit.preset` switches it off).
        verify: Check the model on its ``example_input_array`` before keeping the new layout.

    Example:
        >>> from lightning_speedkit import preset
        >>> trainer = preset(logger=False, verbose=False, channels_last=False)
        >>> any(isinstance(c, ChannelsLast) for c in trainer.callbacks)
        False
    """

    def __init__(self, enabled: bool = True, verify: bool = True) -> None:
        for name, value in (("enabled", enabled), ("verify", verify)):
            if not isinstance(value, bool):
                raise ValueError(f"`{name}` must be True or False, got {value!r}.")
        self.enabled = enabled
        self.verify = verify
        self.converted = 0
        self._status = "not set up"

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if not self.enabled:
            self._status = "disabled"
            return
        if is_channels_last(pl_module):  # converted already (an earlier stage, or by the user)
            self._status = "channels_last"
            return
        if not has_convolutions(pl_module):
            self._status = "no convolutions at setup"
            rank_zero_info("ChannelsLast: no convolutions at setup; the layout is left as it is.")
            return
        example = pl_module.example_input_array
        if self.verify and example is None:
            self._status = "unverified: no example_input_array"
            rank_zero_info(
                "ChannelsLast: the module has no `example_input_array` to check that it runs channels-last; layout"
                " left as it is (set one, or pass `ChannelsLast(verify=False)`)."
            )
            return
        expected = None
        if self.verify:
            example = move_data_to_device(example, pl_module.device)
            try:
                expected = self._outputs(pl_module, example)
            except Exception as err:  # the model's own problem: let training report it, leave the layout alone
                self._status = f"unverified: the example input fails in the default layout too ({type(err).__name__})"
                rank_zero_info(f"ChannelsLast: {self._status}; layout left as it is.")
                return
        converted = to_channels_last(pl_module)
        if self.verify:
            problem = self._check(pl_module, example, expected)
            if problem is not None:
                to_default_layout(pl_module)
                self._status = f"reverted: {problem}"
                rank_zero_warn(f"ChannelsLast: the model does not run channels-last ({problem}); layout unchanged.")
                return
        self.converted += converted
        self._status = "channels_last"
        rank_zero_info(f"ChannelsLast: {converted} convolution weights moved to the channels-last layout.")

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        set_up = self._status in ("channels_last", "no convolutions at setup")
        if set_up and has_convolutions(pl_module) and not is_channels_last(pl_module):
            rank_zero_warn(
                "ChannelsLast: convolutions built after setup (in `configure_model`, or lazily) are in the default"
                " layout; call `lightning_speedkit.layout.to_channels_last(self)` at the end of `configure_model`."
            )

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._status == "channels_last":  # state restored from a checkpoint of the default layout
            for optimizer in trainer.optimizers:
                align_optimizer_state(optimizer)

    def report(self) -> dict[str, Any]:
        """``{"status", "converted"}``: what happened at setup, and how many weights changed layout."""
        return {"status": self._status, "converted": self.converted}

    @staticmethod
    def _outputs(module: torch.nn.Module, example: Any) -> Any:
        with modes_kept(module), torch.no_grad():
            module.eval()
            return forward_example(module, example)

    def _check(self, module: torch.nn.Module, example: Any, expected: Any) -> str | None:
        try:
            actual = self._outputs(module, example)
        except Exception as err:
            return f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        try:
            torch.testing.assert_close(actual, expected, rtol=1e-3, atol=1e-4)
        except (AssertionError, TypeError, ValueError):
            return "its output differs from the default layout's"
        return None
