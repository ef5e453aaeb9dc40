"""LeanCallback: Lightning calls only the per-step hooks a callback overrides; levers stop being called once decided."""

from __future__ import annotations

import copy
import pickle
from collections import Counter
from pathlib import Path
from typing import Any

import lightning as L
from conftest import TinyClassifier, tiny_trainer
from typing_extensions import override

from lightning_speedkit import ChannelsLast, TrainingGuard
from lightning_speedkit.hooks import LeanCallback
from lightning_speedkit.trials.lever import Lever


class _CountsBatchEnd(LeanCallback):
    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self.calls["on_train_batch_end"] += 1


class _UserGuard(TrainingGuard):
    """A user's subclass that adds a hook its parent does not override."""

    def __init__(self) -> None:
        super().__init__()
        self.backwards = 0

    @override
    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: Any) -> None:
        self.backwards += 1


def _count_lever_step_ends(monkeypatch: Any) -> Counter[int]:
    """Count `Lever.on_train_batch_end` calls per lever (patched on the class, so a lever still sees its own hook)."""
    calls: Counter[int] = Counter()
    hook = Lever.on_train_batch_end

    def counted(self: Lever, *args: Any, **kwargs: Any) -> None:
        calls[id(self)] += 1
        hook(self, *args, **kwargs)

    monkeypatch.setattr(Lever, "on_train_batch_end", counted)
    return calls


def test_lightning_calls_only_the_step_hooks_a_lean_callback_overrides(tmp_path: Path) -> None:
    callback = _CountsBatchEnd()
    assert callback.on_before_backward is None
    assert callback.on_train_batch_start is None
    tiny_trainer(tmp_path, callbacks=[callback]).fit(TinyClassifier(num_samples=32))
    assert callback.calls["on_train_batch_end"] == 4  # 32 samples in batches of 8: the overridden hook still runs


def test_a_users_subclass_keeps_the_hooks_it_adds(tmp_path: Path) -> None:
    guard = _UserGuard()
    tiny_trainer(tmp_path, callbacks=[guard]).fit(TinyClassifier(num_samples=32))
    assert guard.backwards == 4


def test_a_lean_callback_copies_and_pickles_with_its_hooks_off() -> None:
    guard = TrainingGuard(every_n_steps=7)
    for twin in (copy.deepcopy(guard), pickle.loads(pickle.dumps(guard))):
        assert twin.on_before_backward is None
        assert twin.every_n_steps == 7
        assert callable(twin.on_train_batch_end)


def test_a_lever_is_not_called_on_steps_once_decided_and_is_called_again_in_the_next_fit(
    tmp_path: Path, monkeypatch: Any
) -> None:
    calls = _count_lever_step_ends(monkeypatch)
    lever = ChannelsLast(measure=False, remember=False)  # decided at fit start, nothing to time afterwards
    trainer = tiny_trainer(tmp_path, callbacks=[lever])
    trainer.fit(TinyClassifier(num_samples=32))
    assert calls[id(lever)] == 1  # the first step's end: nothing left to do, so the hooks go off
    assert lever.on_train_batch_start is None
    assert lever.on_train_batch_end is None
    again = tiny_trainer(tmp_path, callbacks=[lever])
    again.fit(TinyClassifier(num_samples=32))
    assert calls[id(lever)] == 2  # called again on the new fit's first step, then off again
    assert lever.on_train_batch_end is None


def test_a_remembering_lever_keeps_its_step_hooks_until_its_live_check_is_over(
    tmp_path: Path, monkeypatch: Any
) -> None:
    monkeypatch.setenv("SPEEDKIT_CACHE_DIR", str(tmp_path / "cache"))
    calls = _count_lever_step_ends(monkeypatch)
    lever = ChannelsLast(measure=False)
    tiny_trainer(tmp_path, callbacks=[lever]).fit(TinyClassifier(num_samples=8 * 40))
    memory = lever._memory
    assert memory is not None
    assert not memory.timing
    assert calls[id(lever)] == memory.CHECK_SKIP + memory.CHECK_STEPS  # of 40 steps: off after the check's last
