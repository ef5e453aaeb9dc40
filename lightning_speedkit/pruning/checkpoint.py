"""Loading a pruned run's checkpoint into a fresh module: replay its pruning history, then load the weights."""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from lightning_speedkit.pruning.restore import find_pruning_state
from lightning_speedkit.pruning.surgery import normalised_history, replay_pruning_history

__all__ = ["load_pruned_checkpoint"]


def load_pruned_checkpoint(
    model: nn.Module, checkpoint_path: str | os.PathLike[str], example_input: Any = None, strict: bool = True
) -> nn.Module:
    """Load a checkpoint of a `StructuredPruning` run into a fresh, unpruned ``model`` (e.g. for inference).

    Replays the pruning history saved in the checkpoint's callback state on ``model`` (so its layers take the
    pruned shapes), then loads the weights. The file is read with ``torch.load(weights_only=True)``.

    Args:
        model: A freshly constructed module of the class that was trained (e.g. ``MyModule(**hparams)``).
        checkpoint_path: A Lightning checkpoint written during or after the pruning run.
        example_input: An input the model accepts; default: the one saved in the checkpoint, else
            ``model.example_input_array``.
        strict: Passed to ``load_state_dict``.

    Returns:
        ``model``, pruned and loaded, in eval mode.

    Raises:
        ValueError: If the file is truncated, corrupted or not a Lightning checkpoint, no example input is
            available, or the checkpoint holds several pruning states.

    Example:
        >>> # model = load_pruned_checkpoint(MyModule(), "best.ckpt")
    """
    try:
        checkpoint = torch.load(checkpoint_path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise
    except Exception as error:  # truncated (OSError), corrupted (UnpicklingError, RuntimeError) or not torch's
        raise ValueError(
            f"`checkpoint_path` must be a readable Lightning checkpoint, got {str(checkpoint_path)!r}, which is"
            f" truncated, corrupted or not a checkpoint ({type(error).__name__}; see the cause above)."
        ) from error
    if not isinstance(checkpoint, dict) or not isinstance(checkpoint.get("state_dict"), dict):
        raise ValueError(
            f"`checkpoint_path` must be a Lightning checkpoint with a state_dict, got {str(checkpoint_path)!r}."
        )
    state = find_pruning_state(checkpoint) or {}
    history = normalised_history(state.get("history", []))
    if example_input is None:
        example_input = state.get("example_input")
    if example_input is None:
        example_input = getattr(model, "example_input_array", None)
    replay_pruning_history(model, example_input, history)
    model.load_state_dict(checkpoint["state_dict"], strict=strict)
    return model.eval()
