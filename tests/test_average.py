"""WeightAverage: validation and checkpoints see a moving average of the weights; training itself is unchanged."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from conftest import RankWriter, TinyClassifier, callback_of, rank_records, tiny_trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_speedkit import WeightAverage, preset
from lightning_speedkit.average import ema_decay, validation_interval, warm_decay


class _Normed(TinyClassifier):
    """TinyClassifier with a batch norm (averaged buffers); keeps the weights each validation saw."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.net = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4))
        self.seen: list[dict[str, torch.Tensor]] = []

    @override
    def on_validation_epoch_start(self) -> None:
        if not self.trainer.sanity_checking:
            self.seen.append({k: v.detach().clone() for k, v in self.state_dict().items()})

    @override
    def train_dataloader(self) -> DataLoader[tuple[torch.Tensor, ...]]:
        return DataLoader(self._data(0), batch_size=self.batch_size)  # one order every epoch: a resume sees it too


class _Steps(L.Callback):
    """The trained weights after every optimizer step, and every step's loss."""

    def __init__(self) -> None:
        self.weights: list[dict[str, torch.Tensor]] = []
        self.losses: list[float] = []

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.weights.append({k: v.detach().clone() for k, v in pl_module.state_dict().items()})
        self.losses.append(float(outputs["loss"]))


def _fit(tmp_path: Path, callbacks: list[L.Callback], make: type[TinyClassifier] = _Normed, **kwargs: Any) -> Any:
    L.seed_everything(0, verbose=False)
    model = make(num_samples=64, batch_size=8)
    trainer = tiny_trainer(tmp_path, callbacks=callbacks, **{"max_epochs": 2, **kwargs})
    trainer.fit(model)
    return trainer, model


def _ema(weights: list[dict[str, torch.Tensor]], decay: float) -> dict[str, torch.Tensor]:
    """The average the callback should hold after these steps (float tensors; the first step starts it)."""
    average = {k: v.clone() for k, v in weights[0].items() if v.is_floating_point()}
    for updates, step in enumerate(weights[1:]):
        d = warm_decay(decay, updates)
        average = {k: d * v + (1 - d) * step[k] for k, v in average.items()}
    return average


def test_decay_follows_the_steps_between_validations() -> None:
    """A quarter of the interval is the time constant; a time constant of a step or less averages nothing."""
    assert ema_decay(400) == pytest.approx(0.99)
    assert ema_decay(100, share=0.5) == pytest.approx(0.98)
    assert ema_decay(4) == 0.0
    assert warm_decay(0.99, 0) == pytest.approx(0.1)
    assert warm_decay(0.99, 10_000) == 0.99


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ({}, 8.0),  # 64 samples in batches of 8: one validation an epoch
        ({"val_check_interval": 0.5}, 4.0),
        ({"check_val_every_n_epoch": 3}, 24.0),
        ({"accumulate_grad_batches": 2}, 4.0),
        ({"limit_val_batches": 0}, 8.0),  # never validates: an epoch
    ],
)
def test_validation_interval_counts_optimizer_steps(tmp_path: Path, options: dict[str, Any], expected: float) -> None:
    """The interval is read from the fit loop: the check interval, every n epochs, gradient accumulation."""
    seen: list[float] = []

    class _Read(L.Callback):
        def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            seen.append(validation_interval(trainer))

    _fit(tmp_path, [_Read()], TinyClassifier, max_epochs=1, **options)
    assert seen == [expected]


def test_training_is_unchanged_and_validation_sees_the_average(tmp_path: Path) -> None:
    """Same losses and trained weights with and without the average; each validation saw the average of the steps."""
    plain_steps = _Steps()
    _fit(tmp_path / "plain", [plain_steps])
    steps, average = _Steps(), WeightAverage(decay=0.9)
    _trainer, model = _fit(tmp_path / "avg", [steps, average])
    assert steps.losses == plain_steps.losses
    for mine, theirs in zip(steps.weights, plain_steps.weights, strict=True):
        assert all(torch.equal(mine[k], theirs[k]) for k in mine)
    assert len(model.seen) == 2
    for epoch, seen in enumerate(model.seen):
        expected = _ema(steps.weights[: 8 * (epoch + 1)], 0.9)
        for name, value in expected.items():
            torch.testing.assert_close(seen[name], value)
        assert not torch.equal(seen["net.0.weight"], steps.weights[8 * (epoch + 1) - 1]["net.0.weight"])
    final = _ema(steps.weights, 0.9)  # after fit the module holds the average
    for name, value in final.items():
        torch.testing.assert_close(model.state_dict()[name], value)
    assert average.report()["updates"] == 15
    assert average.report()["decay"] == 0.9


def test_accumulated_batches_average_only_the_weights_after_optimizer_steps(tmp_path: Path) -> None:
    """Under gradient accumulation the average starts at the first optimizer step, not from the untrained weights.

    A batch that only accumulates ends at the step count it began with; the first one ended at step 0 and started the
    average from the initial weights, which every later average then carried.
    """
    steps, average = _Steps(), WeightAverage(decay=0.5)
    _trainer, model = _fit(tmp_path, [steps, average], accumulate_grad_batches=2)
    stepped = steps.weights[1::2]  # 8 batches an epoch, 2 epochs: an optimizer step every second batch
    assert len(stepped) == 8
    for name, value in _ema(stepped, 0.5).items():
        torch.testing.assert_close(model.state_dict()[name], value)
    assert average.report()["updates"] == len(stepped) - 1


class _NewStorage(L.Callback):
    """After the third step every parameter gets new storage under the same object, as a layout change does."""

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if trainer.global_step == 3:
            for parameter in pl_module.parameters():
                parameter.data = parameter.data.clone()


def test_average_follows_parameters_given_new_storage_mid_epoch(tmp_path: Path) -> None:
    """A parameter whose storage is replaced mid-epoch (ChannelsLast's probe) is still averaged from its new values."""
    steps = _Steps()
    _, model = _fit(tmp_path, [steps, WeightAverage(decay=0.9), _NewStorage()])
    expected = _ema(steps.weights[:8], 0.9)
    torch.testing.assert_close(model.seen[0]["net.0.weight"], expected["net.0.weight"])


def test_decay_chosen_from_the_run(tmp_path: Path) -> None:
    """Without ``decay``: a quarter of the 8 steps between validations, a time constant of 2 steps."""
    average = WeightAverage()
    _fit(tmp_path, [average])
    report = average.report()
    assert report["interval_steps"] == 8.0
    assert report["decay"] == pytest.approx(0.5)
    assert report["time_constant_steps"] == pytest.approx(2.0)


def test_checkpoint_holds_the_average_and_a_resume_matches_the_straight_run(tmp_path: Path) -> None:
    """The checkpoint's state_dict is the average; resuming from it goes on from the trained weights, same result."""
    straight = WeightAverage(decay=0.8)
    _, straight_model = _fit(tmp_path / "straight", [straight], max_epochs=3)
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    steps, first = _Steps(), WeightAverage(decay=0.8)
    _fit(tmp_path / "first", [steps, first, checkpoint], max_epochs=1, enable_checkpointing=True)
    saved = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=False)
    expected = _ema(steps.weights, 0.8)
    for name, value in expected.items():
        torch.testing.assert_close(saved["state_dict"][name], value)
    trained = saved["callbacks"][first.state_key]["trained"]
    assert torch.equal(trained["net.0.weight"], steps.weights[-1]["net.0.weight"])
    resumed = WeightAverage(decay=0.8)
    L.seed_everything(0, verbose=False)
    model = _Normed(num_samples=64, batch_size=8)
    trainer = tiny_trainer(tmp_path / "resumed", callbacks=[resumed], max_epochs=3)
    trainer.fit(model, ckpt_path=tmp_path / "ckpt" / "last.ckpt")
    for name, value in straight_model.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], value)
    assert resumed.report()["updates"] == straight.report()["updates"]
    loaded = _Normed.load_from_checkpoint(tmp_path / "ckpt" / "last.ckpt")  # the average, as validated
    torch.testing.assert_close(loaded.state_dict()["net.0.weight"], expected["net.0.weight"])


@pytest.mark.filterwarnings("ignore:.*already finished.*")
def test_a_fit_resumed_from_a_finished_runs_checkpoint_ends_with_the_average(tmp_path: Path) -> None:
    """Resuming from the last checkpoint of a finished run (no step left to train) leaves the average in the module.

    The checkpoint's trained weights were put into the module at the restore, and only the end of training put the
    average back: with nothing to train, the fit ended on the trained weights.
    """
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    _, straight_model = _fit(tmp_path / "straight", [WeightAverage(decay=0.8), checkpoint], enable_checkpointing=True)
    L.seed_everything(0, verbose=False)
    model, again = _Normed(num_samples=64, batch_size=8), WeightAverage(decay=0.8)
    tiny_trainer(tmp_path / "again", callbacks=[again], max_epochs=2).fit(
        model, ckpt_path=tmp_path / "ckpt" / "last.ckpt"
    )
    for name, value in straight_model.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], value)


def test_a_second_fit_with_the_same_callback_averages_its_own_steps(tmp_path: Path) -> None:
    """The callback reused for a shorter fit of another model averages that fit, as a fresh one does.

    The first fit's average and last step survived: every step of the second (global steps below the first's last)
    was skipped, and the second model ended holding the first one's average.
    """
    reused = WeightAverage(decay=0.8)
    _fit(tmp_path / "first", [reused], max_epochs=4)
    _, second = _fit(tmp_path / "second", [reused], max_epochs=1)
    fresh = WeightAverage(decay=0.8)
    _, control = _fit(tmp_path / "control", [fresh], max_epochs=1)
    assert reused.report()["updates"] == fresh.report()["updates"] == 7  # 8 steps: the first starts the average
    for name, value in control.state_dict().items():
        torch.testing.assert_close(second.state_dict()[name], value)


def test_a_checkpoint_saved_after_fit_resumes_from_the_trained_weights(tmp_path: Path) -> None:
    """A checkpoint saved after fit keeps the trained weights in the callback's state: a resume from it matches.

    After fit the module holds the average; ``trainer.save_checkpoint`` used to store that as the trained weights too.
    """
    straight = WeightAverage(decay=0.8)
    _, straight_model = _fit(tmp_path / "straight", [straight], max_epochs=3)
    steps, first = _Steps(), WeightAverage(decay=0.8)
    trainer, _ = _fit(tmp_path / "first", [steps, first], max_epochs=1)
    trainer.save_checkpoint(tmp_path / "after_fit.ckpt")
    saved = torch.load(tmp_path / "after_fit.ckpt", weights_only=False)
    assert torch.equal(
        saved["callbacks"][first.state_key]["trained"]["net.0.weight"], steps.weights[-1]["net.0.weight"]
    )
    resumed = WeightAverage(decay=0.8)
    L.seed_everything(0, verbose=False)
    model = _Normed(num_samples=64, batch_size=8)
    tiny_trainer(tmp_path / "resumed", callbacks=[resumed], max_epochs=3).fit(
        model, ckpt_path=tmp_path / "after_fit.ckpt"
    )
    for name, value in straight_model.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], value)


def test_average_starts_again_when_the_weights_change_shape(tmp_path: Path) -> None:
    """Replaced parameters restart the average from the weights, and say so; training goes on."""
    average = WeightAverage(decay=0.5)

    class _Reshaped(_Normed):
        @override
        def on_train_epoch_start(self) -> None:
            if self.current_epoch == 1:
                self.net[3] = nn.Linear(32, 8)  # 8 outputs: another shape
                self.trainer.optimizers[0].param_groups[0]["params"][-2:] = list(self.net[3].parameters())

    _trainer, model = _fit(tmp_path, [average], _Reshaped)
    assert average.report()["restarts"] == ["the weights changed shape"]
    assert model.state_dict()["net.3.weight"].shape == (8, 32)


def test_non_finite_average_is_started_again_before_validation(tmp_path: Path) -> None:
    """An average that holds a NaN is not validated: it starts again from the weights."""
    average = WeightAverage(decay=0.5)

    class _Poison(L.Callback):
        def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
            if trainer.global_step == 8:  # the first epoch's last step, just before its validation
                average._average[0].fill_(float("nan"))  # type: ignore[index]

    _, model = _fit(tmp_path, [average, _Poison()])
    assert average.report()["restarts"] == ["not finite at step 8"]
    assert all(torch.isfinite(v).all() for seen in model.seen for v in seen.values() if v.is_floating_point())


def test_a_guard_rollback_starts_the_average_again(tmp_path: Path) -> None:
    """A `TrainingGuard` rollback tells the average, which starts again from the weights put back.

    The average took in the broken step before the guard acted (a spike is judged on its second step), and nothing
    told it of the rollback: without a validation to find it not finite, the fit ended holding a NaN average.
    """
    from lightning_speedkit import TrainingGuard

    class _Poison(L.Callback):  # breaks the weights once: the next step's loss is NaN
        def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
            if trainer.global_step == 5 and not guard.report()["rollbacks"]:
                pl_module.net[0].weight.data.fill_(float("nan"))  # type: ignore[index]

    guard, average = TrainingGuard(every_n_steps=2), WeightAverage(decay=0.9)
    _, model = _fit(tmp_path, [guard, average, _Poison()], limit_val_batches=0)
    assert guard.report()["rollbacks"] == 1
    assert average.report()["restarts"] == [f"rolled back to step {guard.report()['events'][0]['restored_step']}"]
    assert all(torch.isfinite(v).all() for v in model.state_dict().values() if v.is_floating_point())


class _BreaksLastStep(TinyClassifier):
    """The last of 5 steps gets a NaN loss: with checks every 5 steps, only the guard's end-of-fit check judges it."""

    @override
    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        return loss * float("nan") if self.trainer.global_step == 4 else loss


def test_a_rollback_after_the_average_went_in_keeps_the_weights_put_back_for_a_resume(tmp_path: Path) -> None:
    """A guard rollback at the fit's end, after the average went in: a checkpoint saved then resumes from sane weights.

    The average restarted from the weights put back, but the trained weights a resume goes on from stayed the broken
    ones (NaN) in the callback's state.
    """
    from lightning_speedkit import TrainingGuard

    guard, average = TrainingGuard(every_n_steps=2, check_every_n_steps=5), WeightAverage(decay=0.5)
    trainer, model = _fit(tmp_path, [average, guard], make=_BreaksLastStep, max_epochs=-1, max_steps=5)
    assert guard.report()["rollbacks"] == 1
    trainer.save_checkpoint(tmp_path / "after.ckpt")
    state = torch.load(tmp_path / "after.ckpt", weights_only=False)
    trained = state["callbacks"][average.state_key]["trained"]
    assert all(torch.isfinite(v).all() for v in trained.values())
    for name, value in model.state_dict().items():
        if value.is_floating_point():
            torch.testing.assert_close(trained[name], value)  # the module holds the weights put back


def test_preset_puts_the_average_after_the_guard() -> None:
    """``preset(average=True)`` adds it after TrainingGuard (a rolled-back step is never averaged); off by default."""
    names = preset(average=True, logger=False, verbose=False).speedkit["callbacks"]
    assert names.index("WeightAverage") == names.index("TrainingGuard") + 1
    assert "WeightAverage" not in preset(logger=False, verbose=False).speedkit["callbacks"]
    trainer = preset(average={"decay": 0.9}, logger=False, verbose=False)
    assert callback_of(trainer, WeightAverage).decay == 0.9


@pytest.mark.parametrize(("argument", "value"), [("decay", 1.0), ("decay", -0.1), ("share", 0.0), ("share", 1.5)])
def test_bad_input_names_the_argument(argument: str, value: float) -> None:
    """A decay outside [0, 1) or a share outside (0, 1] is an error that names it and the value."""
    with pytest.raises(ValueError, match=f"`{argument}`.*{value}"):
        WeightAverage(**{argument: value})


def _rank_average(trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
    """Each rank's average (the module holds it after fit) and its decay (written by `RankWriter`)."""
    state = pl_module.state_dict()
    weights = [x for name in sorted(state) if state[name].is_floating_point() for x in state[name].flatten().tolist()]
    return {"report": callback_of(trainer, WeightAverage).report(), "weights": weights}


@pytest.mark.slow
@pytest.mark.ddp
def test_ddp_ranks_hold_the_same_average(tmp_path: Path) -> None:
    """2-process DDP: both ranks set the same decay from their own steps and end with the same averaged weights.

    Batch-norm statistics included: each rank averages its own batches' statistics, and they ended different; rank
    zero's are every rank's at the end, as DDP's forward hands out rank zero's buffers.
    """
    strategy = DDPStrategy(start_method="spawn", process_group_backend="gloo")
    writer = RankWriter(tmp_path, _rank_average)
    L.seed_everything(0, verbose=False)
    model = _Normed(num_samples=256, batch_size=8)
    trainer = tiny_trainer(tmp_path, callbacks=[WeightAverage(), writer], strategy=strategy, devices=2, max_epochs=2)
    trainer.fit(model)
    ranks = rank_records(tmp_path)
    assert ranks[0]["report"] == ranks[1]["report"]
    assert ranks[0]["report"]["interval_steps"] == 16.0  # 256 samples, 2 ranks, batches of 8
    assert ranks[0]["report"]["decay"] == pytest.approx(0.75)
    assert ranks[0]["weights"] == pytest.approx(ranks[1]["weights"], abs=1e-6)
