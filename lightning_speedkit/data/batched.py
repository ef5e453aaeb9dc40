"""Fetch a batch of in-memory tensors with one indexing call, not one call and a stack per sample.

A ``DataLoader`` over a ``TensorDataset`` asks the dataset for each sample of a batch (a tuple of row views), then
`default_collate` stacks the rows back into the batch: on `benchmarks/lr_tasks.py`'s MLP (64 rows of 32 features a
batch, 2-core EPYC, AVX2) that is 0.6 ms of a 1.7 ms training step. `BatchedTensors` serves the same batch as
``tensor[indices]`` for each tensor, one call each: the same values, dtype and shape as the stacked rows, so the
training run is the same run, bit for bit, only the wait for data is shorter. torch's loader uses a dataset's
``__getitems__`` for a whole batch of indices when it has one, and `collated` passes that batch through unchanged.
`lightning_speedkit.DataLoaderTuner` tries it as one more loader setting (``batched_fetch=True``), on real steps.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import Dataset, Subset, TensorDataset, default_collate

__all__ = ["BatchedTensors", "batched_view", "collated", "fetches_at_once"]


def fetches_at_once(dataset: object, collate_fn: object = default_collate) -> bool:
    """Whether a batch of ``dataset`` fetched at once is the loader's own batch: `batched_view` would give a view.

    Only a ``TensorDataset`` (or a ``Subset`` of one, nested) collated by `default_collate`: another dataset's samples
    may be computed per sample, and another ``collate_fn`` may do more than stack them. Types only: nothing is built.

    Example:
        >>> data = TensorDataset(torch.zeros(4, 3))
        >>> fetches_at_once(Subset(Subset(data, [0, 2, 3]), [1])), fetches_at_once(data, collate_fn=list)
        (True, False)
    """
    while type(dataset) is Subset:
        dataset = dataset.dataset
    return collate_fn is default_collate and type(dataset) is TensorDataset  # a subclass may change what a sample is


def _tensors_of(dataset: Dataset[Any]) -> tuple[tuple[Tensor, ...], Tensor | None]:
    """The tensors the samples of ``dataset`` (`fetches_at_once`) are rows of, and which rows (None: all, in order)."""
    if isinstance(dataset, Subset):
        tensors, rows = _tensors_of(dataset.dataset)
        picked = torch.as_tensor(list(dataset.indices), dtype=torch.long)
        return tensors, picked if rows is None else rows[picked]
    assert isinstance(dataset, TensorDataset)  # checked by the caller (`fetches_at_once`)
    return tuple(dataset.tensors), None


class BatchedTensors(Dataset[Any]):
    """``source`` (a ``TensorDataset``, or a ``Subset`` of one) with a ``__getitems__`` that indexes once a tensor.

    ``__getitems__`` returns the collated batch (a list of tensors, as `default_collate` makes of tuple samples), so
    the loader's ``collate_fn`` must be `collated`; ``__getitem__`` and ``len`` are ``source``'s own.

    Args:
        source: The dataset to serve (see `batched_view`).

    Raises:
        TypeError: If ``source`` is not a ``TensorDataset`` or a ``Subset`` of one.

    Example:
        >>> data = TensorDataset(torch.arange(12.0).reshape(6, 2), torch.arange(6))
        >>> view = BatchedTensors(data)
        >>> view.__getitems__([4, 1])
        [tensor([[8., 9.],
                [2., 3.]]), tensor([4, 1])]
        >>> all(torch.equal(a, b) for a, b in zip(view.__getitems__([4, 1]), default_collate([data[4], data[1]])))
        True
    """

    def __init__(self, source: Dataset[Any]) -> None:
        if not fetches_at_once(source):
            raise TypeError(f"`source` must be a TensorDataset or a Subset of one, got {type(source).__name__}.")
        self.source = source
        self._tensors, self._rows = _tensors_of(source)

    def __len__(self) -> int:
        return len(self.source)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> Any:
        return self.source[index]

    def __getitems__(self, indices: Sequence[int]) -> list[Tensor]:
        """The batch of ``indices``, collated: each tensor indexed once."""
        index = torch.as_tensor(indices, dtype=torch.long)
        if self._rows is not None:
            index = self._rows[index]
        return [tensor[index] for tensor in self._tensors]


def collated(batch: Any) -> Any:
    """The ``collate_fn`` of a loader over `BatchedTensors`: its batches come collated, so pass them through.

    Example:
        >>> collated([torch.zeros(2)])
        [tensor([0., 0.])]
    """
    return batch


def batched_view(dataset: object, collate_fn: object = default_collate) -> BatchedTensors | None:
    """``dataset`` as a `BatchedTensors`, or None when a batch fetched at once could differ from the loader's own.

    Only where `fetches_at_once` says so.

    Example:
        >>> data = TensorDataset(torch.zeros(4, 3))
        >>> type(batched_view(data)).__name__, batched_view(Subset(data, [0, 2])) is not None
        ('BatchedTensors', True)
        >>> batched_view(data, collate_fn=lambda samples: samples), batched_view([1, 2, 3])
        (None, None)
    """
    return BatchedTensors(dataset) if fetches_at_once(dataset, collate_fn) else None  # type: ignore[arg-type]
