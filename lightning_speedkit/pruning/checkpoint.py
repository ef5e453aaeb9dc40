"""Loading a pruned run's checkpoint into a fresh module: replay its pruning history, then load the weights."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_speedkit.checks import check_bool
from lightning_speedkit.pruning.arguments import check_example_fits, check_example_input, check_history, check_module
from lightning_speedkit.pruning.restore import find_pruning_state
from lightning_speedkit.pruning.surgery import replay_pruning_history

__all__ = ["load_pruned_checkpoint"]


def _checked_path(value: Any) -> Path:
    """``checkpoint_path`` as the ``Path`` of an existing file; else a ``ValueError`` or ``FileNotFoundError``."""
    path = os.fspath(value) if isinstance(value, (str, os.PathLike)) else None
    if not isinstance(path, str) or not path:
        raise ValueError(f"`checkpoint_path` must be the path of a checkpoint file (a str or Path), got {value!r}.")
    if not os.path.exists(path):
        raise FileNotFoundError(f"`checkpoint_path` must be an existing checkpoint file, got {path!r}: no such file.")
    if not os.path.isfile(path):
        raise ValueError(f"`checkpoint_path` must be a checkpoint file, got {path!r}, which is a directory.")
    return Path(path)


def _read(path: Path) -> dict[str, Any]:
    """The Lightning checkpoint dict at ``path`` (``weights_only``); one ``ValueError`` naming the file if broken."""
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except (
        Exception
    ) as error:  # truncated (OSError, EOFError), corrupted (UnpicklingError, RuntimeError) or not torch's
        raise ValueError(
            f"`checkpoint_path` must be a readable Lightning checkpoint, got {str(path)!r}, which is truncated,"
            f" corrupted or not a checkpoint ({type(error).__name__}; see the cause above)."
        ) from error
    if not isinstance(checkpoint, dict) or not isinstance(checkpoint.get("state_dict"), dict):
        raise ValueError(f"`checkpoint_path` must be a Lightning checkpoint with a state_dict, got {str(path)!r}.")
    return checkpoint


def _checked_history(state: Any, path: Path) -> list[tuple[str, bool, list[int]]]:
    """The history in a checkpoint's ``StructuredPruning`` state; a ``ValueError`` naming the file if malformed."""
    try:
        if not isinstance(state, dict):
            raise ValueError(f"the state is {type(state).__name__}, not a dict")
        return check_history("history", state.get("history") or [])
    except ValueError as error:
        raise ValueError(
            f"`checkpoint_path` must hold a well-formed StructuredPruning state, got {str(path)!r}: {error}"
        ) from error


def load_pruned_checkpoint(
    model: nn.Module, checkpoint_path: str | os.PathLike[str], example_input: Any = None, strict: bool = True
) -> nn.Module:
    """Load a checkpoint of a `StructuredPruning` run into a fresh, unpruned ``model`` (e.g. for inference).

    Replays the pruning history saved in the checkpoint's callback state on ``model`` (so its layers take the
    pruned shapes), then loads the weights. The file is read with ``torch.load(weights_only=True)``.

    Args:
        model: A freshly constructed module of the class that was trained (e.g. ``MyModule(**hparams)``).
        checkpoint_path: A Lightning checkpoint written during or after the pruning run.
        example_input: An input the model accepts (a tensor, tuple or dict; checked with one forward pass);
            default: the one saved in the checkpoint, else ``model.example_input_array``.
        strict: Passed to ``load_state_dict`` (True or False).

    Returns:
        ``model``, pruned and loaded, in eval mode.

    Raises:
        FileNotFoundError: If ``checkpoint_path`` does not exist (the message names it).
        ValueError: For an argument of the wrong kind (``model`` not a module instance, ``strict`` not a bool, an
            ``example_input`` that is not an input or that ``model`` does not accept, an empty path or a directory);
            if the file is truncated, corrupted or not a Lightning checkpoint, or its pruning history is malformed
            or names layers ``model`` lacks; if no example input is available, or the checkpoint holds several
            pruning states.

    Example:
        >>> load_pruned_checkpoint("MyModule", "best.ckpt")
        Traceback (most recent call last):
        ...
        ValueError: `model` must be an nn.Module instance, got 'MyModule'.
    """
    model = check_module("model", model)
    path = _checked_path(checkpoint_path)
    example_input = check_example_input("example_input", example_input, optional=True)
    strict = check_bool("strict", strict)
    if example_input is not None:
        check_example_fits(model, example_input, "example_input")
    checkpoint = _read(path)
    state = find_pruning_state(checkpoint) or {}
    history = _checked_history(state, path)
    layers = dict(model.named_modules())
    missing = sorted({name for name, _, _ in history if name not in layers})
    if missing:
        raise ValueError(
            f"`model` must be a fresh module of the class that was trained, got {type(model).__name__}: the"
            f" checkpoint's pruning history names {missing[0]!r}, which it lacks."
        )
    if example_input is None:
        example_input = state.get("example_input")
    if example_input is None:
        example_input = getattr(model, "example_input_array", None)
    replay_pruning_history(model, example_input, history)
    model.load_state_dict(checkpoint["state_dict"], strict=strict)
    return model.eval()
