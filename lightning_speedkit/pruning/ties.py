"""Tied parameters through pruning: torch-pruning gives every place of a shared parameter a new one of its own."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["retie", "ties"]


def ties(model: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """The places of each parameter held by more than one module attribute (``dec.weight = emb.weight``).

    Example:
        >>> net = nn.Sequential(nn.Embedding(4, 2), nn.Linear(2, 4, bias=False))
        >>> net[1].weight = net[0].weight
        >>> [[type(module).__name__ + "." + name for module, name in places] for places in ties(net)]
        [['Embedding.weight', 'Linear.weight']]
    """
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for name, parameter in module._parameters.items():
            if parameter is not None:
                owners.setdefault(id(parameter), []).append((module, name))
    return [places for places in owners.values() if len(places) > 1]


def retie(model: nn.Module, ties: list[list[tuple[nn.Module, str]]], history: Sequence[Any] = ()) -> None:
    """Share each tied parameter again after pruning gave every place a new one of its own.

    torch-pruning removes the same channels from every place of a shared parameter, but writes each a new
    ``nn.Parameter``: left so, the places train apart and the model holds the parameter twice.

    Raises:
        RuntimeError: If the pruned places no longer hold the same values (they cannot be one parameter again); it
            names the layers of ``history`` (torch-pruning's) whose output channels were as many as the cut: theirs
            changed one place, left whole they would not.
    """
    names = {id(module): name for name, module in model.named_modules()}
    for (first_module, first_name), *others in ties:
        first = getattr(first_module, first_name)
        for module, name in others:
            other = getattr(module, name)
            if other is not first and (other.shape != first.shape or not torch.equal(other, first)):
                where = [f"{names.get(id(m), '?')}.{n}" for m, n in ((first_module, first_name), (module, name))]
                cut = sum(abs(a - b) for a, b in zip(first.shape, other.shape, strict=False))  # channels cut from one
                causes = [f"`{layer}`" for layer, out, idxs in history if out and len(idxs) == cut]  # whose outputs
                advice = f"add {' or '.join(causes) or 'one of the layers'} to `ignored_layers`"
                raise RuntimeError(
                    f"StructuredPruning: {where[0]} and {where[1]} share one parameter, and pruning made them differ"
                    f" ({tuple(first.shape)} and {tuple(other.shape)}): {advice}."
                )
            setattr(module, name, first)
