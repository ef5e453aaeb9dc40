"""TrainingGuard: a NaN, a loss spike or a stall rolls back once to the last good state, at a lower LR, and goes on."""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from conftest import FixedStep, RankWriter, TinyClassifier, callback_of, rank_records, tiny_trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy
from typing_extensions import override

from lightning_speedkit import TrainingGuard
from lightning_speedkit.guard import SNAPSHOT_EVERY, robust_z, snapshot_interval


class _Faulty(TinyClassifier):
    """Its loss is NaN, spikes or stalls at chosen optimizer steps (on chosen ranks)."""

    def __init__(
        self,
        nan_at: tuple[int, ...] = (),
        spike_at: tuple[int, ...] = (),
        stall: bool = False,
        ranks: tuple[int, ...] = (0,),
    ) -> None:
        super().__init__(lr=0.05, num_samples=256, batch_size=8)
        self.nan_at, self.spike_at, self.stall, self.ranks = nan_at, spike_at, stall, ranks

    @override
    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        if self.global_rank not in self.ranks:
            return loss
        if self.global_step in self.nan_at:
            return loss * float("nan")
        if self.stall:
            return loss * 0.0 + 2.3  # no gradient: the loss cannot fall
        if self.global_step in self.spike_at:
            return loss * 1000.0
        return loss


def _fit(tmp_path: Path, model: TinyClassifier, guard: TrainingGuard, **kwargs: Any) -> L.Trainer:
    ckpt_path = kwargs.pop("ckpt_path", None)
    extra = kwargs.pop("callbacks", [])
    trainer = tiny_trainer(tmp_path, callbacks=[guard, *extra], limit_val_batches=0, **{"max_epochs": 2, **kwargs})
    L.seed_everything(0, verbose=False)
    trainer.fit(model, ckpt_path=ckpt_path)
    return trainer


def _finite(model: torch.nn.Module) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in model.parameters())


def test_robust_z_ignores_one_outlier_in_the_window() -> None:
    """A spike already in the window barely moves the median and MAD, so the next one still stands out."""
    window = [1.0, 1.1, 0.9, 1.0, 1.05, 0.95, 50.0]
    assert robust_z(50.0, window) > 100
    assert robust_z(1.02, window) < 1


def test_a_nan_rolls_back_once_and_training_ends_finite(tmp_path: Path) -> None:
    """A NaN loss at one step restores the last snapshot, halves the LR, and the run ends with finite weights."""
    model = _Faulty(nan_at=(20,))
    guard = TrainingGuard(every_n_steps=5, window=10)
    trainer = _fit(tmp_path, model, guard)
    report = guard.report()
    assert report["rollbacks"] == 1
    assert [(e["trigger"], e["step"], e["restored_step"]) for e in report["events"]] == [("non-finite loss", 21, 20)]
    assert report["lr_scale"] == 0.5
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.05 * 0.5)
    assert _finite(model)
    assert trainer.global_step == 64  # the run went on to its end


def test_two_rollbacks_to_one_snapshot_put_back_its_momentum_both_times(tmp_path: Path) -> None:
    """NaN losses at two steps in a row both restore the snapshot of step 20, and the run ends finite.

    SGD with momentum: the first restore must not hand the snapshot's momentum buffers to the optimizer, or the NaN
    step after it fills them, in the snapshot too, with NaN.
    """
    model = _Faulty(nan_at=(20, 21))
    guard = TrainingGuard(every_n_steps=5, window=10, max_rollbacks=3)
    trainer = _fit(tmp_path, model, guard)
    events = [(e["trigger"], e["step"], e["restored_step"]) for e in guard.report()["events"]]
    assert events == [("non-finite loss", 21, 20), ("non-finite loss", 22, 20)]
    assert _finite(model)
    momentum = [trainer.optimizers[0].state[p]["momentum_buffer"] for p in model.parameters()]
    assert all(bool(torch.isfinite(m).all()) for m in momentum)


def test_a_loss_spike_rolls_back_once(tmp_path: Path) -> None:
    """A loss 1000x the window's typical value two steps in a row is a spike: one rollback, then training goes on."""
    model = _Faulty(spike_at=(30, 31))
    guard = TrainingGuard(every_n_steps=5, window=10)
    _fit(tmp_path, model, guard)
    assert [(e["trigger"], e["step"]) for e in guard.report()["events"]] == [("loss spike", 32)]
    assert _finite(model)


def test_one_outlying_batch_is_not_a_spike(tmp_path: Path) -> None:
    """One batch far out (its loss only, not its gradient) and a normal loss after it: no rollback."""

    class _OneHardBatch(TinyClassifier):
        @override
        def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
            loss = super().training_step(batch, batch_idx)
            return loss + 1000.0 * loss.detach() if self.global_step == 30 else loss

    guard = TrainingGuard(every_n_steps=5, window=10)
    _fit(tmp_path, _OneHardBatch(lr=0.05, num_samples=256, batch_size=8), guard)
    assert guard.report()["rollbacks"] == 0
    assert guard.state_dict()["spiked"] is False


def test_two_hard_batches_near_convergence_are_not_a_spike() -> None:
    """Far out by z, but taking back little of the loss's fall since the first steps: not a spike; a real one is.

    A classifier at a loss near 0.01 (from 1.4) met two hard batches at 0.2 and 0.23 in a row: the window's spread is
    tiny there, their z far over 8, and the guard rolled back and halved the LR (7 of 16 `preset()` runs of one user).
    """
    guard = TrainingGuard(window=8)
    guard._start_losses = [1.4] * 8
    for value in [0.007, 0.037, 0.005, 0.007, 0.067, 0.033, 0.005, 0.039]:
        guard._losses.append(value)
    assert [guard._judge(v, step) for step, v in enumerate([0.196, 0.231])] == [None, None]
    assert [guard._judge(v, step) for step, v in enumerate([1.1, 1.3])] == [None, "loss spike"]


def test_a_stalled_run_rolls_back_to_the_start_once(tmp_path: Path) -> None:
    """A loss that has not fallen below 90% of its start after stall_steps restores the first snapshot, once."""
    model = _Faulty(stall=True)
    guard = TrainingGuard(every_n_steps=5, window=10, stall_steps=40)
    _fit(tmp_path, model, guard, max_steps=60)
    events = guard.report()["events"]
    assert [(e["trigger"], e["restored_step"]) for e in events] == [("stalled", 0)]
    assert events[0]["step"] == 40


def test_a_nan_after_a_stall_rollback_goes_back_to_the_restarted_run_not_the_stalled_one(tmp_path: Path) -> None:
    """After a stall rolled back to the start, a NaN restores that start, not a snapshot of the abandoned run.

    The periodic snapshot still pointed at the stalled run (step 10): the NaN's rollback brought it back, undoing
    the restart with its optimizer state.
    """
    model = _Faulty(stall=True, nan_at=(23,))
    guard = TrainingGuard(every_n_steps=10, window=10, stall_steps=20)
    _fit(tmp_path, model, guard, max_steps=26)
    events = guard.report()["events"]
    assert [(e["trigger"], e["step"], e["restored_step"]) for e in events] == [
        ("stalled", 20, 0),
        ("non-finite loss", 24, 0),
    ]


def test_a_guard_used_for_a_second_fit_starts_from_none_of_the_first_fits_state(tmp_path: Path) -> None:
    """A second fit (a new model) with the same guard snapshots its own start; the first fit's state is gone.

    The first fit's snapshot survived into the second: a NaN there put the first model's weights back, and its loss
    window judged the new model's first losses (a false spike).
    """
    guard = TrainingGuard(every_n_steps=5, window=10)
    _fit(tmp_path / "first", _Faulty(), guard, max_steps=40)
    assert guard.report()["events"] == []
    second = _Faulty(nan_at=(3,))  # before the second fit's first periodic snapshot
    _fit(tmp_path / "second", second, guard, max_steps=12)
    events = guard.report()["events"]
    assert [(e["trigger"], e["step"], e["restored_step"]) for e in events] == [("non-finite loss", 4, 0)]
    assert guard.report()["rollbacks"] == 1
    assert _finite(second)


def test_past_max_rollbacks_the_run_stops_with_a_clear_error(tmp_path: Path) -> None:
    """With max_rollbacks=1 a second NaN raises a RuntimeError that says what happened and what to do."""
    guard = TrainingGuard(every_n_steps=5, window=10, max_rollbacks=1)
    with pytest.raises(RuntimeError, match=r"non-finite loss at step 31 .* no rollback left.*Lower the learning rate"):
        _fit(tmp_path, _Faulty(nan_at=(20, 30)), guard)


class _NanData(TinyClassifier):
    """Every batch from step 12 on holds a NaN, as bad data would: no rollback can get past it."""

    @override
    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        if self.global_step >= 12:
            x = x.clone()
            x[0, 0] = float("nan")
        return super().training_step((x, y), batch_idx)


def test_giving_up_leaves_the_last_good_weights_in_place(tmp_path: Path) -> None:
    """When no rollback is left, the last good snapshot is put back before the error: no NaN weights remain."""
    model = _NanData(lr=0.05, num_samples=256)
    guard = TrainingGuard(every_n_steps=5, window=10, max_rollbacks=2)
    with pytest.raises(RuntimeError, match=r"no rollback left.*step 10 were put back"):
        _fit(tmp_path, model, guard)
    assert guard.report()["rollbacks"] == 2
    assert _finite(model)


def test_over_the_memory_budget_it_only_watches(tmp_path: Path) -> None:
    """A snapshot larger than max_snapshot_bytes is not taken; the report says so and a NaN then stops the run."""
    guard = TrainingGuard(max_snapshot_bytes=10)
    with pytest.raises(RuntimeError, match="over the 0 MiB budget"):
        _fit(tmp_path, _Faulty(nan_at=(3,)), guard)
    assert guard.report()["watch_only"].startswith("a snapshot takes")


def test_a_later_snapshot_over_the_budget_leaves_none_to_roll_back_to(tmp_path: Path) -> None:
    """The first snapshot fits (the optimizer has no state before its first step); the next, with momentum, does not.

    From then on the guard only watches, as it warns: a NaN stops the run. It kept the first snapshot, and the NaN
    rolled the run back to step 0, throwing every step since away, while the report said it only watched.
    """
    guard = TrainingGuard(every_n_steps=5, max_snapshot_bytes=4000)  # weights 2.7 kB; with SGD's momentum 5.4 kB
    with pytest.raises(RuntimeError, match="no rollback left: a snapshot takes"):
        _fit(tmp_path, _Faulty(nan_at=(8,)), guard)
    report = guard.report()
    assert report["watch_only"].startswith("a snapshot takes")
    assert report["rollbacks"] == 0
    assert report["snapshot_bytes"] > 4000  # the snapshot refused, not the first one


class _FaultyLRFree(_Faulty):
    """An LR-free optimizer; with ``mixed``, its first layer's group has an ``lr`` (which the guard can back off)."""

    def __init__(self, mixed: bool, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.mixed = mixed

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        first, second = (list(layer.parameters()) for layer in (self.net[0], self.net[2]))
        return FixedStep([{"params": first, **({"lr": 0.1} if self.mixed else {})}, {"params": second}])


@pytest.mark.parametrize("mixed", [False, True])
def test_a_rollback_backs_off_only_the_lrs_there_are(tmp_path: Path, mixed: bool) -> None:
    """No ``lr`` in any param group: the rollback says it left the LR as it is; a group with one is backed off.

    It warned "multiplied the LR by 0.5" and reported ``lr_scale: 0.5`` while nothing had changed.
    """
    guard = TrainingGuard(every_n_steps=5)
    said = "multiplied the LR by 0.5 (the param groups with no `lr` left" if mixed else "left the LR as it is"
    with pytest.warns(UserWarning, match=re.escape(f"restored step 5 and {said}")):
        trainer = _fit(tmp_path, _FaultyLRFree(mixed, nan_at=(8,)), guard)
    report = guard.report()
    assert report["rollbacks"] == 1
    assert report["lr_scale"] == report["events"][0]["lr_scale"] == (0.5 if mixed else 1.0)
    groups = trainer.optimizers[0].param_groups
    assert [group.get("lr") for group in groups] == ([0.05, None] if mixed else [None, None])


@pytest.mark.parametrize("nan_at", [34, 32])
def test_a_rollback_after_pruning_goes_back_to_the_pruned_model(tmp_path: Path, nan_at: int) -> None:
    """Pruning rebuilds the optimizer: the guard snapshots the pruned model at once, and a later NaN goes back to it.

    The snapshot from before pruning held the old shapes, and the rollback ended the fit with a size mismatch in
    ``load_state_dict``. A NaN in the pruning step itself has no snapshot of the new shapes: it stops the run, saying
    so.
    """
    from lightning_speedkit.pruning import StructuredPruning

    guard = TrainingGuard(every_n_steps=100)  # one snapshot at the start, none before step 100 on their own
    pruning = StructuredPruning(amount=0.5, start_epoch=1, finetune_epochs=1, round_to=None, latency_batch_sizes=())
    model = _Faulty(nan_at=(nan_at,))  # 32 steps an epoch: pruned at step 32
    if nan_at == 32:
        with pytest.raises(
            RuntimeError, match=r"no rollback left: the module changed \(pruned\) since the last snapshot"
        ):
            _fit(tmp_path, model, guard, callbacks=[pruning], max_epochs=3)
        return
    _fit(tmp_path, model, guard, callbacks=[pruning], max_epochs=3)
    assert [(event["step"], event["restored_step"]) for event in guard.report()["events"]] == [(35, 33)]
    assert model.net[0].out_features == 16  # pruned, and trained on
    assert _finite(model)


def test_a_resume_keeps_the_counters(tmp_path: Path) -> None:
    """After a rollback in epoch 0, a fit resumed from that epoch's checkpoint still counts it and lists its event."""
    ckpt = ModelCheckpoint(tmp_path / "ckpt", save_top_k=-1, filename="{epoch}")
    first = TrainingGuard(every_n_steps=5, window=10)
    _fit(tmp_path, _Faulty(nan_at=(10,)), first, callbacks=[ckpt], enable_checkpointing=True, max_epochs=1)
    resumed = TrainingGuard(every_n_steps=5, window=10)
    trainer = _fit(tmp_path, _Faulty(), resumed, ckpt_path=str(tmp_path / "ckpt" / "epoch=0.ckpt"))
    assert resumed.report()["rollbacks"] == first.report()["rollbacks"] == 1
    assert resumed.report()["events"] == first.report()["events"]
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.05 * 0.5)


def test_a_manual_step_that_returns_no_loss_is_not_watched_and_the_fit_goes_on(tmp_path: Path) -> None:
    """Manual optimization whose training_step returns no loss (a GAN's usual form) is not watched.

    One warning names what it returned, the fit runs to its end, and the report counts the steps left unwatched.
    """

    class NoLoss(TinyClassifier):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False

        @override
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            optimizer = self.optimizers()
            optimizer.zero_grad()  # type: ignore[union-attr]
            self.manual_backward(super().training_step(batch, batch_idx))
            optimizer.step()  # type: ignore[union-attr]

    guard = TrainingGuard()
    with pytest.warns(UserWarning, match=r"returned no scalar loss under manual optimization \(got None\)") as caught:
        trainer = _fit(tmp_path, NoLoss(), guard)
    assert sum("no scalar loss" in str(w.message) for w in caught) == 1
    assert trainer.global_step == 16  # 2 epochs of 8 batches: the fit ran to its end
    assert guard.report()["unwatched"] == 16
    assert guard.report()["rollbacks"] == 0
    assert guard.state_dict()["unwatched"] == 16  # a resumed fit's report still counts them


def test_a_skipped_batch_is_skipped_and_not_a_fault(tmp_path: Path) -> None:
    """A training_step returning None (Lightning's way to skip a batch) is skipped: no error, no rollback."""

    class SkipsOdd(TinyClassifier):
        @override
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            loss = super().training_step(batch, batch_idx)
            return None if batch_idx % 2 else loss

    guard = TrainingGuard(every_n_steps=5, window=10)
    trainer = _fit(tmp_path, SkipsOdd(lr=0.05, num_samples=256), guard)
    assert guard.report()["rollbacks"] == 0
    assert trainer.global_step == 64  # the fit ran to its end


def test_losses_are_read_in_batches_of_check_every_n_steps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``check_every_n_steps=8`` the guard reduces and reads the losses once per 8 steps, not once a step."""
    reductions: list[int] = []
    reduce = SingleDeviceStrategy.reduce

    def counted(self: SingleDeviceStrategy, tensor: Any, *args: Any, **kwargs: Any) -> Any:
        if tensor.dim() == 1:  # the guard's stacked losses (Lightning reduces scalars of its own)
            reductions.append(int(tensor.numel()))
        return reduce(self, tensor, *args, **kwargs)

    monkeypatch.setattr(SingleDeviceStrategy, "reduce", counted)
    guard = TrainingGuard(every_n_steps=64, window=10, check_every_n_steps=8)
    _fit(tmp_path, _Faulty(), guard)  # 2 epochs of 32 steps
    assert reductions == [8] * 8
    assert guard.report()["check_every_n_steps"] == 8
    assert TrainingGuard().report()["check_every_n_steps"] == 1  # by default each step's loss is read


def test_a_nan_read_in_a_batch_rolls_back_to_the_snapshot_before_it(tmp_path: Path) -> None:
    """A NaN at step 20, read with the next batch of 4 losses, restores the snapshot of step 20; the run goes on."""
    model = _Faulty(nan_at=(20,))
    guard = TrainingGuard(every_n_steps=5, window=10, check_every_n_steps=4)
    trainer = _fit(tmp_path, model, guard)
    [event] = guard.report()["events"]
    assert (event["trigger"], event["restored_step"]) == ("non-finite loss", 20)
    assert 21 <= event["step"] <= 24  # acted on when the batch holding step 21's loss was read
    assert _finite(model)
    assert trainer.global_step == 64


def test_unread_losses_survive_a_resume(tmp_path: Path) -> None:
    """A checkpoint between two reads keeps the unread losses; the resumed fit reads them: none is lost."""
    ckpt = ModelCheckpoint(tmp_path / "ckpt", every_n_train_steps=10, save_top_k=-1, filename="{step}")
    kwargs: dict[str, Any] = {"every_n_steps": 50, "window": 100, "check_every_n_steps": 4}
    first = TrainingGuard(**kwargs)
    _fit(tmp_path, _Faulty(), first, callbacks=[ckpt], enable_checkpointing=True, max_steps=20)
    saved = torch.load(tmp_path / "ckpt" / "step=10.ckpt", weights_only=False)["callbacks"]
    [state] = [v for k, v in saved.items() if k.startswith("TrainingGuard")]
    assert [step for step, _ in state["pending"]] == [9, 10]  # read at 4 and 8; 9 and 10 not yet
    resumed = TrainingGuard(**kwargs)
    _fit(tmp_path, _Faulty(), resumed, max_steps=20, ckpt_path=str(tmp_path / "ckpt" / "step=10.ckpt"))
    assert len(resumed.state_dict()["losses"]) == len(first.state_dict()["losses"]) == 20
    assert resumed.state_dict()["losses"][:10] == first.state_dict()["losses"][:10]


def _rank_weights(trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
    """Each rank's rollbacks and weights at the end of training (written by `RankWriter`)."""
    weights = [x for p in pl_module.parameters() for x in p.detach().flatten().tolist()]
    return {"rollbacks": callback_of(trainer, TrainingGuard).report()["rollbacks"], "weights": weights}


@pytest.mark.slow
@pytest.mark.ddp
@pytest.mark.parametrize("check_every", [1, 4])
def test_ddp_ranks_roll_back_together(tmp_path: Path, check_every: int) -> None:
    """2-process DDP: a NaN on rank 1 only rolls both ranks back, and they end with the same finite weights.

    Also when the losses are read 4 at a time: one all-reduce of the 4 losses, the same verdict on both ranks.
    """
    strategy = DDPStrategy(start_method="spawn", process_group_backend="gloo")
    guard = TrainingGuard(every_n_steps=5, window=10, check_every_n_steps=check_every)
    _fit(
        tmp_path,
        _Faulty(nan_at=(12,), ranks=(1,)),
        guard,
        strategy=strategy,
        devices=2,
        callbacks=[RankWriter(tmp_path, _rank_weights)],
    )
    ranks = rank_records(tmp_path)
    assert ranks[0]["rollbacks"] == ranks[1]["rollbacks"] == 1
    assert ranks[0]["weights"] == pytest.approx(ranks[1]["weights"], abs=1e-6)


def test_the_snapshot_interval_doubles_until_a_snapshot_takes_a_hundredth_of_the_steps() -> None:
    """50 steps while a snapshot costs at most 1% of them; doubled as often as needed when it costs more."""
    assert SNAPSHOT_EVERY == 50
    assert snapshot_interval(0.001, 0.002) == 50  # 1 ms against 100 ms of steps: 1%
    assert snapshot_interval(0.0011, 0.002) == 100
    assert snapshot_interval(0.5, 0.1) == 800  # a large model's copy to host: 0.5 s against 0.1 s steps
    assert snapshot_interval(0.5, 0.0) == 50  # no step time measured: the least


class _SlowSnapshot(TinyClassifier):
    """Its ``state_dict`` takes ``delay`` seconds more on the ranks in ``ranks``: a model slow to copy to host."""

    def __init__(self, delay: float, ranks: tuple[int, ...] = (0,)) -> None:
        super().__init__(lr=0.05, num_samples=256, batch_size=8)
        self.delay, self.ranks = delay, ranks

    @override
    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        if self.global_rank in self.ranks:
            time.sleep(self.delay)
        return super().state_dict(*args, **kwargs)


def test_the_guard_takes_slow_snapshots_more_rarely(tmp_path: Path) -> None:
    """By default the interval follows the measured cost: a snapshot of 30 ms is taken more rarely than every 50 steps.

    A tiny model's steps take milliseconds, so 1% of 50 of them is under 30 ms: the interval is 50 doubled (to keep
    the snapshots within 1% of the steps' time). An interval asked for is kept as it is.
    """
    slow = TrainingGuard()
    _fit(tmp_path, _SlowSnapshot(0.03), slow)
    report = slow.report()
    assert report["snapshot_s"] >= 0.03
    assert report["every_n_steps"] >= 2 * SNAPSHOT_EVERY
    assert report["every_n_steps"] % SNAPSHOT_EVERY == 0
    assert (report["every_n_steps"] // SNAPSHOT_EVERY).bit_count() == 1  # 50 times a power of two
    asked = TrainingGuard(every_n_steps=5)
    _fit(tmp_path, _SlowSnapshot(0.03), asked)
    assert asked.report()["every_n_steps"] == 5


def _rank_interval(trainer: L.Trainer, pl_module: L.LightningModule) -> Any:
    report = callback_of(trainer, TrainingGuard).report()
    return {"every_n_steps": report["every_n_steps"], "snapshot_s": report["snapshot_s"]}


@pytest.mark.slow
@pytest.mark.ddp
def test_ddp_ranks_keep_rank_zeros_snapshot_interval(tmp_path: Path) -> None:
    """2-process DDP: only rank 1's snapshots are slow, and both ranks keep rank zero's interval.

    So a rollback puts both ranks back to the same step.
    """
    strategy = DDPStrategy(start_method="spawn", process_group_backend="gloo")
    _fit(
        tmp_path,
        _SlowSnapshot(0.1, ranks=(1,)),
        TrainingGuard(),
        strategy=strategy,
        devices=2,
        callbacks=[RankWriter(tmp_path, _rank_interval)],
    )
    ranks = rank_records(tmp_path)
    assert ranks[1]["snapshot_s"] >= 0.1
    assert ranks[0]["every_n_steps"] == ranks[1]["every_n_steps"]
    assert ranks[0]["every_n_steps"] < snapshot_interval(ranks[1]["snapshot_s"], 0.01)  # not rank 1's own choice


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"backoff": 1.0}, "`backoff`"),
        ({"backoff": 0.0}, "`backoff`"),
        ({"max_rollbacks": -1}, "`max_rollbacks`"),
        ({"window": 1}, "`window`"),
        ({"every_n_steps": 0}, "`every_n_steps`"),
        ({"spike_z": 0}, "`spike_z`"),
        ({"stall_steps": 0}, "`stall_steps`"),
        ({"stall_steps": 1}, r"`stall_steps` must be an int >= 2"),  # accepted, then a crash at the first step
        ({"stall_steps": 1.0}, r"`stall_steps` must be an int >= 2"),
        ({"stall_fraction": 1.5}, "`stall_fraction`"),
        ({"max_snapshot_bytes": -1}, "`max_snapshot_bytes`"),
        ({"check_every_n_steps": 0}, "`check_every_n_steps`"),
    ],
)
def test_bad_arguments_are_refused(kwargs: dict[str, Any], match: str) -> None:
    """Each bad argument gets a ValueError naming it."""
    with pytest.raises(ValueError, match=match):
        TrainingGuard(**kwargs)
