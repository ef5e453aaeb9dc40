"""Tests of the demo data: generation on disk, the decoding Dataset and the DataModule."""

from __future__ import annotations

import multiprocessing
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from lightning_speedkit.demo import data as demo_data
from lightning_speedkit.demo.data import CLASSES, DemoDataModule, ShapesDataset, ensure_shapes, render_shape


def test_render_shape_is_deterministic() -> None:
    """The same index and seed always draw the same pixels; another seed draws another image."""
    first, label = render_shape(7, image_size=32, seed=1)
    again, label_again = render_shape(7, image_size=32, seed=1)
    other, _ = render_shape(7, image_size=32, seed=2)
    assert label == label_again == 7
    assert np.array_equal(np.asarray(first), np.asarray(again))
    assert not np.array_equal(np.asarray(first), np.asarray(other))


def test_render_shape_cycles_through_all_classes() -> None:
    """Ten consecutive indices give the ten classes, so any split of enough images is balanced."""
    assert [render_shape(i, image_size=32)[1] for i in range(len(CLASSES))] == list(range(len(CLASSES)))


def test_ensure_shapes_writes_once_and_reuses(tmp_path: Path) -> None:
    """The first call writes JPEG files and a manifest; the second reuses them without rewriting."""
    directory = ensure_shapes(20, image_size=32, root=tmp_path)
    files = sorted(directory.glob("*.jpg"))
    assert len(files) == 20
    assert (directory / "manifest.json").is_file()
    mtime = files[0].stat().st_mtime_ns
    assert ensure_shapes(20, image_size=32, root=tmp_path) == directory
    assert files[0].stat().st_mtime_ns == mtime
    assert [p.name for p in tmp_path.iterdir()] == [directory.name]  # no temporary directory left behind


def test_ensure_shapes_leaves_nothing_after_a_crash(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A failure half-way through generation leaves neither a data set nor a temporary directory."""
    real = demo_data.render_shape

    def failing(index: int, image_size: int = 64, seed: int = 0) -> object:
        if index == 5:
            raise OSError("disk full")
        return real(index, image_size, seed)

    monkeypatch.setattr(demo_data, "render_shape", failing)
    with pytest.raises(OSError, match="disk full"):
        ensure_shapes(20, image_size=32, root=tmp_path)
    assert list(tmp_path.iterdir()) == []


def _generate(root: str) -> str:
    return str(ensure_shapes(30, image_size=32, root=root))


def test_ensure_shapes_concurrent_writers_agree(tmp_path: Path) -> None:
    """Two processes generating the same data set at once both end with the same complete directory."""
    with multiprocessing.get_context("spawn").Pool(2) as pool:
        results = pool.map(_generate, [str(tmp_path)] * 2)
    assert results[0] == results[1]
    assert len(list(Path(results[0]).glob("*.jpg"))) == 30
    assert [p.name for p in tmp_path.iterdir()] == [Path(results[0]).name]


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [({"num_images": 3}, "num_images"), ({"num_images": 20, "image_size": 8}, "image_size")],
)
def test_ensure_shapes_rejects_bad_sizes(tmp_path: Path, kwargs: dict[str, int], argument: str) -> None:
    """Too few images or too small images are refused with the argument's name."""
    with pytest.raises(ValueError, match=f"`{argument}`"):
        ensure_shapes(root=tmp_path, **kwargs)


def test_dataset_decodes_crops_and_augments(demo_cache: Path) -> None:
    """Training samples are random crops (with flips) of the decoded file; validation samples are fixed."""
    directory = ensure_shapes(20, image_size=64, root=demo_cache)
    train = ShapesDataset(directory, range(20), crop_size=56, train=True)
    val = ShapesDataset(directory, range(20), crop_size=56, train=False)
    x, y = train[3]
    assert x.shape == (3, 56, 56)
    assert x.dtype == torch.float32
    assert y == 3
    torch.manual_seed(0)
    draws = [train[3][0] for _ in range(8)]
    assert any(not torch.equal(draws[0], d) for d in draws[1:])
    assert torch.equal(val[3][0], val[3][0])


def test_datamodule_splits_disjointly(demo_cache: Path) -> None:
    """The train and validation sets cover every image exactly once, and loaders use the configured batch size."""
    dm = DemoDataModule(num_images=50, batch_size=4, val_fraction=0.2, root=demo_cache)
    dm.prepare_data()
    dm.setup("fit")
    assert dm.train_set is not None
    assert dm.val_set is not None
    assert len(dm.val_set) == 10
    assert sorted(dm.train_set.indices + dm.val_set.indices) == list(range(50))
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == (4, 3, 56, 56)
    assert y.shape == (4,)
    assert dm.val_dataloader().batch_size == 4


def test_datamodule_workers_decode_the_same_data(demo_cache: Path) -> None:
    """Worker processes return the same validation batches as the main process."""
    dm = DemoDataModule(num_images=20, batch_size=5, root=demo_cache)
    dm.prepare_data()
    dm.setup("fit")
    serial = [x for x, _ in dm.val_dataloader()]
    dm.num_workers = 2
    parallel = [x for x, _ in dm.val_dataloader()]
    assert all(torch.equal(a, b) for a, b in zip(serial, parallel, strict=True))


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [
        ({"crop_size": 80}, "crop_size"),
        ({"val_fraction": 1.0}, "val_fraction"),
        ({"batch_size": 0}, "batch_size"),
        ({"num_workers": -1}, "num_workers"),
        ({"batch_size": 2.5}, "batch_size"),
        ({"num_images": 5}, "num_images"),
        ({"crop_size": "big"}, "crop_size"),
        ({"pin_memory": "yes"}, "pin_memory"),
    ],
)
def test_datamodule_rejects_bad_arguments(kwargs: dict[str, float], argument: str) -> None:
    """Each bad constructor argument is refused with its name."""
    with pytest.raises(ValueError, match=f"`{argument}`"):
        DemoDataModule(**kwargs)  # type: ignore[arg-type]


def test_default_cache_dir_follows_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """``SPEEDKIT_CACHE_DIR`` moves the cache; without it the cache is under the home directory."""
    monkeypatch.setenv("SPEEDKIT_CACHE_DIR", str(tmp_path))
    assert demo_data.default_cache_dir() == tmp_path
    monkeypatch.delenv("SPEEDKIT_CACHE_DIR")
    assert demo_data.default_cache_dir() == Path(os.path.expanduser("~")) / ".cache" / "lightning_speedkit"
