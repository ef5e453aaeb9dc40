"""What is in a batch: the first tensor of a nested batch, its batch size, and how a module is called on an example."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

from torch import Tensor, nn

__all__ = ["batch_size_of", "first_tensor", "forward_example", "modes_kept"]


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


def forward_example(model: nn.Module, example: Any) -> Any:
    """Call ``model`` the way Lightning treats ``example_input_array``: tuple/list -> ``*args``, dict -> ``**kwargs``.

    Example:
        >>> import torch
        >>> forward_example(nn.Bilinear(2, 3, 4), (torch.zeros(1, 2), torch.zeros(1, 3))).shape
        torch.Size([1, 4])
    """
    if isinstance(example, (tuple, list)):
        return model(*example)
    if isinstance(example, dict):
        return model(**example)
    return model(example)


@contextlib.contextmanager
def modes_kept(model: nn.Module) -> Iterator[None]:
    """Restore every submodule's own train/eval flag afterwards (``model.train()`` would set them all alike).

    Example:
        >>> net = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2).eval())
        >>> with modes_kept(net):
        ...     _ = net.eval()
        >>> net.training, net[1].training
        (True, False)
    """
    modes = [(m, m.training) for m in model.modules()]
    try:
        yield
    finally:
        for module, training in modes:
            module.training = training
