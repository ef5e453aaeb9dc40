"""`StructuredPruning`'s speedup targets: which one, whether any ratio reaches it, and each step's share of it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn

from lightning_speedkit.pruning.search import search_target
from lightning_speedkit.pruning.surgery import History

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["PlanArgs", "Target", "check_reachable", "plan_toward", "speedup_target"]

PlanArgs = tuple[list[str], str, int | None]
"""What every plan is made with: ``(ignored layer names, importance, round_to)``."""


@dataclass(frozen=True)
class Target:
    """A speedup target: the argument that set it, its value, what it counts and where latency is timed."""

    name: str
    goal: float
    kind: str
    device: str | torch.device

    @property
    def what(self) -> str:
        """How a speedup of this kind reads in a message: ``"fewer MACs"`` or ``"faster on cpu"``."""
        return "fewer MACs" if self.kind == "macs" else f"faster on {torch.device(self.device).type}"


def speedup_target(
    target_speedup: float | None, target_latency: float | None, latency_device: str, device: torch.device
) -> Target:
    """The `Target` of `StructuredPruning`'s arguments; latency is timed on ``device`` unless ``latency_device="cpu"``.

    Example:
        >>> speedup_target(None, 1.7, "cpu", torch.device("cpu")).what
        'faster on cpu'
    """
    if target_speedup is not None:
        return Target("target_speedup", float(target_speedup), "macs", device)
    return Target(
        "target_latency", float(target_latency or 0.0), "latency", "cpu" if latency_device == "cpu" else device
    )


def _search(model: nn.Module, example: Any, target: Target, goal: float, args: PlanArgs, iterations: int) -> Any:
    """``(ratio, plan, speedup)``: the smallest ratio making ``model`` ``goal`` times cheaper, as ``target`` counts."""
    return search_target(model, example, goal, target.kind, *args, target.device, iterations)


def check_reachable(trainer: pl.Trainer, model: nn.Module, example: Any, target: Target, args: PlanArgs) -> None:
    """Fail before training if no ratio reaches the whole target (a scan of pruned copies; the model is kept).

    Rank zero scans and broadcasts what it found, so every rank raises alike.
    """
    found = _search(model, example, target, target.goal, args, iterations=0) if trainer.is_global_zero else (0, [], 0)
    ratio, speedup = trainer.strategy.broadcast((found[0], found[2]), src=0)
    if speedup < target.goal:
        raise ValueError(
            f"`{target.name}` must be reachable, got {target.goal}: the best pruning ratio tried ({ratio:.2f})"
            f" reaches only {speedup:.2f}x {target.what}. Lower the target, ignore fewer layers or lower `round_to`"
            f" ({args[2]})."
        )


def plan_toward(
    model: nn.Module, example: Any, target: Target, step: int, steps: int, done: float, args: PlanArgs
) -> tuple[float, History, float]:
    """``(ratio, plan, speedup so far)`` of step ``step`` (0-based) of ``steps``, ``done`` times cheaper already.

    Each step aims at its geometric share of the goal, ``goal ** ((step + 1) / steps)``; falling short of it is a
    warning that says what to change.
    """
    share = target.goal ** ((step + 1) / steps)
    ratio, plan, speedup = _search(model, example, target, share / done, args, iterations=6)
    if speedup * done < share * 0.999:
        rank_zero_warn(
            f"StructuredPruning: step {step + 1} reaches {speedup * done:.2f}x {target.what}, short of its"
            f" {share:.2f}x; lower `round_to` ({args[2]}) or ignore fewer layers."
        )
    return ratio, plan, speedup * done
