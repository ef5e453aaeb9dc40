"""Checkpoints a fit resumes from: an unreadable file, or a damaged speedkit state, is refused before any restore."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from conftest import TinyClassifier, tiny_trainer
from lightning.pytorch.callbacks import ModelCheckpoint

import lightning_speedkit as speedkit
from lightning_speedkit.restore import CheckpointError, CheckpointsChecked, state_problem


def _callbacks() -> list[L.Callback]:
    return [
        speedkit.WarmupScheduler(warmup=4),
        speedkit.TrainingGuard(every_n_steps=4, window=4),
        speedkit.UtilizationMonitor(window=4),
        speedkit.DataLoaderTuner(probe_steps=2),
        speedkit.PrecisionTuner(probe_steps=2),
        speedkit.LRFinder(steps=5),
        speedkit.BatchSizeFinder(max_val=16, steps_per_trial=1),
        speedkit.StructuredPruning(amount=0.5, finetune_epochs=0, round_to=None, latency_batch_sizes=[]),
    ]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[L.Callback]]:
    """A checkpoint of a short fit with speedkit's stateful callbacks, and those callbacks."""
    tmp_path = tmp_path_factory.mktemp("restore")
    callbacks = _callbacks()
    saver = ModelCheckpoint(tmp_path / "ckpt", filename="last")
    trainer = tiny_trainer(tmp_path, callbacks=[*callbacks, saver], enable_checkpointing=True, max_epochs=1)
    L.seed_everything(0, verbose=False)
    trainer.fit(TinyClassifier(num_samples=128))
    return tmp_path / "ckpt" / "last.ckpt", callbacks


def test_every_saved_state_fits_its_own_spec(checkpoint: tuple[Path, list[L.Callback]]) -> None:
    """After a real fit each callback's state_dict is what its state_spec allows: no unknown key, no wrong type."""
    path, callbacks = checkpoint
    states = torch.load(path, weights_only=True)["callbacks"]
    for callback in callbacks:
        state = states[callback.state_key]
        assert state, type(callback).__name__
        spec = callback.state_spec  # type: ignore[attr-defined]
        assert state_problem(state, spec) is None, (type(callback).__name__, state)


def _resume(tmp_path: Path, path: Path, model: TinyClassifier | None = None) -> tuple[TinyClassifier, list[L.Callback]]:
    model = model or TinyClassifier(num_samples=128)
    callbacks = _callbacks()
    tiny_trainer(tmp_path, callbacks=callbacks, max_epochs=2).fit(model, ckpt_path=path)
    return model, callbacks


@pytest.mark.parametrize(
    "damage",
    [lambda b: b[: len(b) // 2], lambda b: b[:100], lambda b: b"", lambda b: b"\x00" * 64 + b[64:]],
    ids=["half", "100 bytes", "empty", "zeroed header"],
)
def test_an_unreadable_checkpoint_is_one_clear_error_naming_it(
    tmp_path: Path, checkpoint: tuple[Path, list[L.Callback]], damage: Any
) -> None:
    """A truncated or corrupt checkpoint fails before any step with a CheckpointError that names the file."""
    broken = tmp_path / "broken.ckpt"
    broken.write_bytes(damage(checkpoint[0].read_bytes()))
    model = TinyClassifier(num_samples=128)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(CheckpointError, match=f"The checkpoint {broken} cannot be read: it is truncated or corrupt"):
        _resume(tmp_path, broken, model)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


@pytest.mark.parametrize(
    ("callback", "path", "value", "shown"),
    [
        ("TrainingGuard", ("rollbacks",), "two", "`rollbacks` must be an int, got 'two'"),
        ("TrainingGuard", ("losses",), [0.5, None], "`losses[1]` must be a number, got None"),
        ("WarmupScheduler", ("schedule", "warmup_steps"), "4", "`schedule.warmup_steps` must be an int, got '4'"),
        ("BatchSizeFinder", ("decision", "batch_size"), 8.5, "`decision.batch_size` must be an int, got 8.5"),
        ("BatchSizeFinder", ("decision", "source"), 3, "`decision.source` must be a string, got 3"),
        ("UtilizationMonitor", ("totals",), [], "`totals` must be a dict, got []"),
        ("LRFinder", ("decision",), "x", "`decision` must be None or a dict, got 'x'"),
        ("PrecisionTuner", ("decision", "probed"), "yes", "`decision.probed` must be a bool, got 'yes'"),
        ("StructuredPruning", ("steps_done",), "1", "`steps_done` must be an int, got '1'"),
    ],
)
def test_a_damaged_state_is_refused_before_anything_is_restored(
    tmp_path: Path,
    checkpoint: tuple[Path, list[L.Callback]],
    callback: str,
    path: tuple[str, ...],
    value: Any,
    shown: str,
) -> None:
    """A wrong-typed value in a speedkit state raises naming the file, callback and key; the weights stay as built."""
    saved_path, callbacks = checkpoint
    saved = torch.load(saved_path, weights_only=True)
    state_key = next(c.state_key for c in callbacks if type(c).__name__ == callback)
    state = saved["callbacks"][state_key]
    for key in path[:-1]:
        state = state[key]
    state[path[-1]] = value
    edited = tmp_path / "edited.ckpt"
    torch.save(saved, edited)
    model = TinyClassifier(num_samples=128)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(CheckpointError, match=f"damaged {callback} state") as caught:
        _resume(tmp_path, edited, model)
    assert shown in str(caught.value)
    assert str(edited) in str(caught.value)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_a_state_with_unknown_keys_is_ignored_with_a_warning(
    tmp_path: Path, checkpoint: tuple[Path, list[L.Callback]]
) -> None:
    """Keys this version does not know (another version's checkpoint): that callback starts afresh, the fit goes on."""
    path, callbacks = checkpoint
    saved = torch.load(path, weights_only=True)
    guard_key = next(c.state_key for c in callbacks if isinstance(c, speedkit.TrainingGuard))
    saved["callbacks"][guard_key].update(rollbacks=2, from_the_future=1)
    edited = tmp_path / "future.ckpt"
    torch.save(saved, edited)
    with pytest.warns(UserWarning, match=r"TrainingGuard: .* keys this version does not know \(from_the_future\)"):
        _, resumed = _resume(tmp_path, edited)
    guard = next(c for c in resumed if isinstance(c, speedkit.TrainingGuard))
    assert guard.report()["rollbacks"] == 0  # the state was ignored as a whole, never half applied


def test_the_check_wraps_the_strategys_checkpoint_io_once(tmp_path: Path) -> None:
    """Several speedkit callbacks share one wrapper around the strategy's CheckpointIO, which still saves files."""
    trainer = tiny_trainer(tmp_path, callbacks=_callbacks()[1:3], max_steps=2)
    trainer.fit(TinyClassifier(num_samples=32))
    io = trainer.strategy.checkpoint_io
    assert isinstance(io, CheckpointsChecked)
    assert not isinstance(io.inner, CheckpointsChecked)
    trainer.save_checkpoint(tmp_path / "saved.ckpt")
    assert torch.load(tmp_path / "saved.ckpt", weights_only=True)["global_step"] == 2
