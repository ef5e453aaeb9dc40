"""Tests of the DataLoaderTuner and its pure parts."""

from __future__ import annotations

import itertools
import json
import math
import random
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import pytest
import torch
from conftest import IN_EPOCH_LOOP, RankWriter, callback_of, load_benchmark, rank_records, tiny_trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset, RandomSampler, SequentialSampler

from lightning_speedkit.dataloader import (
    DataLoaderTuner,
    LoaderSettings,
    NotRebuildableError,
    complete_settings,
    default_candidates,
    rebuild_dataloader,
    settings_name,
)
from lightning_speedkit.dataloader.counted import CountedBlock, LiveSettings, LoaderTrials
from lightning_speedkit.decisions import probe_pays_back
from lightning_speedkit.trials import PROBE_ROUNDS, Decision


class SlowDataset(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """16 features, 4 classes; each item sleeps ``delay`` seconds like a slow decode; counts its reads in a file."""

    def __init__(
        self, n: int = 64, delay: float = 0.0, seed: int = 0, counter: Path | None = None, augment: bool = True
    ) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 16, generator=g)
        self.y = self.x[:, :4].argmax(dim=1)
        self.delay, self.counter, self.augment = delay, counter, augment

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.delay:
            time.sleep(self.delay)
        if self.counter is not None:
            with open(self.counter, "a") as handle:
                handle.write("x")
        if not self.augment:
            return self.x[i], self.y[i]
        return self.x[i] + 0.01 * torch.randn(16), self.y[i]  # augmentation draws from the RNG


def collate(batch: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    xs, ys = zip(*batch, strict=True)
    return torch.stack(xs), torch.stack(ys)


class SlowData(L.LightningDataModule):
    """A DataModule with a custom collate_fn and drop_last, so a rebuild that loses them is caught."""

    def __init__(
        self, delay: float = 0.0, counter: Path | None = None, batch_size: int = 4, n: int = 64, augment: bool = True
    ) -> None:
        super().__init__()
        self.delay, self.counter, self.batch_size, self.n, self.augment = delay, counter, batch_size, n, augment

    def train_dataloader(self) -> DataLoader[Any]:
        data = SlowDataset(n=self.n, delay=self.delay, counter=self.counter, augment=self.augment)
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


def epochs_to_probe(settings: int, probe_steps: int, batches_per_epoch: int) -> int:
    """The fewest epochs after which a probe of ``settings`` settings pays back (the rule decides, not this file)."""
    probe = probe_steps * PROBE_ROUNDS * settings
    steps = next(n for n in itertools.count(1) if probe_pays_back(probe, n, DataLoaderTuner.MAX_GAIN)[0])
    return math.ceil(steps / batches_per_epoch)


@pytest.mark.parametrize(
    ("max_workers", "expected"), [(0, [0]), (1, [0, 1]), (2, [0, 1, 2]), (6, [0, 1, 2, 4, 6]), (8, [0, 1, 2, 4, 8])]
)
def test_default_candidates(max_workers: int, expected: list[int]) -> None:
    """Worker counts double from 1 up to the limit, which is always tried."""
    assert [c["num_workers"] for c in default_candidates(max_workers)] == expected


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"num_workers": 0}, (0, False, None, False)),
        ({"num_workers": 0, "persistent_workers": True, "prefetch_factor": 4}, (0, False, None, False)),
        ({"num_workers": 2}, (2, True, 2, False)),
        (
            {"num_workers": 1, "persistent_workers": False, "prefetch_factor": 4, "pin_memory": True},
            (1, False, 4, True),
        ),
    ],
)
def test_complete_settings(kwargs: dict[str, Any], expected: tuple[Any, ...]) -> None:
    """Missing settings become persistent workers with prefetch_factor 2; without workers those two are off."""
    settings = complete_settings(**kwargs)
    assert (
        tuple(settings[k] for k in ("num_workers", "persistent_workers", "prefetch_factor", "pin_memory")) == expected
    )


def test_rebuild_keeps_everything_but_the_worker_settings() -> None:
    """Sampler, batch size, drop_last and collate_fn survive a rebuild; worker settings change."""
    loader = DataLoader(SlowDataset(), batch_size=5, shuffle=True, drop_last=True, collate_fn=collate)
    new = rebuild_dataloader(loader, {"num_workers": 2, "persistent_workers": True, "prefetch_factor": 4})
    assert (new.num_workers, new.persistent_workers, new.prefetch_factor) == (2, True, 4)
    assert new.sampler is loader.sampler
    assert isinstance(new.sampler, RandomSampler)
    assert (new.batch_size, new.drop_last, new.collate_fn) == (5, True, collate)
    assert len(new) == len(loader)


class _Batches(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Each item is already a batch of 4 (a loader over it takes ``batch_size=None``)."""

    def __len__(self) -> int:
        return 6

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.full((4, 3), float(index)), torch.full((4,), index)


@pytest.mark.parametrize("workers", [0, 2])
def test_rebuild_keeps_a_loader_without_automatic_batching(workers: int) -> None:
    """``batch_size=None`` (each item a batch) stays so: the same batches, in the shuffled order, not batches of 1.

    The rebuilt loader batched by 1 with a sequential sampler: each batch came wrapped in a list, in order, and the
    user's ``training_step`` failed at the loader tuner's first trial under ``preset()``.
    """
    loader = DataLoader(_Batches(), batch_size=None, shuffle=True, generator=torch.Generator().manual_seed(0))
    new = rebuild_dataloader(loader, complete_settings(num_workers=workers))
    assert (new.batch_size, new.batch_sampler, new.sampler) == (None, None, loader.sampler)
    loader.generator.manual_seed(1)  # type: ignore[union-attr]
    theirs = [x[:, 0].tolist() for x, _ in loader]
    loader.generator.manual_seed(1)  # type: ignore[union-attr]
    assert [x[:, 0].tolist() for x, _ in new] == theirs


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


def test_loader_settings_patch_the_hook_and_revert_removes_the_patch() -> None:
    """While applied, the owner's train_dataloader returns the loader rebuilt; after revert, the user's own again."""
    data = SlowData()
    setting = LoaderSettings(data, complete_settings(1))
    assert setting.name == "num_workers=1, persistent_workers=True, prefetch_factor=2, pin_memory=False"
    setting.apply(None)  # type: ignore[arg-type]
    patched = data.train_dataloader()
    assert (patched.num_workers, patched.collate_fn, patched.drop_last) == (1, collate, True)
    assert data.val_dataloader().num_workers == 0  # trials patch the train loader only
    setting.revert(None)  # type: ignore[arg-type]
    assert "train_dataloader" not in vars(data)
    assert data.train_dataloader().num_workers == 0


@pytest.mark.usefixtures("one_thread")
def test_a_loader_whose_steps_hardly_wait_is_kept_after_its_own_block(tmp_path: Path) -> None:
    """With samples in memory a step hardly waits for its batch, the most any loader setting can save.

    The probe stops after the loader's own block (that wait cannot repay the candidates' blocks and worker
    start-ups), no candidate is timed, the loader is kept as built, and the probe costs nothing.
    """
    L.seed_everything(0, verbose=False)
    tuner = DataLoaderTuner(max_workers=2, probe_steps=8)
    epochs = epochs_to_probe(settings=3, probe_steps=8, batches_per_epoch=128)
    trainer = tiny_trainer(tmp_path, callbacks=[tuner], max_epochs=epochs, limit_val_batches=0)
    trainer.fit(Model(), SlowData(n=512))
    report = tuner.report()
    assert report["probed"]
    assert "for data, the most another loader setting can save, and the probe (" in report["reason"]
    assert [b["setting"] for b in report["blocks"]] == [report["decision"]]
    assert [c["step_s"] for c in report["candidates"]] == [None, None]
    assert report["baseline_step_s"] > 0
    assert report["rebuilt"] is False
    assert report["speedup"] == 1.0
    assert report["probe_s"] == 0.0
    assert trainer.train_dataloader.num_workers == 0


@pytest.mark.parametrize(("probe_steps", "batches", "block"), [(6, 30, 5), (3, 20, 3)])
def test_counted_blocks_shorten_to_what_the_first_epoch_holds(
    tmp_path: Path, probe_steps: int, batches: int, block: int
) -> None:
    """Blocks of ``probe_steps``, or the longest that three rounds of both settings fit in the first epoch.

    30 batches hold three rounds of two 5-step blocks, not of 6-step ones: the blocks are 5 steps, counted. Blocks
    shorter than 4 steps are counted too when ``probe_steps`` asks for them.
    """
    tuner = DataLoaderTuner(max_workers=1, probe_steps=probe_steps, remember=False)
    trainer = tiny_trainer(tmp_path, callbacks=[tuner], max_epochs=6, limit_val_batches=0)
    trainer.fit(Model(), SlowData(n=4 * batches))
    report = tuner.report()
    assert report["counted"]
    assert report["reason"].endswith("counted trials")
    assert {len(b["step_s"]) for b in report["blocks"]} == {block}


@pytest.mark.parametrize("limit", [30, 0.5])
def test_counted_blocks_fit_the_batches_limit_train_batches_leaves(tmp_path: Path, limit: float) -> None:
    """A loader of 60 batches limited to 30 an epoch: blocks of 5 steps, as for 30 batches, all in the first epoch.

    Sized from the loader's 60, 6-step blocks ran past the first epoch's end: the next epoch's loader could not be
    served, and the report said "skipped" after worker blocks had trained the run.
    """
    tuner = DataLoaderTuner(max_workers=1, probe_steps=6, remember=False)
    trainer = tiny_trainer(tmp_path, callbacks=[tuner], max_epochs=12, limit_val_batches=0, limit_train_batches=limit)
    trainer.fit(Model(), SlowData(n=4 * 60))
    report = tuner.report()
    assert report["counted"]
    assert report["reason"].endswith("counted trials")
    assert {len(b["step_s"]) for b in report["blocks"]} == {5}


@pytest.mark.usefixtures("one_thread")
def test_restored_trials_also_stop_after_the_loaders_own_trial_when_its_wait_cannot_repay(tmp_path: Path) -> None:
    """An epoch too short for counted trials probes on restored ones, and the same wait rule applies there.

    It ends the probe after the loader's own trial (one trial, its steps thrown away), the loader kept as built.
    """
    L.seed_everything(0, verbose=False)
    tuner = DataLoaderTuner(max_workers=2, probe_steps=6)
    epochs = epochs_to_probe(settings=3, probe_steps=6, batches_per_epoch=16)  # 16 batches: under the counted window
    trainer = tiny_trainer(tmp_path, callbacks=[tuner], max_epochs=epochs, limit_val_batches=0)
    trainer.fit(Model(), SlowData(n=64))
    report = tuner.report()
    assert report["probed"]
    assert "for data, the most another loader setting can save, and the probe (" in report["reason"]
    assert not report["reason"].endswith("counted trials")
    assert [t["setting"] for t in report["trials"]] == [report["decision"]]
    assert [c["step_s"] for c in report["candidates"]] == [None, None]
    assert report["rebuilt"] is False
    assert report["probe_s"] > 0  # the restored trial's steps are thrown away
    assert trainer.train_dataloader.num_workers == 0


@pytest.mark.usefixtures("one_thread")
def test_tuner_picks_workers_for_an_io_slow_dataset_and_keeps_the_loader(tmp_path: Path) -> None:
    """With a slow per-item read, workers win real steps: the loaders are rebuilt with them, all else kept."""
    tuner = DataLoaderTuner(max_workers=2)
    epochs = epochs_to_probe(settings=3, probe_steps=6, batches_per_epoch=160)
    trainer = tiny_trainer(tmp_path, callbacks=[tuner], max_epochs=epochs, limit_val_batches=2)
    trainer.fit(Model(), SlowData(delay=0.005, n=640))
    report = tuner.report()
    assert report["probed"]
    assert report["rebuilt"] is True
    assert report["chosen"]["num_workers"] >= 1
    assert report["decision"] in report["reason"]
    assert report["speedup"] > 1.05
    assert report["chosen_step_s"] < report["baseline_step_s"]
    loader = trainer.train_dataloader
    assert loader.num_workers == report["chosen"]["num_workers"]
    assert (loader.batch_size, loader.drop_last, loader.collate_fn) == (4, True, collate)
    assert isinstance(loader.sampler, RandomSampler)
    val = trainer.val_dataloaders
    assert val.num_workers == report["chosen"]["num_workers"]
    assert isinstance(val.sampler, SequentialSampler)


def test_a_worker_candidate_is_timed_no_faster_than_its_workers_can_deliver(tmp_path: Path) -> None:
    """Workers win a data-bound loader, and the speed-up reported is one they can sustain: ``n + 1`` at most.

    ``n`` workers at best divide the wait by ``n`` (`steady_bound`), whatever the step's own part. A worker block's
    timed steps were served from the batches its workers prefetched while starting, timing the step alone: 4 workers
    over 3 ms samples in batches of 8 reported 10.4x, against 3.8x over the rest of the run.
    """
    tuner = DataLoaderTuner(candidates=[{"num_workers": 4}], probe_steps=6)
    epochs = epochs_to_probe(settings=2, probe_steps=6, batches_per_epoch=25)
    trainer = tiny_trainer(tmp_path, callbacks=[tuner], max_epochs=epochs, limit_val_batches=0)
    trainer.fit(Model(), SlowData(delay=0.003, n=200, batch_size=8))
    report = tuner.report()
    assert report["chosen"]["num_workers"] == 4, report["reason"]
    assert 1.05 < report["speedup"] <= 5.0


_HIDDEN_READ = 0.002
"""Seconds of each item's read in the counted-probe tests: a wait for data that can repay a probe of one worker."""


class _RecordLabels(L.Callback):
    def __init__(self) -> None:
        self.labels: list[list[int]] = []

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, i: int) -> None:
        self.labels.append(batch[1].tolist())


def _without_and_with_a_worker_probe(
    tmp_path: Path, epochs: int, data: Callable[[], L.LightningDataModule], workers: int = 1, margin: float = 0.05
) -> tuple[list[list[list[int]]], list[dict[str, Any]]]:
    """The same seeded fit without the tuner, then with a counted probe of ``workers``: batch labels, and its report."""
    runs, reports = [], []
    tuner = DataLoaderTuner(candidates=[{"num_workers": workers}], probe_steps=6, margin=margin)
    for callbacks in ([], [tuner]):
        L.seed_everything(0, verbose=False)
        recorder = _RecordLabels()
        trainer = tiny_trainer(tmp_path, callbacks=[*callbacks, recorder], max_epochs=epochs, limit_val_batches=0)
        trainer.fit(Model(), data())
        runs.append(recorder.labels)
        reports.extend(c.report() for c in callbacks)
    return runs, reports


@pytest.mark.usefixtures("one_thread")
def test_counted_probe_trains_on_the_runs_own_batches_in_order(tmp_path: Path) -> None:
    """The probe's steps are the epoch's own: the first epoch's batches are the run's own, in order, none added.

    Later epochs are shuffled from the main process's RNG, which a dataset's augmentation advances only when it runs
    there (num_workers=0): as with any change of workers, their order is not the run without the tuner's.
    """
    epochs = epochs_to_probe(settings=2, probe_steps=6, batches_per_epoch=40) + 3
    runs, reports = _without_and_with_a_worker_probe(tmp_path, epochs, lambda: SlowData(n=160, delay=_HIDDEN_READ))
    assert reports[0]["probed"]
    assert any(b["setting"].startswith("num_workers=1") for b in reports[0]["blocks"])
    assert reports[0]["reason"].endswith("counted trials")
    assert len(runs[1]) == epochs * 40
    assert runs[0][:40] == runs[1][:40]
    epoch_labels = [sorted(y for batch in runs[1][e * 40 : (e + 1) * 40] for y in batch) for e in range(epochs)]
    assert all(labels == sorted(y for batch in runs[0][:40] for y in batch) for labels in epoch_labels)


@pytest.mark.usefixtures("one_thread")
def test_a_counted_probe_that_keeps_the_loader_leaves_every_epochs_order_as_without_it(tmp_path: Path) -> None:
    """A probe that keeps the loader as built changes no epoch's batches, the later ones included.

    Lightning builds the next epoch's loader again after a counted epoch, and the seed its iterator draws would move
    the main process's RNG, so every later shuffle would differ from the run without the tuner's. (A dataset that
    draws random numbers in the main process is another matter: a worker's blocks draw them from the worker's.)
    """
    epochs = epochs_to_probe(settings=2, probe_steps=6, batches_per_epoch=40) + 3
    data = lambda: SlowData(n=160, augment=False, delay=_HIDDEN_READ)  # noqa: E731
    runs, (report,) = _without_and_with_a_worker_probe(tmp_path, epochs, data, margin=0.99)
    assert report["reason"].endswith("counted trials")
    assert any(b["setting"].startswith("num_workers=1") for b in report["blocks"])
    assert report["rebuilt"] is False
    assert len(runs[1]) == epochs * 40
    assert runs[0] == runs[1]


class _OwnGenerator(SlowData):
    """Each ``train_dataloader()`` call shuffles with a new generator seeded 7 (Lightning calls it once a fit)."""

    def train_dataloader(self) -> DataLoader[Any]:
        data = SlowDataset(n=self.n, delay=self.delay, augment=False)
        generator = torch.Generator().manual_seed(7)
        return DataLoader(
            data, batch_size=self.batch_size, shuffle=True, drop_last=True, collate_fn=collate, generator=generator
        )


class _SharedGenerator(SlowData):
    """One generator, held by the DataModule, shuffles every loader its hook builds."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.generator = torch.Generator().manual_seed(7)

    def train_dataloader(self) -> DataLoader[Any]:
        data = SlowDataset(n=self.n, delay=self.delay, augment=False)
        options = {"shuffle": True, "drop_last": True, "collate_fn": collate, "generator": self.generator}
        return DataLoader(data, batch_size=self.batch_size, **options)


class _DrawsData(SlowData):
    """Each ``train_dataloader()`` call draws its data from the global RNG (random data, a ``random_split``)."""

    def train_dataloader(self) -> DataLoader[Any]:
        data = SlowDataset(n=self.n, delay=self.delay, seed=int(torch.randint(0, 1000, ())), augment=False)
        return DataLoader(data, batch_size=self.batch_size, shuffle=True, drop_last=True, collate_fn=collate)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize(
    "data", [_OwnGenerator, _SharedGenerator, _DrawsData], ids=["own_generator", "shared_generator", "draws_data"]
)
def test_a_kept_loader_trains_every_epoch_as_without_the_tuner_whatever_its_hook_draws(
    tmp_path: Path, data: type[SlowData]
) -> None:
    """A probe that keeps the loader leaves every epoch's batches as they are without it, whatever the hook does.

    The tuner called the user's ``train_dataloader()`` again after the counted epoch (a generator seeded in it then
    repeated epoch 0's order in epoch 1), read it once at fit start on the run's RNG (data drawn in it differed),
    and its reads of the loader drew from a generator the DataModule holds (epoch 0's shuffle differed).
    """
    epochs = epochs_to_probe(settings=2, probe_steps=6, batches_per_epoch=40) + 2
    runs, (report,) = _without_and_with_a_worker_probe(
        tmp_path, epochs, lambda: data(n=160, delay=_HIDDEN_READ), 1, 0.99
    )
    assert report["reason"].endswith("counted trials")
    assert report["rebuilt"] is False
    assert runs[0] == runs[1]
    assert runs[1][:40] != runs[1][40:80]  # epoch 1 is shuffled anew, not epoch 0 again


def test_a_loader_without_automatic_batching_is_probed_by_restored_trials(tmp_path: Path) -> None:
    """``batch_size=None`` (the dataset's items are the batches): no counted probe, and the fit runs.

    The counted probe serves a sampler's batches; served single indices, it crashed ("'int' object is not iterable").
    """

    class Items(SlowDataset):  # each item a batch of 4
        def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
            time.sleep(self.delay)
            return self.x[i].repeat(4, 1), self.y[i].repeat(4)

    class Unbatched(SlowData):
        def train_dataloader(self) -> DataLoader[Any]:
            return DataLoader(Items(n=self.n, delay=self.delay), batch_size=None, shuffle=True)

    tuner = DataLoaderTuner(candidates=[{"num_workers": 1}], probe_steps=6)
    trainer = tiny_trainer(tmp_path, callbacks=[tuner], max_epochs=4, limit_val_batches=0)
    trainer.fit(Model(), Unbatched(n=160, delay=_HIDDEN_READ))
    assert trainer.global_step == 4 * 160
    assert not tuner.report()["reason"].endswith("counted trials")


@pytest.mark.usefixtures("one_thread")
def test_counted_blocks_resume_a_candidates_persistent_workers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A candidate with persistent workers is built once for all its blocks: its workers start once, not per block.

    Its later blocks resume the same workers from the batch the run has reached, so the batches stay the run's own.
    """
    from lightning_speedkit.dataloader import counted

    built: list[int] = []

    def counting(base: Any, settings: dict[str, Any], **kwargs: Any) -> Any:
        built.append(settings["num_workers"])
        return rebuild(base, settings, **kwargs)

    rebuild = counted.rebuild_dataloader
    monkeypatch.setattr(counted, "rebuild_dataloader", counting)
    epochs = epochs_to_probe(settings=2, probe_steps=6, batches_per_epoch=40) + 3
    slow = lambda: SlowData(delay=_HIDDEN_READ, n=160)  # noqa: E731 - a read workers can hide: no block is dropped
    # two workers share a read that one worker would only move (one worker's steps can come out as slow as the read
    # itself and be dropped after the first round on a loaded machine: this test once failed so in CI)
    runs, reports = _without_and_with_a_worker_probe(tmp_path, epochs, slow, workers=2)
    blocks = [b["setting"] for b in reports[0]["blocks"]]
    assert sum(1 for b in blocks if b.startswith("num_workers=2")) >= 2, (blocks, reports[0])
    assert built.count(2) == 1, built
    assert runs[0][:40] == runs[1][:40]


def test_workers_measured_slower_names_the_fastest_losing_worker_setting() -> None:
    """A kept loader whose worker settings all timed slower is named for the monitor; a faster one, or none, is not.

    The decisions are loaded as a resume would load them.
    """
    tuner = DataLoaderTuner()
    assert tuner.workers_measured_slower() is None  # nothing decided yet
    base = {"num_workers": 0}
    tried = [{"num_workers": 1, "step_s": 0.0126}, {"num_workers": 2, "step_s": 0.0150}]
    kept = {"rebuilt": False, "baseline": base, "baseline_step_s": 0.010, "candidates": tried}
    tuner.load_state_dict({"decision": Decision("num_workers=0", "kept", probed=True, extra=kept).as_dict()})
    assert tuner.workers_measured_slower() == "num_workers=1 26% slower"
    tuner.load_state_dict({"decision": Decision("num_workers=1", "faster", extra={**kept, "rebuilt": True}).as_dict()})
    assert tuner.workers_measured_slower() is None
    faster = [{"num_workers": 1, "step_s": 0.008}, {"num_workers": 2, "step_s": None}]
    tuner.load_state_dict(
        {"decision": Decision("num_workers=0", "kept", extra={**kept, "candidates": faster}).as_dict()}
    )
    assert tuner.workers_measured_slower() is None


class _ScriptedClock:
    """A step clock replaying (step seconds, wait seconds) pairs, as `LoaderTrials` reads its clock."""

    def __init__(self, steps: list[tuple[float, float]]) -> None:
        self.steps, self.last_wait = iter(steps), 0.0

    def start(self) -> None:
        pass

    def reset(self) -> None:
        pass

    def stop(self) -> float:
        seconds, self.last_wait = next(self.steps)
        return seconds


class _OneProcess:
    """The one-process stand-in for a Trainer, as counted trials use it: its strategy's broadcast."""

    class strategy:  # mirrors ``trainer.strategy``
        @staticmethod
        def broadcast(obj: Any, src: int = 0) -> Any:
            return obj

    fit_loop = IN_EPOCH_LOOP


def _scripted_probe(
    monkeypatch: pytest.MonkeyPatch, ms: dict[int, tuple[float, float]], left: float
) -> tuple[LoaderTrials, Decision, list[str]]:
    """A counted probe of 0, 1 and 2 workers (blocks of 3 steps) with ``left`` steps left in the run.

    Each step of a setting with ``w`` workers takes ``ms[w]`` = (step ms, wait ms). Returns the probe, its decision
    and the settings' names.
    """
    from lightning_speedkit.dataloader import counted

    monkeypatch.setattr(counted, "steps_left", lambda trainer: left)
    live = LiveSettings(complete_settings(0))
    settings = [CountedBlock(live, complete_settings(w)) for w in (0, 1, 2)]
    trials = LoaderTrials(settings[0], settings[1:], steps=3, margin=0.05, warmup=0)
    clock = _ScriptedClock([])
    trials._clock = clock  # type: ignore[assignment]
    trainer: Any = _OneProcess()
    decision = None
    while decision is None:
        trials.step_started(trainer)
        step_ms, wait_ms = ms[live.settings["num_workers"]]
        clock.steps = iter([(step_ms / 1000, wait_ms / 1000)])
        decision = trials.step_ended(trainer)
    return trials, decision, [s.name for s in settings]


@pytest.mark.parametrize(
    ("one_worker_wait_ms", "two_workers_tried"),
    [(1.0, False), (25.0, True)],  # 35 ms steps that hardly waited: the worker took the core; that waited: try 2
)
def test_more_workers_are_not_tried_after_fewer_lost_without_waiting_for_data(
    monkeypatch: pytest.MonkeyPatch, one_worker_wait_ms: float, two_workers_tried: bool
) -> None:
    """Two workers get no block after one worker's steps lost while hardly waiting for their batch.

    One worker's steps take 35 ms against 22 ms in the training process: when they hardly waited, two workers (which
    can only shorten that wait) are not tried and the reason says why; when they waited, two workers are tried.
    """
    ms = {0: (22.0, 8.0), 1: (35.0, one_worker_wait_ms), 2: (21.0, 0.5)}
    trials, decision, names = _scripted_probe(monkeypatch, ms, left=math.inf)
    assert (names[2] in {name for name, _ in trials.blocks}) == two_workers_tried
    assert decision.decision == names[0]  # two workers' 21 ms is under the margin when they are tried
    if not two_workers_tried:
        assert f"{names[2]} not tried: {names[1]} lost without waiting for data" in decision.reason
        assert names[2] in decision.extra["dropped"]
        assert all(len(b["wait_s"]) == len(b["step_s"]) for b in decision.extra["blocks"])


def test_worker_candidates_the_wait_cannot_repay_are_left_out_and_the_batched_fetch_is_tried(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A 0.6 ms wait of 1.7 ms steps over 900 steps repays a batched fetch's blocks, not a worker's start-up.

    After the loader in place's block the worker candidate is dropped (the reason says why), the batched fetch is
    timed, and it wins.
    """
    from lightning_speedkit.dataloader import counted

    monkeypatch.setattr(counted, "steps_left", lambda trainer: 900)
    live = LiveSettings(complete_settings(0))
    wanted = (complete_settings(0), complete_settings(0, batched_fetch=True), complete_settings(1))
    settings = [CountedBlock(live, s) for s in wanted]
    names = [s.name for s in settings]
    ms = dict(zip(names, [(1.7, 0.6), (1.2, 0.05), (1.0, 0.05)], strict=True))
    trials = LoaderTrials(settings[0], settings[1:], steps=3, margin=0.05, warmup=0)
    trials._clock = clock = _ScriptedClock([])  # type: ignore[assignment]
    trainer: Any = _OneProcess()
    decision = None
    while decision is None:
        trials.step_started(trainer)
        clock.steps = iter([tuple(v / 1000 for v in ms[settings_name(live.settings)])])
        decision = trials.step_ended(trainer)
    assert names[2] not in {name for name, _ in trials.blocks}
    assert f"{names[2]} not tried: their workers' start-up cannot pay back in 900 steps left" in decision.reason
    assert decision.decision == names[1]


@pytest.mark.parametrize(("wait_ms", "left", "probed_on"), [(4.2, 600, False), (4.2, 50_000, True), (20.0, 600, True)])
def test_the_probe_goes_on_only_when_the_loaders_wait_for_data_can_repay_it(
    monkeypatch: pytest.MonkeyPatch, wait_ms: float, left: float, probed_on: bool
) -> None:
    """After the loader in place's block, the probe goes on only when its wait for data can repay the probe.

    The wait, saved on every step left, must repay the candidates' blocks and worker start-ups: a 4.2 ms wait of a
    26 ms step over 600 steps left does not; over 50,000 steps, or a 20 ms wait, it does.
    """
    ms = {0: (26.0, wait_ms), 1: (22.4, 0.5), 2: (22.0, 0.5)}  # no faster than the step's own part (`steady_bound`)
    trials, decision, names = _scripted_probe(monkeypatch, ms, left=left)
    assert (len(trials.blocks) > 1) == probed_on
    if probed_on:
        assert decision.decision == names[2]
    else:
        assert decision.decision == names[0]
        assert f"its steps wait {wait_ms:.1f} ms of 26.0 ms for data" in decision.reason
        assert "cannot pay back in 600 steps left" in decision.reason
        assert decision.probe_s == 0.0
        assert decision.step_s == {names[0]: pytest.approx(0.026)}


@pytest.mark.parametrize(("limit", "samples"), [(4, 256), (1.0, 64), (50, 16)])
def test_a_short_job_skips_the_probe_and_says_why(tmp_path: Path, limit: float, samples: int) -> None:
    """A fit too short for the probe runs no trial: the loader is kept, the reason is the epoch's batches or payback.

    Four batches an epoch (`limit_train_batches=4`) hold no 6-step block; 16 batches, one epoch, cannot repay it.
    A loader of 4 batches under a limit of 50 is short by itself: the reason does not blame the limit.
    """
    counter = tmp_path / "reads.txt"
    tuner = DataLoaderTuner(max_workers=2)
    trainer = tiny_trainer(tmp_path, callbacks=[tuner], limit_train_batches=limit, limit_val_batches=0)
    trainer.fit(Model(), SlowData(n=samples, delay=0.005, counter=counter))
    report = tuner.report()
    assert report["probed"] is False
    if limit == 1.0:
        assert report["reason"].startswith("skipped: the probe (")
        assert "cannot pay back in 16 steps left" in report["reason"]
    else:
        limited = " (limit_train_batches=4)" if limit == 4 else ""
        assert report["reason"] == f"skipped: the train loader has 4 batches per rank{limited}, fewer than probe_steps"
    assert report["decision"] == "num_workers=0, persistent_workers=False, prefetch_factor=None, pin_memory=False"
    assert report["rebuilt"] is False
    assert report["probe_s"] == 0.0
    assert trainer.train_dataloader.num_workers == 0
    assert len(counter.read_text()) == (64 if limit == 1.0 else 16) + 1  # the batches' samples; the fingerprint's


def test_probing_does_not_change_training(tmp_path: Path) -> None:
    """A run whose probe keeps the loader trains on the same batches from the same weights as a run without it."""
    weights, reports = [], []
    epochs = epochs_to_probe(settings=2, probe_steps=6, batches_per_epoch=16)
    for callbacks in ([], [DataLoaderTuner(candidates=[{"num_workers": 1}], margin=0.99)]):
        L.seed_everything(0, verbose=False)
        model = Model()
        tiny_trainer(tmp_path, callbacks=callbacks, max_epochs=epochs, limit_val_batches=0).fit(model, SlowData())
        weights.append(model.net.weight.detach().clone())
        reports.extend(c.report() for c in callbacks)
    assert reports[0]["probed"]
    assert reports[0]["rebuilt"] is False
    assert torch.equal(weights[0], weights[1])


@pytest.mark.usefixtures("one_thread")
def test_resume_does_not_probe_again(tmp_path: Path) -> None:
    """A resumed run applies the saved decision without probing: it reads only its training samples."""
    counter = tmp_path / "reads.txt"
    tuner = DataLoaderTuner(candidates=[{"num_workers": 2}])
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    epochs = epochs_to_probe(settings=2, probe_steps=6, batches_per_epoch=32)
    trainer = tiny_trainer(tmp_path, callbacks=[tuner, checkpoint], enable_checkpointing=True, max_epochs=epochs)
    trainer.fit(Model(), SlowData(delay=0.005, counter=counter, n=128))
    first = tuner.report()
    assert first["probed"]
    assert first["rebuilt"] is True
    counter.write_text("")
    resumed = DataLoaderTuner(candidates=[{"num_workers": 2}])
    trainer = tiny_trainer(tmp_path, callbacks=[resumed], max_epochs=epochs + 1)
    trainer.fit(Model(), SlowData(delay=0.005, counter=counter, n=128), ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))
    assert resumed.report() == {**first, "source": "resumed"}
    assert trainer.train_dataloader.num_workers == 2
    assert len(counter.read_text()) == 128  # one epoch of the 128 training samples, no probe


def test_loaders_passed_to_fit_are_left_alone(tmp_path: Path) -> None:
    """Dataloaders handed straight to ``fit()`` are not rebuilt, and the tuner says why."""
    tuner = DataLoaderTuner(probe_steps=2)
    loader = DataLoader(SlowDataset(), batch_size=8)
    with pytest.warns(UserWarning, match="passed straight to fit"):
        tiny_trainer(tmp_path, callbacks=[tuner], limit_val_batches=0).fit(Model(), train_dataloaders=loader)
    assert "chosen" not in tuner.report()
    assert tuner.report()["left_alone"]


def test_a_dataloader_subclass_is_left_alone(tmp_path: Path) -> None:
    """A DataLoader subclass is neither probed nor rebuilt, and the tuner says why."""

    class MyLoader(DataLoader[Any]):
        pass

    class Data(SlowData):
        def train_dataloader(self) -> DataLoader[Any]:
            return MyLoader(SlowDataset(), batch_size=4, collate_fn=collate)

    tuner = DataLoaderTuner(max_workers=1)
    trainer = tiny_trainer(tmp_path, callbacks=[tuner], max_epochs=8, limit_val_batches=0)
    with pytest.warns(UserWarning, match="subclass"):
        trainer.fit(Model(), Data())
    report = tuner.report()
    assert (report["decision"], report["probed"], report["source"]) == ("as is", False, "skipped")
    assert "subclass" in report["reason"]
    assert report["left_alone"] == [report["reason"]]
    assert type(trainer.train_dataloader) is MyLoader


@pytest.mark.parametrize(
    ("kwargs", "name", "value"),
    [
        ({"probe_steps": 0}, "probe_steps", "0"),
        ({"probe_steps": 2.5}, "probe_steps", "2.5"),
        ({"max_workers": -1}, "max_workers", "-1"),
        ({"margin": 1.0}, "margin", "1.0"),
        ({"margin": -0.1}, "margin", "-0.1"),
        ({"margin": "x"}, "margin", "'x'"),
        ({"candidates": []}, "candidates", "[]"),
        ({"candidates": [{"workers": 2}]}, "candidates", "{'workers': 2}"),
        ({"candidates": [{"num_workers": -1}]}, "candidates", "{'num_workers': -1}"),
        ({"candidates": [{"num_workers": "two"}]}, "candidates", "{'num_workers': 'two'}"),
        ({"candidates": [{"num_workers": 1, "prefetch_factor": 0}]}, "candidates", "'prefetch_factor': 0"),
    ],
)
def test_bad_arguments_are_refused(kwargs: dict[str, Any], name: str, value: str) -> None:
    """Each bad argument is refused with a ValueError naming it and the value given."""
    with pytest.raises(ValueError, match=rf"`{name}`.*{re.escape(value)}"):
        DataLoaderTuner(**kwargs)


def _loader_record(trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
    """Each rank's train loader and DataLoaderTuner decision at the end of training (written by `RankWriter`)."""
    loader = trainer.train_dataloader
    report = callback_of(trainer, DataLoaderTuner).report()
    return {
        "num_workers": loader.num_workers,
        "sampler": type(loader.sampler).__name__,
        "decision": report["decision"],
        "probed": report["probed"],
        "step_ms": report["step_ms"],
    }


@pytest.mark.ddp
@pytest.mark.slow
def test_ddp_ranks_agree(tmp_path: Path) -> None:
    """Under 2-process DDP both ranks probe together and use the same decision, with Lightning's distributed sampler."""
    tuner = DataLoaderTuner(probe_steps=4, max_workers=1)  # spawned workers re-import everything: keep them few
    trainer = tiny_trainer(
        tmp_path,
        strategy="ddp_spawn",
        devices=2,
        max_epochs=epochs_to_probe(settings=2, probe_steps=4, batches_per_epoch=40),  # 160 samples a rank
        callbacks=[tuner, RankWriter(tmp_path, _loader_record)],
        limit_val_batches=2,
    )
    trainer.fit(Model(), SlowData(delay=0.005, n=320))
    records = rank_records(tmp_path)
    assert records[0] == records[1]
    assert records[0]["probed"]
    assert records[0]["sampler"] == "DistributedSampler"


def _weights_record(trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
    """Each rank's train loader (its dataset and sampler types) and its weights, exactly (written by `RankWriter`)."""
    loader = trainer.train_dataloader
    weights = [float(v) for p in pl_module.parameters() for v in p.detach().flatten()]
    return {"dataset": type(loader.dataset).__name__, "sampler": type(loader.sampler).__name__, "weights": weights}


@pytest.mark.ddp
@pytest.mark.slow
def test_under_ddp_a_batched_fetch_trains_each_rank_on_its_own_shard_as_without_it(tmp_path: Path) -> None:
    """Under 2-process DDP a loader rebuilt to fetch its batches at once keeps Lightning's distributed sampler.

    Both ranks decide alike, and the weights are, bit for bit, those of the same DDP fit without the tuner.
    """
    epochs = epochs_to_probe(settings=2, probe_steps=4, batches_per_epoch=40)  # 320 rows a rank, batches of 8

    def fit(callbacks: list[L.Callback], prefix: str) -> list[dict[str, Any]]:
        L.seed_everything(0, verbose=False)
        writer = RankWriter(tmp_path, _weights_record, prefix=prefix)
        trainer = tiny_trainer(
            tmp_path, strategy="ddp_spawn", devices=2, max_epochs=epochs, callbacks=[*callbacks, writer]
        )
        trainer.fit(Model(), _Tensors(n=640))
        return rank_records(tmp_path, prefix=prefix)

    tuned = fit([DataLoaderTuner(probe_steps=4, remember=False)], "tuned")
    plain = fit([], "plain")
    assert tuned[0]["dataset"] == tuned[1]["dataset"] in ("BatchedTensors", "TensorDataset")
    assert tuned[0]["sampler"] == tuned[1]["sampler"] == "DistributedSampler"
    assert tuned[0]["weights"] == tuned[1]["weights"] == plain[0]["weights"]


@pytest.mark.slow
def test_benchmark_runs_in_quick_mode(tmp_path: Path, demo_cache: Path) -> None:
    """``benchmarks/dataloader.py --quick`` measures every setting, with a fit time for each, and writes its JSON."""
    module = load_benchmark("dataloader")
    out = tmp_path / "dataloader.json"
    result = module.main(["--quick", "--out", str(out), "--cache-dir", str(demo_cache)])
    assert [row["setting"].split(" (")[0] for row in result["rows"]] == [
        "naive",
        "DataLoaderTuner",
        "DataLoaderTuner + CachedDataset",
        "I/O-slow naive",
        "I/O-slow DataLoaderTuner",
        "tensors naive",
        "tensors DataLoaderTuner",
    ]
    assert all(row["load_s_per_epoch"] > 0 and row["fit_s"] > 0 for row in result["rows"])
    assert result["rows"][0]["fit_ratio"] == 1.0
    assert result["rows"][3]["fit_ratio"] == 1.0
    assert result["rows"][5]["fit_ratio"] == 1.0
    saved = json.loads(out.read_text())
    assert saved["rows"][0]["num_workers"] == 0
    assert saved["rows"][4]["tuner"]["decision"]


class WorkerData(SlowData):
    """`SlowData` whose loaders already have worker processes (the setting the user built)."""

    def __init__(self, num_workers: int, persistent_workers: bool) -> None:
        super().__init__()
        self.num_workers, self.persistent_workers = num_workers, persistent_workers

    def train_dataloader(self) -> DataLoader[Any]:
        loader = super().train_dataloader()
        return DataLoader(
            loader.dataset,
            batch_size=self.batch_size,
            shuffle=True,
            drop_last=True,
            collate_fn=collate,
            num_workers=self.num_workers,
            persistent_workers=self.persistent_workers,
        )


@pytest.mark.parametrize(
    ("num_workers", "persistent_workers", "candidate"),
    [(1, False, {"num_workers": 0}), (2, True, {"num_workers": 1})],
)
def test_probing_a_loader_with_workers_does_not_change_training(
    tmp_path: Path, num_workers: int, persistent_workers: bool, candidate: dict[str, Any]
) -> None:
    """A probe that keeps a loader with workers leaves training as a run without the tuner: same batches, same weights.

    The samples' augmentation draws from the workers' RNGs, seeded from the main process when the workers start, so a
    probe that consumed them, or the main RNG, would change the batches the fit trains on.
    """
    weights, reports, loaders = [], [], []
    epochs = epochs_to_probe(settings=2, probe_steps=6, batches_per_epoch=16)
    for callbacks in ([], [DataLoaderTuner(candidates=[candidate], margin=0.99)]):
        L.seed_everything(0, verbose=False)
        model = Model()
        trainer = tiny_trainer(tmp_path, callbacks=callbacks, max_epochs=epochs, limit_val_batches=0)
        trainer.fit(model, WorkerData(num_workers, persistent_workers))
        weights.append(model.net.weight.detach().clone())
        reports.extend(c.report() for c in callbacks)
        loaders.append((trainer.train_dataloader.num_workers, trainer.train_dataloader.persistent_workers))
    assert reports[0]["probed"]
    assert [c["num_workers"] for c in reports[0]["candidates"]] == [candidate["num_workers"]]
    assert reports[0]["rebuilt"] is False
    assert loaders == [(num_workers, persistent_workers)] * 2
    assert torch.equal(weights[0], weights[1])


class _Tensors(L.LightningDataModule):
    """In-memory tensors, shuffled, collated by default_collate: the loader a batched fetch serves the same batches."""

    def __init__(self, n: int = 1024, batch_size: int = 8) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        x = torch.randn(n, 16, generator=g)
        self.data, self.batch_size = torch.utils.data.TensorDataset(x, x[:, :4].argmax(dim=1)), batch_size

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.data, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.data, batch_size=64)


@pytest.mark.usefixtures("one_thread")
def test_tensor_data_is_tried_fetched_at_once_and_the_fit_is_the_fit_without_the_tuner(tmp_path: Path) -> None:
    """A TensorDataset's loader gets one candidate, each batch fetched at once, timed on real steps (no workers).

    Whichever setting wins, the run trains on the same batches: its weights equal, bit for bit, those of the same fit
    without the tuner.
    """
    epochs = epochs_to_probe(settings=2, probe_steps=4, batches_per_epoch=128)

    def fit(callbacks: list[L.Callback]) -> Model:
        L.seed_everything(0, verbose=False)
        model = Model()
        trainer = tiny_trainer(tmp_path, callbacks=callbacks, max_epochs=epochs, limit_val_batches=2)
        trainer.fit(model, _Tensors())
        return model

    tuner = DataLoaderTuner(max_workers=2, probe_steps=4, remember=False)  # no worker is tried for such data
    tuned, plain = fit([tuner]), fit([])
    report = tuner.report()
    assert [c["name"] for c in report["candidates"]] == [
        "num_workers=0, persistent_workers=False, prefetch_factor=None, pin_memory=False, batched_fetch=True"
    ]
    assert report["probed"]
    if report["rebuilt"]:
        assert report["chosen"]["batched_fetch"] is True
    for a, b in zip(tuned.parameters(), plain.parameters(), strict=True):
        assert torch.equal(a, b)


class _TensorSubset(_Tensors):
    """Each ``train_dataloader()`` call trains on a random half of the rows (Lightning calls the hook once a fit).

    The rows are drawn from the global RNG, or from a torch, numpy or Python generator the DataModule holds.
    """

    def __init__(self, held: str) -> None:
        super().__init__()
        self.held = held
        self.generator: Any = {
            "torch": torch.Generator().manual_seed(3),
            "numpy": np.random.default_rng(3),
            "random": random.Random(3),
        }.get(held)

    def train_dataloader(self) -> DataLoader[Any]:
        n = len(self.data)
        if self.held in ("global", "torch"):
            rows = torch.randperm(n, generator=self.generator)[: n // 2].tolist()
        else:
            rows = (
                self.generator.permutation(n)[: n // 2].tolist()
                if self.held == "numpy"
                else self.generator.sample(range(n), n // 2)
            )
        return DataLoader(torch.utils.data.Subset(self.data, rows), batch_size=self.batch_size, shuffle=True)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("held", ["global", "torch", "numpy", "random"])
def test_a_hook_that_draws_its_rows_gets_them_once_whether_the_loader_is_rebuilt_or_kept(
    tmp_path: Path, held: str
) -> None:
    """The tuner calls the user's hook at fit start and rebuilds the loader Lightning built, never calling it again.

    After a counted epoch the rebuilt loader came from calling ``train_dataloader()`` again: a hook that draws its
    rows trained every later epoch on other rows than the run without the tuner. The fit-start read drew from a
    generator the DataModule holds, so even a kept loader trained on other rows. The batched fetch serves the same
    batches, so the whole fit must equal the fit without the tuner, bit for bit, whichever setting wins.
    """
    epochs = epochs_to_probe(settings=2, probe_steps=4, batches_per_epoch=64) + 2

    def fit(callbacks: list[L.Callback]) -> list[torch.Tensor]:
        L.seed_everything(0, verbose=False)
        model = Model()
        trainer = tiny_trainer(tmp_path, callbacks=callbacks, max_epochs=epochs, limit_val_batches=2)
        trainer.fit(model, _TensorSubset(held))
        return [p.detach().clone() for p in model.parameters()]

    tuner = DataLoaderTuner(max_workers=0, probe_steps=4, margin=0.0, remember=False)
    tuned, plain = fit([tuner]), fit([])
    assert tuner.report()["reason"].endswith("counted trials")
    for a, b in zip(tuned, plain, strict=True):
        assert torch.equal(a, b)


def test_a_batched_fetch_asked_for_a_dataset_of_other_samples_is_left_out(tmp_path: Path) -> None:
    """A candidate with ``batched_fetch`` for a dataset that computes its samples: a warning, the others tried."""
    tuner = DataLoaderTuner(candidates=[{"num_workers": 0, "batched_fetch": True}, {"num_workers": 1}], probe_steps=4)
    epochs = epochs_to_probe(settings=2, probe_steps=4, batches_per_epoch=16)
    trainer = tiny_trainer(tmp_path, callbacks=[tuner], max_epochs=epochs, limit_val_batches=0)
    with pytest.warns(UserWarning, match=r"`batched_fetch` left out: the train loader's dataset is not a Tensor"):
        trainer.fit(Model(), SlowData(n=64))
    assert all("batched_fetch" not in c["name"] for c in tuner.report()["candidates"])


def test_a_candidate_with_a_bad_batched_fetch_is_refused() -> None:
    """``batched_fetch`` takes a bool; the error lists every key a candidate takes."""
    with pytest.raises(ValueError, match=r"keys num_workers, .*, pin_memory, batched_fetch .* got \{"):
        DataLoaderTuner(candidates=[{"num_workers": 0, "batched_fetch": "yes"}])


class _NoiseDataset(SlowDataset):
    """`SlowDataset` whose samples also carry the noise their augmentation drew (a worker's torch RNG stream)."""

    def __getitem__(self, i: int) -> Any:  # type: ignore[override]
        time.sleep(self.delay)
        noise = torch.randn(())
        return self.x[i] + noise, self.y[i], noise


class _NoiseData(SlowData):
    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(_NoiseDataset(n=self.n, delay=self.delay), batch_size=self.batch_size, shuffle=True)


class _NoiseModel(Model):
    def __init__(self) -> None:
        super().__init__()
        self.noise: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.noise.extend(batch[2].tolist())
        return super().training_step(batch[:2], batch_idx)


def test_worker_blocks_of_the_probe_draw_random_streams_of_their_own(tmp_path: Path) -> None:
    """Every sample of the run draws augmentation noise of its own, workers or not.

    Every probe block's loader drew its workers' seed from the run's RNG, put back afterwards: each worker block and
    the next epoch's workers got the same seed, so their augmentations repeated one stream an epoch later.
    """
    tuner = DataLoaderTuner(max_workers=2)
    epochs = epochs_to_probe(settings=3, probe_steps=6, batches_per_epoch=160) + 1
    trainer = tiny_trainer(tmp_path, callbacks=[tuner], max_epochs=epochs, limit_val_batches=0)
    model = _NoiseModel()
    L.seed_everything(0, verbose=False)
    trainer.fit(model, _NoiseData(delay=0.005, n=640))
    assert tuner.report()["chosen"]["num_workers"] >= 1, tuner.report()  # workers win a data-bound loader
    assert len(model.noise) == 640 * epochs
    assert len(set(model.noise)) == len(model.noise)
