"""Batched fetch of in-memory tensors: the same batches as the per-sample loader, bit for bit, and only where safe."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, Subset, TensorDataset, default_collate

from lightning_speedkit.data.batched import BatchedTensors, batched_view, collated
from lightning_speedkit.dataloader import (
    LoaderSettings,
    NotRebuildableError,
    complete_settings,
    loader_settings,
    rebuild_dataloader,
)
from lightning_speedkit.dataloader.rebuild import BATCHED


def _tensors(n: int = 40) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 3, 2, generator=g), torch.randint(0, 5, (n,), generator=g), torch.rand(n, 1))


def _epoch(loader: DataLoader[Any], seed: int = 7) -> list[Any]:
    torch.manual_seed(seed)  # the shuffle's seed, drawn from the global RNG as in a fit
    return list(loader)


def _same(a: list[Any], b: list[Any]) -> bool:
    return len(a) == len(b) and all(
        len(x) == len(y) and all(u.dtype == v.dtype and torch.equal(u, v) for u, v in zip(x, y, strict=True))
        for x, y in zip(a, b, strict=True)
    )


@pytest.mark.parametrize(
    "dataset",
    [
        _tensors(),
        Subset(_tensors(), [5, 3, 9, 1, 0, 7]),
        Subset(Subset(_tensors(), list(range(30, 10, -1))), [2, 4, 6]),
    ],
    ids=["tensors", "subset", "subset-of-subset"],
)
def test_a_batch_fetched_at_once_equals_the_stacked_samples(dataset: Any) -> None:
    """Each tensor indexed once gives the values, dtypes and shapes `default_collate` makes of the samples."""
    view = BatchedTensors(dataset)
    indices = [2, 0, 1, 2]
    fetched = view.__getitems__(indices)
    stacked = default_collate([dataset[i] for i in indices])
    assert _same([fetched], [stacked])
    assert len(view) == len(dataset)
    assert all(torch.equal(a, b) for a, b in zip(view[1], dataset[1], strict=True))


def test_only_tensor_datasets_collated_by_default_collate_are_fetched_at_once() -> None:
    """A subclass, another dataset or another collate_fn may do more per sample: no batched view for them."""

    class Doubled(TensorDataset):
        def __getitem__(self, index: Any) -> Any:
            return tuple(2 * t[index] for t in self.tensors)

    data = _tensors()
    assert isinstance(batched_view(data), BatchedTensors)
    assert batched_view(Doubled(*data.tensors)) is None
    assert batched_view(list(range(4))) is None
    assert batched_view(data, collate_fn=lambda samples: samples) is None
    with pytest.raises(TypeError, match=r"`source` must be a TensorDataset or a Subset of one, got list"):
        BatchedTensors(list(range(4)))  # type: ignore[arg-type]


@pytest.mark.parametrize("drop_last", [False, True])
def test_a_loader_rebuilt_to_fetch_at_once_serves_the_same_epoch(drop_last: bool) -> None:
    """Same shuffle, same batches, same last batch; rebuilt again without the setting, it is the user's loader again."""
    loader = DataLoader(_tensors(), batch_size=6, shuffle=True, drop_last=drop_last)
    batched = rebuild_dataloader(loader, {"num_workers": 0, BATCHED: True})
    assert isinstance(batched.dataset, BatchedTensors)
    assert batched.collate_fn is collated
    assert loader_settings(batched)[BATCHED] is True
    assert BATCHED not in loader_settings(loader)
    assert _same(_epoch(batched), _epoch(loader))
    back = rebuild_dataloader(batched, {"num_workers": 0})
    assert back.dataset is loader.dataset
    assert back.collate_fn is default_collate
    assert _same(_epoch(back), _epoch(loader))


def test_a_loader_rebuilt_to_fetch_at_once_with_a_worker_serves_the_same_epoch() -> None:
    """A worker process fetches the batch at once too: the batches arrive as the single-process loader's."""
    loader = DataLoader(_tensors(), batch_size=8, shuffle=True)
    batched = rebuild_dataloader(loader, {"num_workers": 1, "persistent_workers": False, BATCHED: True})
    assert _same(_epoch(batched), _epoch(loader))


def test_fetching_at_once_is_refused_for_a_dataset_it_could_change() -> None:
    """A list dataset or a custom collate_fn: `batched_fetch` cannot keep the batches, so the rebuild is refused."""
    with pytest.raises(NotRebuildableError, match=r"`batched_fetch` needs a TensorDataset .* got a list"):
        rebuild_dataloader(DataLoader(list(range(8)), batch_size=2), {"num_workers": 0, BATCHED: True})
    own = DataLoader(_tensors(), batch_size=2, collate_fn=lambda samples: samples)
    with pytest.raises(NotRebuildableError, match=r"with its own collate_fn"):
        rebuild_dataloader(own, {"num_workers": 0, BATCHED: True})


def test_loader_settings_fetch_at_once_only_the_loaders_of_tensor_rows() -> None:
    """Applied to a module whose val loader is not rows of tensors, it rebuilds that one without the batched fetch."""

    class Data(L.LightningDataModule):
        def train_dataloader(self) -> DataLoader[Any]:
            return DataLoader(_tensors(), batch_size=4, shuffle=True)

        def val_dataloader(self) -> DataLoader[Any]:
            return DataLoader(list(range(8)), batch_size=4)

    refused: list[str] = []
    owner = Data()
    hooks = ("train_dataloader", "val_dataloader")
    settings = LoaderSettings(owner, complete_settings(0, batched_fetch=True), hooks, refused.append)
    settings.apply(None)  # type: ignore[arg-type]
    assert isinstance(owner.train_dataloader().dataset, BatchedTensors)
    assert owner.val_dataloader().dataset == list(range(8))
    assert refused == []
    settings.revert(None)  # type: ignore[arg-type]
    assert isinstance(owner.train_dataloader().dataset, TensorDataset)
