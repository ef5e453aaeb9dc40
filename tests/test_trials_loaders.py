"""The run's train loaders around a trial session: a shared generator put back, a started worker pool kept out."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import pytest
import torch
from conftest import TinyClassifier, tiny_trainer
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_speedkit.trials import AsIs, TrialSession
from lightning_speedkit.trials.loaders import generators_kept, loader_generators, run_loaders


class _Trials(L.Callback):
    """At fit start, two trials of the run as it is (or none), after counting the run's loaders the session finds."""

    def __init__(self, trials: bool) -> None:
        self.trials, self.loaders = trials, 0

    @override
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.loaders = len(run_loaders(trainer))
        if self.trials:
            with TrialSession(trainer, 3, warmup=0) as session:
                for _ in range(2):
                    session.run(AsIs())


class _Batches(L.Callback):
    """Every training batch of the run, by epoch."""

    def __init__(self) -> None:
        self.batches: dict[int, list[torch.Tensor]] = {}

    @override
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int) -> None:
        self.batches.setdefault(trainer.current_epoch, []).append(batch[0].clone())


class _SteppedByTheLoader(TinyClassifier):
    """A schedule whose length comes from ``estimated_stepping_batches``, as a ``OneCycleLR``'s would.

    Lightning then builds (and iterates) the train loader before ``on_fit_start``.
    """

    @override
    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=self.lr)
        total = int(self.trainer.estimated_stepping_batches)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 - step / (total + 1))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def _fit(tmp_path: Path, model: L.LightningModule, loader: DataLoader[Any], trials: bool) -> _Batches:
    batches = _Batches()
    trainer = tiny_trainer(tmp_path, callbacks=[_Trials(trials), batches], max_epochs=2, limit_val_batches=0)
    trainer.fit(model, train_dataloaders=loader)
    return batches


@pytest.mark.slow
def test_a_persistent_worker_pool_started_before_the_trials_still_serves_the_first_epoch(tmp_path: Path) -> None:
    """One loader object with a persistent worker, built before fit start: the trials start and stop their own pool.

    The trials' clean-up shut the run's own pool down, and the run's first epoch then ended before its first batch.
    With the run's pool kept out of the trials, both epochs see every batch, and the same ones as without trials.
    """
    runs = []
    for trials in (False, True):
        L.seed_everything(0, verbose=False)
        model = _SteppedByTheLoader(lr=0.05, num_samples=64)
        loader = DataLoader(model._data(0), batch_size=8, shuffle=True, num_workers=1, persistent_workers=True)
        runs.append(_fit(tmp_path, model, loader, trials).batches)
    without, with_trials = runs
    assert [len(without[epoch]) for epoch in (0, 1)] == [8, 8]
    assert [len(with_trials[epoch]) for epoch in (0, 1)] == [8, 8]
    for epoch in (0, 1):
        assert all(torch.equal(a, b) for a, b in zip(without[epoch], with_trials[epoch], strict=True))


def test_a_loader_generator_is_put_back_though_the_loader_is_not_built_yet(tmp_path: Path) -> None:
    """``DataLoader(generator=g)`` handed out again: the trials draw their shuffles from ``g``, then ``g`` is put back.

    At fit start the loader is not built yet, so the session asks the run's source for it (iterating nothing) to
    find ``g``; the run then shuffles its first epoch as it would without trials.
    """
    runs, found = [], []
    for trials in (False, True):
        L.seed_everything(0, verbose=False)
        model = TinyClassifier(lr=0.05, num_samples=64)
        generator = torch.Generator().manual_seed(7)
        loader = DataLoader(model._data(0), batch_size=8, shuffle=True, generator=generator)
        runs.append(_fit(tmp_path, model, loader, trials).batches)
        found.append(loader_generators([loader]) == [generator])
    without, with_trials = runs
    assert found == [True, True]
    for epoch in (0, 1):
        assert all(torch.equal(a, b) for a, b in zip(without[epoch], with_trials[epoch], strict=True))


def test_the_run_loaders_are_found_before_they_are_built(tmp_path: Path) -> None:
    """At fit start, before the fit loop builds it, the session finds the run's one loader through its source."""
    trials = _Trials(trials=False)
    L.seed_everything(0, verbose=False)
    trainer = tiny_trainer(tmp_path, callbacks=[trials], max_epochs=1, limit_val_batches=0)
    trainer.fit(TinyClassifier(num_samples=32))
    assert trials.loaders == 1


class _CountedHook(TinyClassifier):
    """Counts the calls of its ``train_dataloader`` hook (a user's hook may build a dataset each time)."""

    calls = 0

    @override
    def train_dataloader(self) -> DataLoader[tuple[torch.Tensor, ...]]:
        self.calls += 1
        return super().train_dataloader()


class _Reads(L.Callback):
    """At fit start: the steps left and the fingerprint's loader, twice each; then the batch size doubled and again."""

    def __init__(self) -> None:
        self.reads: list[Any] = []
        self.calls: list[int] = []

    @override
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        from lightning.pytorch.utilities.parsing import lightning_setattr

        from lightning_speedkit.trials import steps_left
        from lightning_speedkit.trials.job import _loader

        for _ in range(2):
            self.reads.append((steps_left(trainer), _loader(trainer)["batch_size"]))
            self.calls.append(pl_module.calls)  # type: ignore[attr-defined]
        lightning_setattr(pl_module, "batch_size", 2 * pl_module.batch_size)  # as a batch size finder sets it
        self.reads.append((steps_left(trainer), _loader(trainer)["batch_size"]))
        self.calls.append(pl_module.calls)  # type: ignore[attr-defined]


def test_the_unbuilt_train_loader_is_read_once_until_what_it_depends_on_changes(tmp_path: Path) -> None:
    """Reading the steps left and the loader's settings before the fit built its loader asks the user's hook once each.

    ``preset()``'s levers read them ten times at fit start, and every read called the user's ``train_dataloader``
    again (11 calls in a ``preset()`` fit of `benchmarks/lr_tasks.py`'s MLP, 16 with ``lr="auto"``). A read is kept
    until the batch size (or the step, the budget, the source) changes, and the fit still builds its own loader.
    """
    reads = _Reads()
    model = _CountedHook(num_samples=64, batch_size=8)
    trainer = tiny_trainer(tmp_path, callbacks=[reads], max_epochs=2, limit_val_batches=0)
    trainer.fit(model)
    assert reads.reads == [(16.0, 8), (16.0, 8), (8.0, 16)]  # 64 samples: 8 batches of 8 an epoch, then 4 of 16
    assert reads.calls == [2, 2, 4]  # one build for each kind of read; after the change, one more each
    assert model.calls == 5  # and the fit's own
    assert trainer.global_step == 8


def test_a_peek_leaves_the_run_as_it_was(tmp_path: Path) -> None:
    """The fit after the reads trains on the same batches, in the same order, as without them (the RNG untouched)."""
    runs = []
    for read in (False, True):
        L.seed_everything(0, verbose=False)
        batches = _Batches()
        callbacks: list[L.Callback] = [_Reads(), batches] if read else [batches]
        model = _CountedHook(num_samples=64, batch_size=8)
        tiny_trainer(tmp_path, callbacks=callbacks, max_epochs=1, limit_val_batches=0).fit(model)
        runs.append(batches.batches[0])
    without, with_reads = runs
    assert len(without) == 8  # batches of 8
    assert len(with_reads) == 4  # the reads' callback doubled the batch size before the fit
    assert torch.equal(torch.cat(without), torch.cat(with_reads))  # the same shuffle of the same samples


class _SizesByStage(_CountedHook):
    """A ``batch_size`` hyperparameter that is a dict (one size per stage): unhashable."""

    def __init__(self) -> None:
        super().__init__(num_samples=64, batch_size=8)
        self.batch_size = self.hparams["batch_size"] = {"train": 8, "val": 16}  # type: ignore[assignment]

    @override
    def train_dataloader(self) -> DataLoader[tuple[torch.Tensor, ...]]:
        self.calls += 1
        return DataLoader(self._data(0), batch_size=self.batch_size["train"], shuffle=True)  # type: ignore[index]


class _StepsLeftTwice(L.Callback):
    def __init__(self) -> None:
        self.left: list[float] = []

    @override
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        from lightning_speedkit.trials import steps_left

        self.left = [steps_left(trainer), steps_left(trainer)]


def test_a_batch_size_that_is_not_hashable_is_read_and_kept(tmp_path: Path) -> None:
    """A dict ``batch_size`` (sizes by stage) keys the kept read by its text: no ``TypeError``, one build, two reads."""
    reads = _StepsLeftTwice()
    model = _SizesByStage()
    tiny_trainer(tmp_path, callbacks=[reads], max_epochs=1, limit_val_batches=0).fit(model)
    assert reads.left == [8.0, 8.0]
    assert model.calls == 2  # the read's build, and the fit's own


def test_generators_kept_puts_back_torch_numpy_and_python_generators_and_skips_the_rest() -> None:
    """Every generator a DataModule holds gets its state back (subclasses, in lists); others are left, none crash.

    A kind not kept (numpy's, Python's) let a hook that draws rows from it draw twice; a type looked up by hashing
    crashed on an attribute whose type cannot be hashed.
    """

    class Meta(type):
        def __eq__(cls, other: object) -> bool:
            return cls is other

        __hash__ = None  # type: ignore[assignment]

    class Odd(metaclass=Meta):
        pass

    class MyRandom(random.Random):
        pass

    class Holder:
        def __init__(self) -> None:
            self.torch = torch.Generator().manual_seed(1)
            self.numpy = np.random.default_rng(1)
            self.legacy = np.random.RandomState(1)
            self.python = MyRandom(1)
            self.listed = [random.Random(2)]
            self.system = random.SystemRandom()
            self.odd = Odd()

    def draw(h: Holder) -> tuple[Any, ...]:
        numpy_draws = (h.numpy.random(2).tolist(), h.legacy.rand(2).tolist())
        return torch.rand(2, generator=h.torch).tolist(), numpy_draws, h.python.random(), h.listed[0].random()

    holder = Holder()
    with generators_kept(holder):
        first = draw(holder)
    assert draw(holder) == first
