"""Pruned checkpoints: rebuild the pruned architecture before the weights load, in a fit or into a fresh module."""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lightning_speedkit.pruning.surgery import normalised_history, replay_pruning_history

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_speedkit.pruning.callback import StructuredPruning

__all__ = ["RestoreHook", "find_pruning_state", "load_pruned_checkpoint", "rebuild_before_load"]


class RestoreHook:
    """A module's ``load_state_dict`` pre-hook that calls back into the callback through a weak reference.

    Copies and pickles of the module (planning copies, MAC counting) get a hook that does nothing, so they never
    drag the callback, and through it the Trainer, along.
    """

    def __init__(self, callback: StructuredPruning) -> None:
        self._ref: Callable[[], StructuredPruning | None] = weakref.ref(callback)

    def __call__(self, module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        """Let the callback reshape ``module`` before ``state_dict`` loads into it."""
        callback = self._ref()
        if callback is not None:
            callback._before_weights_load(module, state_dict, prefix)

    def __getstate__(self) -> dict[str, Any]:
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._ref = lambda: None


def find_pruning_state(checkpoint: dict[str, Any]) -> dict[str, Any] | None:
    """The one ``StructuredPruning`` callback state in a Lightning checkpoint dict, or None.

    Raises:
        ValueError: If the checkpoint holds several.
    """
    states = [v for k, v in checkpoint.get("callbacks", {}).items() if str(k).startswith("StructuredPruning")]
    if len(states) > 1:
        raise ValueError(f"The checkpoint holds {len(states)} StructuredPruning states; expected one.")
    return states[0] if states else None


def rebuild_before_load(
    trainer: pl.Trainer | None,
    module: nn.Module,
    state_dict: dict[str, Any],
    prefix: str,
    state_key: str,
    example_input: Any,
) -> Any:
    """In a ``load_state_dict`` pre-hook: replay the pruning history of the checkpoint the Trainer is restoring.

    Acts only when ``state_dict`` is the whole ``state_dict`` of the checkpoint Lightning has loaded (the same
    tensors) and it holds a pruning history; then the module takes the pruned shapes before the weights load.

    Returns:
        The example input used (the checkpoint's, else ``example_input``), or None if nothing was done.
    """
    connector = getattr(trainer, "_checkpoint_connector", None)
    checkpoint = getattr(connector, "_loaded_checkpoint", None)
    if not isinstance(checkpoint, dict):
        return None
    weights = checkpoint.get("state_dict")
    if prefix or not isinstance(weights, dict) or len(weights) != len(state_dict):
        return None
    if any(value is not weights.get(key) for key, value in state_dict.items()):
        return None  # torch loads a shallow copy: the same tensors, or not Lightning restoring its checkpoint
    state = checkpoint.get("callbacks", {}).get(state_key) or find_pruning_state(checkpoint)
    if not state or not state.get("history"):
        return None
    example = state.get("example_input")
    example = example_input if example is None else example
    replay_pruning_history(module, example, state["history"])
    return example


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
