"""An LR multiplier applied only inside each ``optimizer.step()``, and the user's LR put back whatever ends the step.

`StepFactor` hooks every optimizer of a fit (torch's step pre and post hooks): just before the update each param
group's LR is multiplied by the factor its owner gives, just after it is put back. Everywhere else (the user's
schedulers, ``ReduceLROnPlateau``, checkpoints, ``LearningRateMonitor``) the groups hold the user's own LR. Under
automatic optimization Lightning runs ``training_step`` and backward inside ``optimizer.step(closure)``, so an
exception there (or Ctrl-C) ends a step whose post hook never runs: `detach` (from ``on_exception`` and ``teardown``)
and `saved` (from ``on_save_checkpoint``: a checkpoint written on that exception, by a callback that ran first) put
the user's LR back, so no multiplier is left in the optimizer or in a checkpoint for a resume to train at.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

from lightning.pytorch.utilities import rank_zero_warn

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from torch.optim import Optimizer
    from torch.utils.hooks import RemovableHandle

__all__ = ["StepFactor", "has_lrs"]


def has_lrs(optimizer: Optimizer) -> bool:
    """Whether every param group of ``optimizer`` has an ``lr`` (an LR-free optimizer's have none).

    Example:
        >>> import torch
        >>> has_lrs(torch.optim.SGD([torch.zeros(1)], lr=0.1))
        True
    """
    return all("lr" in group for group in optimizer.param_groups)


class StepFactor:
    """Multiply every param group's LR by ``factor(trainer, index)`` inside each step of the fit's optimizers.

    Args:
        owner: The callback's name, for the warning when something else writes an LR during the step.
        factor: The multiplier for this step of optimizer ``index`` (called in its pre hook), or None to leave the
            step as it is. A subclass's ``step`` calling ``super().step()`` runs the hooks nested (torch hooks each
            class's step): the factor is applied once, and the first post hook puts the LR back.
        written: Called with ``(trainer, index, factor, lrs)`` once the multiplied LRs are in place (to log them).
    """

    def __init__(
        self,
        owner: str,
        factor: Callable[[pl.Trainer, int], float | None],
        written: Callable[[pl.Trainer, int, float, list[Any]], None] | None = None,
    ) -> None:
        self.owner, self.factor, self.written = owner, factor, written
        self._attached: list[Optimizer] = []
        self._handles: list[RemovableHandle] = []
        self._inflight: dict[int, tuple[list[Any], list[Any]]] = {}  # per optimizer index: (the user's, ours)
        self._warned = False
        self.left_alone: list[str] = []
        """The optimizers with no ``lr`` in a param group (an LR-free one): no factor applies to their steps."""

    def attach(self, trainer: pl.Trainer) -> None:
        """Hook the fit's optimizers (again, when they changed: an optimizer compares by identity)."""
        if self._attached == trainer.optimizers:
            return
        self.detach()
        for index, optimizer in enumerate(trainer.optimizers):
            self._handles.append(optimizer.register_step_pre_hook(partial(self._before, trainer, index)))
            self._handles.append(optimizer.register_step_post_hook(partial(self._after, index)))
        self._attached = list(trainer.optimizers)

    def detach(self) -> None:
        """Remove the hooks; a step still in flight (an exception ended it) gets the user's LR back."""
        for index, optimizer in enumerate(self._attached):
            if index in self._inflight:
                self._put_back(index, optimizer.param_groups, warn=False)
        for handle in self._handles:
            handle.remove()
        self._handles, self._attached = [], []
        self._inflight.clear()

    def saved(self, checkpoint: dict[str, Any]) -> None:
        """In a checkpoint written while a step is in flight, the user's LR where the optimizer state holds ours."""
        states = checkpoint.get("optimizer_states") or []
        for index, (originals, ours) in self._inflight.items():
            if index < len(states):
                groups = states[index].get("param_groups", [])
                for group, original, mine in zip(groups, originals, ours, strict=False):
                    if group.get("lr") is mine or group.get("lr") == mine:
                        group["lr"] = original

    def reset_warning(self) -> None:
        """Warn again, once, in the next fit (and list its LR-free optimizers afresh)."""
        self._warned = False
        self.left_alone = []

    def _before(self, trainer: pl.Trainer, index: int, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        if index in self._inflight:  # nested: a subclass's step calling super().step()
            return
        if not self._has_lrs(index, optimizer) or (factor := self.factor(trainer, index)) is None:
            return
        originals = [group["lr"] for group in optimizer.param_groups]
        for group, lr in zip(optimizer.param_groups, ours := [lr * factor for lr in originals], strict=True):
            group["lr"] = lr
        self._inflight[index] = (originals, ours)
        if self.written is not None:
            self.written(trainer, index, factor, ours)

    def _has_lrs(self, index: int, optimizer: Optimizer) -> bool:
        """Whether every param group has an ``lr``; an LR-free optimizer's steps are left as they are, said once."""
        if has_lrs(optimizer):
            return True
        if (name := f"optimizer {index} ({type(optimizer).__name__})") not in self.left_alone:
            self.left_alone.append(name)
            rank_zero_warn(f"{self.owner}: {name} has no `lr` in its param groups; its steps are left as they are.")
        return False

    def _after(self, index: int, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        if index in self._inflight:
            self._put_back(index, optimizer.param_groups, warn=True)

    def _put_back(self, index: int, groups: list[dict[str, Any]], warn: bool) -> None:
        originals, ours = self._inflight.pop(index)
        for group, original, mine in zip(groups, originals, ours, strict=False):
            if group["lr"] is mine:
                group["lr"] = original
            elif warn and not self._warned:
                self._warned = True
                rank_zero_warn(
                    f"{self.owner}: optimizer {index}'s LR was changed during optimizer.step(); keeping the new"
                    " value. Change LRs outside the step (e.g. with `rescale_base_lrs`)."
                )
