"""Replayed trials: the batches fetched once, every trial trains on copies of them, the run left as without trials."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from conftest import TinyClassifier, tiny_trainer
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset
from typing_extensions import override

from lightning_speedkit.trials import AsIs, TrialSession
from lightning_speedkit.trials import replay as replay_module


class _Counted(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """A dataset that counts the samples fetched from it."""

    def __init__(self, data: TensorDataset) -> None:
        self.data, self.fetched = data, 0

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.fetched += 1
        return self.data[index]  # type: ignore[no-any-return]


class _Model(TinyClassifier):
    """Dropout (the RNG matters), a shuffled loader over a counting dataset; ``in_place`` scales each batch in place."""

    def __init__(self, in_place: bool = False, workers: int = 0) -> None:
        super().__init__(lr=0.05, batch_size=8, num_samples=64, optimizer="adam")
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 4))
        self.in_place, self.workers = in_place, workers
        self.dataset = _Counted(self._data(0))

    @override
    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        if self.in_place:
            batch[0].mul_(3.0)  # a user's in-place normalisation: must not reach the next trial's copy
        return super().training_step(batch, batch_idx)

    @override
    def train_dataloader(self) -> DataLoader[tuple[torch.Tensor, ...]]:
        return DataLoader(self.dataset, batch_size=self.batch_size, shuffle=True, num_workers=self.workers)


class _Seen(L.Callback):
    def __init__(self) -> None:
        self.batches: list[list[torch.Tensor]] = []

    @override
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int) -> None:
        self.batches.append([t.clone() for t in batch])


class _AsIsSeen(AsIs):
    """The run as it is, keeping the batches its steps see."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = _Seen()

    @override
    def callbacks(self) -> list[L.Callback]:
        return [self.seen]


class _Sessions(L.Callback):
    """At fit start (or at ``epoch``'s start), a session runs ``trials`` trials of the run as it is."""

    def __init__(self, replay: bool, trials: int = 3, steps: int = 4, epoch: int = 0, **run: Any) -> None:
        self.replay, self.trials, self.steps, self.epoch, self.run = replay, trials, steps, epoch, run
        self.losses: list[list[float | None]] = []
        self.batches: list[list[list[torch.Tensor]]] = []
        self.fetched = 0

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.current_epoch != self.epoch or self.losses:
            return
        model: Any = pl_module
        before = model.dataset.fetched
        with TrialSession(trainer, self.steps, warmup=0, replay=self.replay) as session:
            settings = [_AsIsSeen() for _ in range(self.trials)]
            self.losses = [session.run(setting, **self.run).losses for setting in settings]
        self.batches = [setting.seen.batches for setting in settings]
        self.fetched = model.dataset.fetched - before


def _fit(
    tmp_path: Path, sessions: _Sessions | None, in_place: bool = False, epochs: int = 1, workers: int = 0
) -> list[torch.Tensor]:
    L.seed_everything(0, verbose=False)
    model = _Model(in_place, workers)
    callbacks = [sessions] if sessions is not None else []
    tiny_trainer(tmp_path, max_epochs=epochs, limit_val_batches=0, callbacks=callbacks).fit(model)
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("epoch", [0, 1])
def test_replayed_trials_fetch_once_and_train_as_trials_that_fetch_their_own(tmp_path: Path, epoch: int) -> None:
    """With replay the loader is read once (4 steps of 8 samples), not once per trial, and trials train as before.

    At fit start and at a later epoch's start alike, every trial trains on the batches trials that fetch their own
    see, from the same RNG state (this dataset draws nothing per sample): the same losses, dropout included.
    """
    replayed, fetching = _Sessions(replay=True, epoch=epoch), _Sessions(replay=False, epoch=epoch)
    _fit(tmp_path, replayed, epochs=epoch + 1)
    _fit(tmp_path, fetching, epochs=epoch + 1)
    assert replayed.fetched == 4 * 8
    assert fetching.fetched == 3 * 4 * 8
    for batches in (*replayed.batches, *fetching.batches[1:]):
        pairs = [
            (a, b)
            for one, other in zip(batches, fetching.batches[0], strict=True)
            for a, b in zip(one, other, strict=True)
        ]
        assert len(pairs) == 4 * 2
        assert all(torch.equal(a, b) for a, b in pairs)
    assert replayed.losses[0] == replayed.losses[1] == replayed.losses[2] == fetching.losses[0]


def test_a_step_that_changes_its_batch_in_place_does_not_change_the_next_trials(tmp_path: Path) -> None:
    """Each trial gets copies of the kept batches: a training step scaling its batch in place leaves them alone."""
    sessions = _Sessions(replay=True)
    _fit(tmp_path, sessions, in_place=True)
    assert sessions.losses[0] == sessions.losses[1] == sessions.losses[2]


def test_the_run_after_replayed_trials_is_the_run_without_them(tmp_path: Path) -> None:
    """After replayed trials, at fit start or at a later epoch's start, the final weights equal a fit's without them.

    The fetch drew from the RNG (the sampler's seed), which is put back before the trials and the run.
    """
    plain = _fit(tmp_path, None, epochs=3)
    for epoch in (0, 1):
        sessions = _Sessions(replay=True, epoch=epoch)
        weights = _fit(tmp_path, sessions, epochs=3)
        assert sessions.fetched == 4 * 8
        assert all(torch.equal(a, b) for a, b in zip(plain, weights, strict=True))


def test_batches_over_the_memory_limit_are_fetched_by_each_trial(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Batches that would take more than `REPLAY_BYTES` are not kept: each trial fetches them, with the same losses."""
    monkeypatch.setattr(replay_module, "REPLAY_BYTES", 100)
    sessions = _Sessions(replay=True)
    _fit(tmp_path, sessions)
    assert sessions.fetched == 8 + 3 * 4 * 8  # the first batch, judged too large, then every trial's own
    assert sessions.losses[0] == sessions.losses[1] == sessions.losses[2]


def test_trials_longer_than_an_epoch_fetch_as_usual(tmp_path: Path) -> None:
    """A trial spanning epochs (more steps than batches per epoch) sees each epoch's own shuffle: no replay."""
    sessions = _Sessions(replay=True, steps=10, max_batches=8)
    _fit(tmp_path, sessions)
    assert sessions.fetched == 3 * 10 * 8
    assert sessions.losses[0] == sessions.losses[1] == sessions.losses[2]


def test_a_loader_with_a_worker_is_replayed_with_the_same_losses(tmp_path: Path) -> None:
    """A worker process's loader: its batches fetched once (the worker stopped), the losses of fetching trials."""
    replayed, fetching = _Sessions(replay=True, trials=2), _Sessions(replay=False, trials=2)
    weights = _fit(tmp_path, replayed, workers=1)
    _fit(tmp_path, fetching, workers=1)
    assert replayed.losses[0] == replayed.losses[1] == fetching.losses[0]
    assert all(torch.equal(a, b) for a, b in zip(weights, _fit(tmp_path, None, workers=1), strict=True))


class _IterStep(TinyClassifier):
    """``training_step(dataloader_iter)``: the step fetches its own batch from the loader's iterator."""

    @override
    def training_step(self, dataloader_iter: Any) -> torch.Tensor:  # type: ignore[override]
        (x, y), _, _ = next(dataloader_iter)
        return nn.functional.cross_entropy(self(x), y)


class _Fetches(L.Callback):
    """At fit start: what `fetch_batches` gives, then two replayed trials of the run as it is."""

    @override
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        with TrialSession(trainer, 3, warmup=0, replay=True) as session:
            self.fetched = replay_module.fetch_batches(trainer, 3)
            self.results = [session.run(AsIs()) for _ in range(2)]


def test_a_step_that_fetches_from_the_loader_iterator_is_not_replayed(tmp_path: Path) -> None:
    """``training_step(dataloader_iter)`` gets the loader's iterator, not batches: its trials fetch as usual.

    The replay's fetch unpacked the iterator as if it were a batch and the trial raised, ending the fit.
    """
    fetches = _Fetches()
    L.seed_everything(0, verbose=False)
    tiny_trainer(tmp_path, callbacks=[fetches], max_epochs=1, limit_val_batches=0).fit(_IterStep(num_samples=64))
    assert fetches.fetched is None
    assert all(result.fits and len(result.losses) == 3 for result in fetches.results)
    assert fetches.results[0].losses == fetches.results[1].losses


class _Named(TinyClassifier):
    """Batches of names (no tensor to copy): the step looks each name up in a fixed table of inputs."""

    @override
    def training_step(self, batch: list[str], batch_idx: int) -> torch.Tensor:  # type: ignore[override]
        index = torch.tensor([int(name) for name in batch])
        x, y = self._data(0).tensors
        return super().training_step((x[index], y[index]), batch_idx)

    @override
    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader([str(i) for i in range(64)], batch_size=8, shuffle=True)


def test_batches_with_no_tensor_to_copy_are_fetched_by_each_trial(tmp_path: Path) -> None:
    """A batch that holds no tensor cannot be copied for each trial (a step could change it in place): no replay."""
    fetches = _Fetches()
    L.seed_everything(0, verbose=False)
    tiny_trainer(tmp_path, callbacks=[fetches], max_epochs=1, limit_val_batches=0).fit(_Named(num_samples=64))
    assert fetches.fetched is None
    assert fetches.results[0].losses == fetches.results[1].losses
