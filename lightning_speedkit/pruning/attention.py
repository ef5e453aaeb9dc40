"""Attention layers for torch-pruning: find them, tell it their heads, and update their head counts after pruning.

Three kinds are recognised:

- ``"multihead"``: ``nn.MultiheadAttention`` with one packed input projection. torch-pruning shrinks its embedding
  dimension (and so each head's width) with the rest of the residual stream and updates ``embed_dim`` and
  ``head_dim`` itself; channel counts are rounded to a multiple of ``num_heads``, so the width stays divisible.
- ``"fused"``: a module with an int head count (``num_heads``, ``num_attention_heads``, ...) and one ``qkv``
  ``nn.Linear`` whose output is reshaped by that count (timm's Vision Transformer ``Attention``).
- ``"split"``: the same with three Linears, ``query``/``key``/``value``, ``q_proj``/``k_proj``/``v_proj`` or
  ``q``/``k``/``v`` (a BERT-style self-attention).

For the last two, whole heads are removed (each head keeps its width, so the attention scale still fits) and the
module's head count, and an ``all_head_size``-style field, are set from the pruned weights afterwards.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

from torch import nn

from lightning_speedkit.checks import is_int
from lightning_speedkit.pruning.arguments import check_module

log = logging.getLogger(__name__)

__all__ = [
    "HEAD_COUNT_FIELDS",
    "AttentionLayer",
    "find_attention",
    "heads_to_remove",
    "pruner_arguments",
    "unprunable_attention",
    "update_head_counts",
]

HEAD_COUNT_FIELDS = ("num_heads", "num_attention_heads", "n_heads", "n_head")
"""Attribute names read as a module's head count, in this order."""

_PROJECTIONS = (("qkv",), ("query", "key", "value"), ("q_proj", "k_proj", "v_proj"), ("q", "k", "v"))
_WIDTH_FIELDS = ("all_head_size", "inner_dim", "attn_dim")  # total width of the heads, where a module keeps one


@dataclass(frozen=True)
class AttentionLayer:
    """One attention module that torch-pruning can shrink.

    Attributes:
        name: The module's name in the model.
        kind: ``"multihead"``, ``"fused"`` or ``"split"`` (see the module docstring).
        projections: Names (in the module) of the Linears that make q, k and v; empty for ``"multihead"``.
        heads_field: The attribute holding the head count.
        heads: The head count now.
        head_dim: The width of one head now.
    """

    name: str
    kind: str
    projections: tuple[str, ...]
    heads_field: str
    heads: int
    head_dim: int


def _heads_field(module: nn.Module) -> str | None:
    for field in HEAD_COUNT_FIELDS:
        value = getattr(module, field, None)
        if is_int(value, low=1):
            return field
    return None


def _projections(module: nn.Module, heads: int) -> tuple[tuple[str, ...], int] | None:
    """The q/k/v Linears of ``module`` and the head width they imply, if they split evenly into ``heads``."""
    children = dict(module.named_children())
    for names in _PROJECTIONS:
        linears = [children.get(name) for name in names]
        if not all(isinstance(linear, nn.Linear) for linear in linears):
            continue
        widths = {linear.out_features for linear in linears if isinstance(linear, nn.Linear)}
        per_head = heads * (3 if len(names) == 1 else 1)
        if len(widths) == 1 and next(iter(widths)) % per_head == 0:
            return names, next(iter(widths)) // per_head
    return None


def find_attention(model: nn.Module) -> list[AttentionLayer]:
    """The attention modules of ``model`` that torch-pruning can shrink with their head structure kept.

    Example:
        >>> class SelfAttention(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.num_heads, self.qkv, self.proj = 4, nn.Linear(32, 96), nn.Linear(32, 32)
        >>> [(a.name, a.kind, a.heads, a.head_dim) for a in find_attention(nn.Sequential(SelfAttention()))]
        [('0', 'fused', 4, 8)]
    """
    found = []
    for name, module in check_module("model", model).named_modules():
        if isinstance(module, nn.MultiheadAttention):
            if module._qkv_same_embed_dim:
                found.append(AttentionLayer(name, "multihead", (), "num_heads", module.num_heads, module.head_dim))
            continue
        field = _heads_field(module)
        if field is None:
            continue
        heads = getattr(module, field)
        projections = _projections(module, heads)
        if projections is not None:
            kind = "fused" if len(projections[0]) == 1 else "split"
            found.append(AttentionLayer(name, kind, projections[0], field, heads, projections[1]))
    return found


def unprunable_attention(model: nn.Module) -> list[str]:
    """``nn.MultiheadAttention`` modules torch-pruning would break: separate q/k/v weights (``kdim``/``vdim``).

    Example:
        >>> cross = nn.MultiheadAttention(8, 2, kdim=4, vdim=4)
        >>> unprunable_attention(nn.Sequential(cross, nn.MultiheadAttention(8, 2)))
        ['0']
    """
    return [n for n, m in model.named_modules() if isinstance(m, nn.MultiheadAttention) and not m._qkv_same_embed_dim]


def heads_to_remove(heads: int, ratio: float) -> int:
    """Whole heads that a channel ``ratio`` removes from ``heads``: the nearest count, keeping at least one head.

    Example:
        >>> [heads_to_remove(4, ratio) for ratio in (0.1, 0.3, 0.5, 0.95)]
        [0, 1, 2, 3]
    """
    return max(0, min(heads - 1, math.floor(heads * ratio + 0.5)))


def pruner_arguments(
    model: nn.Module, layers: list[AttentionLayer], ratio: float, round_to: int | None
) -> dict[str, Any]:
    """Keyword arguments for torch-pruning's ``BasePruner`` that prune ``layers`` by heads at channel ``ratio``.

    Fused and split attention lose `heads_to_remove` whole heads (torch-pruning's ``num_heads`` with head pruning;
    head widths are kept). ``nn.MultiheadAttention`` shrinks with the embedding: ``round_to`` becomes a multiple of
    its head count, so the width stays divisible by it. The dicts are fresh: torch-pruning fills its default dict
    arguments in place, which would keep every pruned copy alive.

    Example:
        >>> pruner_arguments(nn.Sequential(nn.MultiheadAttention(32, 4)), [], 0.5, 8)["round_to"]
        8
        >>> net = nn.Sequential(nn.MultiheadAttention(36, 6))
        >>> pruner_arguments(net, find_attention(net), 0.5, 8)["round_to"]
        24
    """
    num_heads: dict[nn.Module, int] = {}
    head_ratios: dict[nn.Module, float] = {}
    for layer in layers:
        module = model.get_submodule(layer.name)
        if layer.kind == "multihead":
            round_to = math.lcm(round_to or 1, layer.heads)
            continue
        removed = heads_to_remove(layer.heads, ratio)
        for projection in layer.projections:
            linear = module.get_submodule(projection)
            num_heads[linear] = layer.heads
            # torch-pruning removes ceil(ratio * heads) heads: aim half a head below the count we want.
            head_ratios[linear] = (removed - 0.5) / layer.heads if removed else 0.0
    return {
        "num_heads": num_heads,
        "prune_num_heads": bool(num_heads),
        "prune_head_dims": False,
        "head_pruning_ratio_dict": head_ratios,
        "round_to": round_to,
        "in_channel_groups": {},
        "out_channel_groups": {},
    }


def update_head_counts(model: nn.Module, layers: list[AttentionLayer]) -> None:
    """Set each fused/split layer's head count (and total head width field) from its pruned projections.

    ``layers`` are those found before pruning: their head width is what each remaining head still has.

    Example:
        >>> attention = nn.Module()
        >>> attention.num_heads, attention.qkv = 4, nn.Linear(32, 96)
        >>> layers = find_attention(attention)
        >>> attention.qkv = nn.Linear(32, 48)  # two of the four heads removed
        >>> update_head_counts(attention, layers)
        >>> attention.num_heads
        2
    """
    check_module("model", model)
    if not isinstance(layers, (list, tuple)) or not all(isinstance(layer, AttentionLayer) for layer in layers):
        raise ValueError(f"`layers` must be a list of AttentionLayer (from find_attention), got {layers!r}.")
    for layer in layers:
        if layer.kind == "multihead":
            continue  # torch-pruning sets embed_dim and head_dim; the head count does not change
        module = model.get_submodule(layer.name)
        out_features = int(module.get_submodule(layer.projections[0]).out_features)  # type: ignore[arg-type]
        width = out_features // (3 if layer.kind == "fused" else 1)
        heads = width // layer.head_dim
        if heads * layer.head_dim != width:
            raise RuntimeError(
                f"StructuredPruning: attention `{layer.name}` has {width} channels after pruning, not a whole number"
                f" of heads of {layer.head_dim}: pass it in `ignored_layers`."
            )
        setattr(module, layer.heads_field, heads)
        for field in _WIDTH_FIELDS:
            if isinstance(getattr(module, field, None), int):
                setattr(module, field, width)
