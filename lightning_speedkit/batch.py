"""What is in a batch: the first tensor of a nested batch, and its batch size."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor

__all__ = ["batch_size_of", "first_tensor"]


def first_tensor(value: Any, min_dim: int = 0) -> Tensor | None:
    """The first tensor with at least ``min_dim`` dimensions in a (nested) tuple, list or dict, depth first.

    Example:
        >>> import torch
        >>> first_tensor(({"x": torch.zeros(5, 3)}, torch.zeros(2))).shape
        torch.Size([5, 3])
        >>> first_tensor("no tensors") is None
        True
    """
    if isinstance(value, Tensor):
        return value if value.dim() >= min_dim else None
    items = value.values() if isinstance(value, Mapping) else value if isinstance(value, (list, tuple)) else ()
    for item in items:
        found = first_tensor(item, min_dim)
        if found is not None:
            return found
    return None


def batch_size_of(value: Any) -> int | None:
    """The leading dimension of the first tensor in ``value`` that has one (tensors, sequences and dicts).

    Example:
        >>> import torch
        >>> batch_size_of(({"x": torch.zeros(5, 3)}, torch.zeros(2)))
        5
        >>> batch_size_of("no tensors") is None
        True
    """
    tensor = first_tensor(value, min_dim=1)  # a 0-d tensor has no batch dimension
    return int(tensor.shape[0]) if tensor is not None else None
