"""What `TrialSession` copies and puts back beside the state dicts: host copies, loop flags, a GradScaler's state."""

from __future__ import annotations

import copy
from collections import defaultdict
from typing import Any

from lightning.pytorch.loops.loop import _Loop
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor
from torch.amp.grad_scaler import _refresh_per_optimizer_state

__all__ = ["cpu_copy", "loop_flags", "reset_grad_scaler", "restore_loop_flags"]


def cpu_copy(value: Any) -> Any:
    """A deep copy with every tensor copied to host memory (so a snapshot costs no device memory).

    Example:
        >>> import torch
        >>> state = {"w": torch.ones(2), "step": 3}
        >>> copied = cpu_copy(state)
        >>> copied["w"].add_(1.0).tolist(), state["w"].tolist(), copied["step"]
        ([2.0, 2.0], [1.0, 1.0], 3)
    """
    copies: dict[int, Tensor] = {}

    def host(tensor: Tensor) -> Tensor:
        copied = tensor.detach().to("cpu", copy=True)
        copies[id(copied)] = copied
        return copied

    return copy.deepcopy(apply_to_collection(value, Tensor, host), memo=copies)  # the host copies are not copied again


def _loops(loop: _Loop) -> list[_Loop]:
    """``loop`` and every loop under it."""
    found = [loop]
    for value in vars(loop).values():
        if isinstance(value, _Loop):
            found += _loops(value)
    return found


def loop_flags(loop: _Loop) -> list[tuple[_Loop, bool, bool]]:
    """``(loop, restarting, resuming)`` of ``loop`` and every loop under it, for `restore_loop_flags`.

    Loading a loop's state marks it (and its children) restarting and resuming from a checkpoint; a trial loads the
    fit loop's state, so a session started mid-fit puts these flags back, or the run's next epoch would take itself
    for a resumed one (and skip its data iterator's reset).
    """
    return [(each, each._restarting, each._resuming_from_checkpoint) for each in _loops(loop)]


def restore_loop_flags(flags: list[tuple[_Loop, bool, bool]]) -> None:
    """Put back what `loop_flags` read."""
    for loop, restarting, resuming in flags:
        loop._restarting, loop._resuming_from_checkpoint = restarting, resuming


def reset_grad_scaler(plugin: Any) -> None:
    """Forget a GradScaler's per-optimizer step state, which ``load_state_dict`` leaves as it is.

    An OOM between ``unscale_`` and ``update`` leaves an optimizer marked unscaled; the next trial's ``unscale_``
    would then fail with "unscale_() has already been called".
    """
    scaler = getattr(plugin, "scaler", None)
    if scaler is not None and hasattr(scaler, "_per_optimizer_states"):
        scaler._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)
