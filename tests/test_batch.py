"""Tests of the batch helpers."""

from __future__ import annotations

import pytest
import torch

from lightning_speedkit.batch import batch_size_of, first_tensor


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (torch.zeros(5, 3), 5),
        ((torch.zeros(4, 2), torch.zeros(4)), 4),
        ([{"image": torch.zeros(7, 3)}, "label"], 7),
        ((torch.tensor(1.0), torch.zeros(3)), 3),  # a 0-d tensor has no batch dimension
        ("text", None),
        ((), None),
    ],
)
def test_batch_size_of_table(value: object, expected: int | None) -> None:
    """The batch size is the leading dimension of the first tensor with one."""
    assert batch_size_of(value) == expected


def test_first_tensor_searches_depth_first() -> None:
    """Nested containers are searched in order, dict values included."""
    inner = torch.ones(2)
    assert first_tensor([{"a": "x", "b": inner}, torch.zeros(3)]) is inner
