"""Tests of the DataLoaderTuner and its pure parts."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from conftest import load_benchmark, rank_records, tiny_trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset, RandomSampler, SequentialSampler

from lightning_speedkit.dataloader import (
    DataLoaderTuner,
    NotRebuildableError,
    choose_fastest,
    default_candidates,
    probe_loader,
    rebuild_dataloader,
)


class SlowDataset(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """16 features, 4 classes; each item sleeps ``delay`` seconds like a slow decode; counts its reads in a file."""

    def __init__(self, n: int = 64, delay: float = 0.0, seed: int = 0, counter: Path | None = None) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 16, generator=g)
        self.y = self.x[:, :4].argmax(dim=1)
        self.delay, self.counter = delay, counter

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.delay:
            time.sleep(self.delay)
        if self.counter is not None:
            with open(self.counter, "a") as handle:
                handle.write("x")
        return self.x[i] + 0.01 * torch.randn(16), self.y[i]  # augmentation draws from the RNG


def collate(batch: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    xs, ys = zip(*batch, strict=True)
    return torch.stack(xs), torch.stack(ys)


class SlowData(L.LightningDataModule):
    """A DataModule with a custom collate_fn and drop_last, so a rebuild that loses them is caught."""

    def __init__(self, delay: float = 0.0, counter: Path | None = None, batch_size: int = 4) -> None:
        super().__init__()
        self.delay, self.counter, self.batch_size = delay, counter, batch_size

    def train_dataloader(self) -> DataLoader[Any]:
        data = SlowDataset(delay=self.delay, counter=self.counter)
        return DataLoader(data, batch_size=self.batch_size, shuffle=True, drop_last=True, collate_fn=collate)

    def val_dataloader(self) -> DataLoader[Any]:
        return DataLoader(SlowDataset(n=16, seed=1), batch_size=self.batch_size, collate_fn=collate)


class Model(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(16, 4)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self.net(x), y))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize(
    ("max_workers", "expected"), [(0, [0]), (1, [0, 1]), (2, [0, 1, 2]), (6, [0, 1, 2, 4, 6]), (8, [0, 1, 2, 4, 8])]
)
def test_default_candidates(max_workers: int, expected: list[int]) -> None:
    """Worker counts double from 1 up to the limit, which is always tried."""
    assert [c["num_workers"] for c in default_candidates(max_workers)] == expected


@pytest.mark.parametrize(
    ("rates", "tolerance", "expected"),
    [({0: 10.0, 2: 30.0, 4: 31.0}, 0.05, 2), ({0: 10.0, 2: 30.0, 4: 40.0}, 0.05, 4), ({0: 29.0, 2: 30.0}, 0.05, 0)],
)
def test_choose_fastest_prefers_fewer_workers_on_a_near_tie(
    rates: dict[int, float], tolerance: float, expected: int
) -> None:
    """The fastest wins unless fewer workers are within the tolerance of it."""
    results = [{"num_workers": w, "batches_per_s": r} for w, r in rates.items()]
    assert choose_fastest(results, tolerance)["num_workers"] == expected


def test_rebuild_keeps_everything_but_the_worker_settings() -> None:
    """Sampler, batch size, drop_last and collate_fn survive a rebuild; worker settings change."""
    loader = DataLoader(SlowDataset(), batch_size=5, shuffle=True, drop_last=True, collate_fn=collate)
    new = rebuild_dataloader(loader, {"num_workers": 2, "persistent_workers": True, "prefetch_factor": 4})
    assert (new.num_workers, new.persistent_workers, new.prefetch_factor) == (2, True, 4)
    assert new.sampler is loader.sampler
    assert isinstance(new.sampler, RandomSampler)
    assert (new.batch_size, new.drop_last, new.collate_fn) == (5, True, collate)
    assert len(new) == len(loader)


def test_rebuild_refuses_what_it_cannot_rebuild_safely() -> None:
    """A DataLoader subclass, or an IterableDataset with workers, is refused with the reason."""

    class MyLoader(DataLoader[Any]):
        pass

    class Stream(IterableDataset[int]):
        def __iter__(self) -> Any:
            return iter(range(8))

    with pytest.raises(NotRebuildableError, match="subclass"):
        rebuild_dataloader(MyLoader(SlowDataset()), {"num_workers": 2})
    with pytest.raises(NotRebuildableError, match="IterableDataset"):
        rebuild_dataloader(DataLoader(Stream()), {"num_workers": 2})


def test_probe_leaves_the_random_state_alone() -> None:
    """A probe consumes no random numbers: the next draw is the one it would have been."""
    loader = DataLoader(SlowDataset(), batch_size=4, shuffle=True)
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    result = probe_loader(loader, batches=3)
    assert torch.equal(torch.rand(3), expected)
    assert result["batches"] == 3
    assert result["batches_per_s"] > 0


def test_tuner_picks_workers_for_a_slow_dataset_and_keeps_the_loader(tmp_path: Path) -> None:
    """With a slow per-item decode the tuner chooses worker processes, and the loader keeps its other settings."""
    tuner = DataLoaderTuner(probe_batches=6, max_workers=2)
    trainer = tiny_trainer(tmp_path, callbacks=[tuner], limit_train_batches=4, limit_val_batches=2)
    trainer.fit(Model(), SlowData(delay=0.01))
    report = tuner.report()
    assert report["chosen"]["num_workers"] >= 1
    assert {c["num_workers"] for c in report["candidates"]} >= {0, 1, 2}
    assert all(c["batches_per_s"] > 0 for c in report["candidates"])
    assert report["speedup"] > 1.0
    loader = trainer.train_dataloader
    assert loader.num_workers == report["chosen"]["num_workers"]
    assert (loader.batch_size, loader.drop_last, loader.collate_fn) == (4, True, collate)
    assert isinstance(loader.sampler, RandomSampler)
    val = trainer.val_dataloaders
    assert val.num_workers == report["chosen"]["num_workers"]
    assert isinstance(val.sampler, SequentialSampler)


def test_probing_does_not_change_training(tmp_path: Path) -> None:
    """A run with the tuner trains on the same batches in the same order as one without it."""
    weights = []
    for callbacks in ([], [DataLoaderTuner(candidates=[{"num_workers": 0}], probe_batches=4)]):
        L.seed_everything(0, verbose=False)
        model = Model()
        tiny_trainer(tmp_path, callbacks=callbacks, max_epochs=2).fit(model, SlowData())
        weights.append(model.net.weight.detach().clone())
    assert torch.equal(weights[0], weights[1])


def test_resume_does_not_probe_again(tmp_path: Path) -> None:
    """A run resumed from a checkpoint reuses the saved choice and reads only its training samples."""
    counter = tmp_path / "reads.txt"
    tuner = DataLoaderTuner(candidates=[{"num_workers": 0}], probe_batches=4)
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    trainer = tiny_trainer(tmp_path, callbacks=[tuner, checkpoint], enable_checkpointing=True)
    trainer.fit(Model(), SlowData(counter=counter))
    first = tuner.report()
    counter.write_text("")
    resumed = DataLoaderTuner(candidates=[{"num_workers": 0}], probe_batches=4)
    trainer = tiny_trainer(tmp_path, callbacks=[resumed], max_epochs=2)
    trainer.fit(Model(), SlowData(counter=counter), ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))
    assert resumed.report() == first
    assert len(counter.read_text()) == 64  # one epoch of the 64 training samples, no probe


def test_loaders_passed_to_fit_are_left_alone(tmp_path: Path) -> None:
    """Dataloaders handed straight to ``fit()`` are not rebuilt, and the tuner says why."""
    tuner = DataLoaderTuner(probe_batches=2)
    loader = DataLoader(SlowDataset(), batch_size=8)
    with pytest.warns(UserWarning, match="passed straight to fit"):
        tiny_trainer(tmp_path, callbacks=[tuner], limit_val_batches=0).fit(Model(), train_dataloaders=loader)
    assert "chosen" not in tuner.report()
    assert tuner.report()["left_alone"]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"probe_batches": 0}, "`probe_batches`"),
        ({"max_workers": -1}, "`max_workers`"),
        ({"warmup_batches": -2}, "`warmup_batches`"),
        ({"tolerance": 1.0}, "`tolerance`"),
        ({"candidates": [{"workers": 2}]}, "`candidates`"),
        ({"candidates": [{"num_workers": -1}]}, "`candidates`"),
    ],
)
def test_bad_arguments_are_refused(kwargs: dict[str, Any], match: str) -> None:
    """Each bad argument is refused with its name."""
    with pytest.raises(ValueError, match=match):
        DataLoaderTuner(**kwargs)


class _RecordLoaders(L.Callback):
    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        loader = trainer.train_dataloader
        record = {"num_workers": loader.num_workers, "sampler": type(loader.sampler).__name__}
        (self.path / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


@pytest.mark.ddp
@pytest.mark.slow
def test_ddp_ranks_agree(tmp_path: Path) -> None:
    """Under 2-process DDP both ranks use the choice made on rank zero, with Lightning's distributed sampler."""
    tuner = DataLoaderTuner(probe_batches=4, max_workers=1)
    trainer = tiny_trainer(
        tmp_path, strategy="ddp_spawn", devices=2, callbacks=[tuner, _RecordLoaders(tmp_path)], limit_val_batches=2
    )
    trainer.fit(Model(), SlowData(delay=0.005))
    records = rank_records(tmp_path)
    assert records[0] == records[1]
    assert records[0]["sampler"] == "DistributedSampler"


@pytest.mark.slow
def test_benchmark_runs_in_quick_mode(tmp_path: Path, demo_cache: Path) -> None:
    """``benchmarks/dataloader.py --quick`` measures the three settings and writes its JSON."""
    module = load_benchmark("dataloader")
    out = tmp_path / "dataloader.json"
    result = module.main(["--quick", "--out", str(out), "--cache-dir", str(demo_cache)])
    assert [row["setting"].split(" (")[0] for row in result["rows"]][1:] == [
        "DataLoaderTuner",
        "DataLoaderTuner + CachedDataset",
    ]
    assert all(row["load_s_per_epoch"] > 0 for row in result["rows"])
    assert json.loads(out.read_text())["rows"][0]["num_workers"] == 0
