"""Resuming a pruned fit: rebuild the pruned architecture from the checkpoint's pruning state before its weights load.

Shared by `StructuredPruning` (whose module gets a `RestoreHook`) and `load_pruned_checkpoint` (which reads the
state with `find_pruning_state`); neither imports the other.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torch import nn

from lightning_speedkit.pruning.surgery import replay_pruning_history

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["BeforeLoad", "RestoreHook", "find_pruning_state", "rebuild_before_load"]

BeforeLoad = Callable[[nn.Module, dict[str, Any], str], None]
"""What a `RestoreHook` calls: ``(module, state_dict, prefix)``, before ``state_dict`` loads into ``module``."""


class RestoreHook:
    """A module's ``load_state_dict`` pre-hook that calls a callback's bound method through a weak reference.

    Copies and pickles of the module (planning copies, MAC counting) get a hook that does nothing, so they never
    drag the callback, and through it the Trainer, along.
    """

    def __init__(self, before_load: BeforeLoad) -> None:
        self._ref: Callable[[], BeforeLoad | None] = weakref.WeakMethod(before_load)  # type: ignore[arg-type]

    def __call__(self, module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        """Let the callback reshape ``module`` before ``state_dict`` loads into it."""
        before_load = self._ref()
        if before_load is not None:
            before_load(module, state_dict, prefix)

    def __getstate__(self) -> dict[str, Any]:
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._ref = lambda: None


def find_pruning_state(checkpoint: dict[str, Any]) -> dict[str, Any] | None:
    """The one ``StructuredPruning`` callback state in a Lightning checkpoint dict, or None.

    Raises:
        ValueError: If the checkpoint holds several.

    Example:
        >>> find_pruning_state({"callbacks": {"StructuredPruning{'amount': 0.5}": {"history": []}}})
        {'history': []}
    """
    callbacks = checkpoint.get("callbacks")
    callbacks = callbacks if isinstance(callbacks, dict) else {}
    states = [v for k, v in callbacks.items() if str(k).startswith("StructuredPruning")]
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
