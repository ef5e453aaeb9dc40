"""Counted trials: a lever whose settings keep the math probes on the fit's own first steps, and they all count."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from conftest import IN_EPOCH_LOOP, RankWriter, TinyClassifier, load_benchmark, rank_records, tiny_trainer
from typing_extensions import override

from lightning_speedkit import trials
from lightning_speedkit.compile.counted import CountedCompile
from lightning_speedkit.dataloader.counted import LoaderTrials
from lightning_speedkit.decisions import CUT_AFTER
from lightning_speedkit.trials import AsIs, Decision, Lever, Setting
from lightning_speedkit.trials.counted import COUNTED_ROUNDS, DROP_AFTER, EXTRA_ROUNDS

pytestmark = pytest.mark.usefixtures("one_thread")


class _Delayed(TinyClassifier):
    """TinyClassifier whose training step waits ``delay`` seconds (a setting can make a step slower, not different)."""

    delay = 0.0

    @override
    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        if self.delay:
            time.sleep(self.delay)
        return super().training_step(batch, batch_idx)


class _Slow(Setting):
    """A setting that keeps the math and makes each step 30 ms slower (``delay``; ``rest``: the delay reverted to)."""

    name = "slow"
    changes_math = False
    delay, rest = 0.03, 0.0

    @override
    def apply(self, trainer: L.Trainer) -> None:
        trainer.lightning_module.delay = self.delay  # type: ignore[assignment]

    @override
    def revert(self, trainer: L.Trainer) -> None:
        trainer.lightning_module.delay = self.rest  # type: ignore[assignment]


class _Fast(_Slow):
    """The same setting, with the step's own time: a candidate as fast as the setting in place."""

    name = "fast"
    delay = 0.0


class _TestLever(Lever):
    """A lever over `_Slow` and `_Fast` (counted) or the same pair marked as changing the math (restored)."""

    AREA = "test"
    COUNTED = True

    def __init__(self, probe_steps: int = 4, margin: float = 0.05, counted: bool = True) -> None:
        self.probe_steps, self.margin, self.counted = probe_steps, margin, counted
        self.applied: list[str] = []

    @override
    def plan(self, trainer: L.Trainer, pl_module: L.LightningModule) -> tuple[Setting, Sequence[Setting]] | Decision:
        slow, fast = _Slow(), _Fast()
        if not self.counted:
            slow.changes_math = fast.changes_math = True
        return AsIs(), [slow, fast]

    @override
    def apply(self, trainer: L.Trainer, pl_module: L.LightningModule, decision: Decision) -> None:
        self.applied.append(decision.decision)


class _Record(L.Callback):
    """Records, per optimizer step, the LR, the first sample's first feature and the global step."""

    def __init__(self) -> None:
        self.lrs: list[float] = []
        self.samples: list[float] = []
        self.steps: list[int] = []

    @override
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int) -> None:
        self.lrs.append(trainer.optimizers[0].param_groups[0]["lr"])
        self.samples.append(float(batch[0][0, 0]))
        self.steps.append(trainer.global_step)


class _Scheduled(_Delayed):
    """With a step LR schedule, so the test sees that probing does not move it."""

    @override
    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=7, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def _fit(tmp_path: Path, callbacks: list[L.Callback], epochs: int = 4) -> tuple[_Scheduled, L.Trainer]:
    L.seed_everything(0, verbose=False)
    model = _Scheduled(num_samples=512)
    trainer = tiny_trainer(tmp_path, max_epochs=epochs, callbacks=callbacks, limit_val_batches=0)
    trainer.fit(model)
    return model, trainer


def test_counted_trials_train_the_run_as_it_would_have_been(tmp_path: Path) -> None:
    """Steps, epochs, LR schedule, sample order and final weights equal the run without the probe: nothing restored."""
    plain_model, plain = _fit(tmp_path / "plain", [plain_record := _Record()])
    lever = _TestLever()
    model, trainer = _fit(tmp_path / "probed", [lever, record := _Record()])
    report = lever.report()
    assert (report["probed"], report["counted"], report["source"]) == (True, True, "measured")
    assert (trainer.global_step, trainer.current_epoch) == (plain.global_step, plain.current_epoch)
    assert record.steps == plain_record.steps
    assert record.lrs == plain_record.lrs
    assert record.samples == plain_record.samples
    for a, b in zip(model.state_dict().values(), plain_model.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert lever.applied == [report["decision"]]


def test_a_counted_probe_costs_only_the_slower_blocks_extra_seconds(tmp_path: Path) -> None:
    """The slow setting (30 ms more a step, many times the step) is dropped after its first block.

    The setting in place's second block confirms it (`grossly_slower`); the cost is that block's extra 30 ms a step.
    """
    lever = _TestLever(probe_steps=4)
    _fit(tmp_path, [lever])
    report = lever.report()
    assert report["decision"] in ("as is", "fast")
    assert "slow" in report["dropped"]  # "fast" may be dropped too: as fast as "as is", noise can make it 10% slower
    blocks = [b["setting"] for b in report["blocks"]]
    assert blocks[:4] == ["as is", "slow", "fast", "as is"]
    assert "slow" not in blocks[4:]  # timed in round one only
    assert "slow dropped: its first block's steps mostly over 1.5x" in report["reason"]
    assert report["steps"] == 4 * len(blocks)
    assert 0.03 * (4 - 1) <= report["probe_s"] < report["probe_wall_s"]
    assert report["step_ms"]["slow"] > report["step_ms"]["as is"] + 25


def test_a_grossly_slower_candidates_first_block_ends_after_cut_after_steps(tmp_path: Path) -> None:
    """With blocks of 8 steps, the slow setting's first block ends after its warm-up and `CUT_AFTER` steps (4, not 8).

    Every one of them took far over 1.5x the setting in place's (`cut_short`); the setting in place's second block
    then confirms the drop (`grossly_slower`), so the slow setting costs 3 extra steps of 30 ms, not 7. A loader's
    and compile's probes never cut a block: a worker's first steps wait for it to start; a compile block is one unit.
    """
    lever = _TestLever(probe_steps=8)
    _fit(tmp_path, [lever], epochs=6)
    report = lever.report()
    lengths = [(b["setting"], len(b["step_s"])) for b in report["blocks"]]
    assert lengths[:4] == [("as is", 8), ("slow", 1 + CUT_AFTER), ("fast", 8), ("as is", 8)]
    assert "slow" not in [name for name, _ in lengths[4:]]
    assert "slow dropped: its first block's steps mostly over 1.5x" in report["reason"]
    assert report["steps"] == sum(n for _, n in lengths)
    assert 0.03 * CUT_AFTER <= report["probe_s"] < 0.03 * (8 - 1)
    assert not LoaderTrials.cuts_short
    assert not CountedCompile.cuts_short


def _lever_blocks(trainer: L.Trainer, pl_module: L.LightningModule) -> list[Any]:
    """This rank's `_TestLever` blocks: each setting and its number of steps (written by `RankWriter`)."""
    lever = next(c for c in trainer.callbacks if isinstance(c, _TestLever))  # type: ignore[attr-defined]
    return [[b["setting"], len(b["step_s"])] for b in lever.report()["blocks"]]


@pytest.mark.slow
@pytest.mark.ddp
def test_ddp_ranks_cut_a_grossly_slower_block_at_the_same_step(tmp_path: Path) -> None:
    """2-process DDP (gloo): rank zero's timings decide the cut, so both ranks run the same blocks, as long."""
    L.seed_everything(0, verbose=False)
    model = _Scheduled(num_samples=1024)
    callbacks = [_TestLever(probe_steps=8), RankWriter(tmp_path, _lever_blocks)]
    trainer = tiny_trainer(
        tmp_path, max_epochs=6, callbacks=callbacks, limit_val_batches=0, strategy="ddp_spawn", devices=2
    )
    trainer.fit(model)
    ranks = rank_records(tmp_path)
    assert ranks[0] == ranks[1]
    assert ranks[0][:2] == [["as is", 8], ["slow", 1 + CUT_AFTER]]


class _Slower(_Slow):
    """Steps of 35 ms against the setting in place's 25 ms: clearly slower (`clearly_slower`), not grossly."""

    name = "slower"
    delay, rest = 0.035, 0.025


class _SlowerLever(_TestLever):
    @override
    def plan(self, trainer: L.Trainer, pl_module: L.LightningModule) -> tuple[Setting, Sequence[Setting]] | Decision:
        pl_module.delay = 0.025  # type: ignore[assignment]
        return AsIs(), [_Slower()]


def test_a_candidate_clearly_but_not_grossly_slower_runs_drop_after_rounds(tmp_path: Path) -> None:
    """A candidate 1.4x slower is timed in the first `DROP_AFTER` rounds, then dropped (not after one block).

    A load spike can do that much to a block of ten steps; `grossly_slower` needs every step over 1.5x.
    """
    lever = _SlowerLever(probe_steps=4)
    _fit(tmp_path, [lever], epochs=2)
    report = lever.report()
    blocks = [b["setting"] for b in report["blocks"]]
    assert report["decision"] == "as is"
    assert blocks == ["as is", "slower"] * DROP_AFTER
    assert report["dropped"] == ["slower"]
    assert "dropped" not in report["reason"]


def test_a_lever_whose_settings_change_the_math_measures_on_restored_trials(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same lever over settings that change the math decides at fit start, through `measure`, not counted."""
    called: list[bool] = []
    original = trials.lever.Lever.decide

    def spy(self: Lever, trainer: L.Trainer, pl_module: L.LightningModule) -> Decision | None:
        decision = original(self, trainer, pl_module)
        called.append(decision is not None)
        return decision

    monkeypatch.setattr(trials.lever.Lever, "decide", spy)
    lever = _TestLever(counted=False)
    _fit(tmp_path, [lever])
    assert called == [True]
    assert "counted" not in lever.report()


def test_a_run_too_short_for_the_counted_probe_skips_it(tmp_path: Path) -> None:
    """The payback rule holds for counted trials too, at their worst case (`counted_cost`).

    Two candidates, 20-step blocks, 3 rounds: two blocks twice as slow, then one 15% slower (three margins of 5%):
    43 steps a candidate.
    """
    lever = _TestLever(probe_steps=20)
    _fit(tmp_path, [lever], epochs=1)
    report = lever.report()
    assert (report["source"], report["probed"]) == ("skipped", False)
    assert report["reason"].startswith("skipped: the probe (86 steps) cannot pay back in 64 steps left")


class _StopAt(L.Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    @override
    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        trainer.should_stop = trainer.should_stop or trainer.global_step >= self.step


def test_a_run_that_ends_inside_the_counted_window_keeps_the_setting_in_place(tmp_path: Path) -> None:
    """Training stopped during the probe (early stopping, say): the setting in place is kept, and the report says so."""
    lever = _TestLever(probe_steps=10)
    _, trainer = _fit(tmp_path, [lever, _StopAt(5)], epochs=8)
    assert trainer.global_step == 5
    assert lever.report()["source"] == "skipped"
    assert lever.report()["reason"].startswith("training ended before the counted trials did")
    assert trainer.lightning_module.delay == 0.0


def test_a_run_resumed_from_a_checkpoint_written_during_the_counted_trials_probes_again(tmp_path: Path) -> None:
    """A checkpoint written while the counted trials ran holds no decision, and says so: the resumed fit probes again.

    It used to be read as a run without the lever: the resumed fit kept the setting in place for the rest of the run
    ("skipped: resumed from a checkpoint without a ... decision"), where the run it continues would have decided.
    """
    from lightning.pytorch.callbacks import ModelCheckpoint

    checkpoint = ModelCheckpoint(tmp_path / "ckpt", every_n_train_steps=3, save_top_k=-1, filename="{step}")
    L.seed_everything(0, verbose=False)
    first = tiny_trainer(tmp_path / "first", max_epochs=8, limit_val_batches=0, enable_checkpointing=True,
                         callbacks=[_TestLever(probe_steps=10), checkpoint, _StopAt(5)])  # fmt: skip
    first.fit(_Scheduled(num_samples=512))
    saved = torch.load(tmp_path / "ckpt" / "step=3.ckpt", weights_only=False)["callbacks"]
    assert [state for key, state in saved.items() if key.startswith("_TestLever")] == [
        {"decision": None, "deciding": True}
    ]
    L.seed_everything(0, verbose=False)
    lever = _TestLever(probe_steps=10)
    trainer = tiny_trainer(tmp_path / "resumed", max_epochs=8, callbacks=[lever], limit_val_batches=0)
    trainer.fit(_Scheduled(num_samples=512), ckpt_path=tmp_path / "ckpt" / "step=3.ckpt")
    report = lever.report()
    assert (report["source"], report["probed"], report["counted"]) == ("measured", True, True)
    assert lever.applied == [report["decision"]]


class _Active(L.Callback):
    """Records, per training step, which levers' counted trials time it."""

    def __init__(self, levers: Sequence[Lever]) -> None:
        self.levers, self.active = levers, []  # type: ignore[var-annotated]

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self.active.append([i for i, lever in enumerate(self.levers) if lever._counted and lever._counted._active])


def test_two_levers_probe_one_after_the_other_never_in_the_same_steps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The second lever's counted blocks start after the first has decided: neither times the other's switches.

    No round is added here: an added round of the first waits behind the second (the next test), and whether one is
    added depends on the timings of two equal settings.
    """
    monkeypatch.setattr(trials.counted.CountedTrials, "extra_rounds", 0)
    first, second = _TestLever(probe_steps=4), _TestLever(probe_steps=5)
    _fit(tmp_path, [first, second, active := _Active([first, second])])
    assert first.report()["probed"]
    assert second.report()["probed"]
    assert all(len(levers) <= 1 for levers in active.active)
    timed = [levers[0] for levers in active.active if levers]
    assert timed == sorted(timed)  # the first lever's steps, then the second's
    assert 0 in timed
    assert 1 in timed


class _Script:
    """A step clock that returns scripted step times (seconds), in order, and their waits for data (default 0)."""

    def __init__(self, times: Sequence[float], waits: Sequence[float] | None = None) -> None:
        self.times = iter(times)
        self.waits = iter(waits) if waits is not None else None
        self.last_wait = 0.0

    def start(self) -> None:
        pass

    def reset(self) -> None:
        pass

    def stop(self) -> float:
        self.last_wait = next(self.waits) if self.waits is not None else 0.0
        return next(self.times)


class _Broadcast:
    """The one-process stand-in for a Trainer, as counted trials use it: its strategy's broadcast."""

    class strategy:
        @staticmethod
        def broadcast(obj: Any, src: int = 0) -> Any:
            return obj

    fit_loop = IN_EPOCH_LOOP


def _decided(
    times_ms: Sequence[float], monkeypatch: pytest.MonkeyPatch, free: float = 0.0, rounds: int = 3
) -> tuple[Decision, trials.counted.CountedTrials]:
    """A counted probe of ``candidate`` against ``current``, ``rounds`` of blocks of 3 steps, fed ``times_ms``.

    ``free``: the steps the run has free for an extension (`EXTRA_ROUNDS`).
    """
    room = "now" if free >= 6 else None
    monkeypatch.setattr(trials.counted.CountedTrials, "_extension_room", lambda self, trainer: room)
    trainer: Any = _Broadcast()
    counted = trials.counted.CountedTrials(
        AsIs("current"), [AsIs("candidate")], steps=3, margin=0.05, warmup=0, rounds=rounds
    )
    counted._clock = _Script([t / 1000 for t in times_ms])  # type: ignore[assignment]
    decision = None
    while decision is None:
        counted.step_started(trainer)
        decision = counted.step_ended(trainer)
    return decision, counted


def _rounds(*candidate_ms: float) -> list[float]:
    """Blocks of 3 steps: the setting in place at 10 ms a step, then the candidate at each of ``candidate_ms``."""
    times: list[float] = []
    for ms in candidate_ms:
        times += [10.0] * 3 + [ms] * 3
    return times


@pytest.mark.parametrize(
    ("candidate_rounds_ms", "kept", "reason_ends"),
    [
        ((9, 9, 10.5), "current", "but faster in 2 of 3 rounds only: kept current; counted trials"),  # 10%, one lost
        ((9, 9, 9.5), "candidate", "candidate 10.0% faster than current (margin 5%); counted trials"),
        ((5, 5, 12), "candidate", "candidate 50.0% faster than current (margin 5%); counted trials"),  # a large gain
    ],
)
def test_a_small_gain_must_hold_in_every_round(
    candidate_rounds_ms: tuple[float, float, float], kept: str, reason_ends: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Current blocks take 10 ms a step: a gain under 3 margins must win every round, a large one need not.

    No steps are free for an extension here (a probe queued behind needs them).
    """
    decision, _ = _decided(_rounds(*candidate_rounds_ms), monkeypatch)
    assert decision.decision == kept
    assert decision.reason.endswith(reason_ends), decision.reason


@pytest.mark.parametrize(
    ("lost", "kept", "reason_ends"),
    [
        (3, "candidate", "candidate 10.0% faster than current (margin 5%), in 9 of 12 rounds; counted trials"),
        (4, "current", "but faster in 8 of 12 rounds only: kept current; counted trials"),
    ],
)
def test_a_small_gain_in_many_short_rounds_may_lose_a_quarter_of_them(
    lost: int, kept: str, reason_ends: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Twelve rounds (`ChannelsLast`'s probe): a gain under 3 margins is kept when it lost at most 3 (`may_lose`).

    A burst of load on a shared machine can split a few short rounds by itself; winning all twelve would refuse a
    real gain, while losing a third of them is more than bursts explain. No steps are free for an extension here.
    """
    candidate_ms = [10.5] * lost + [9.0] * (12 - lost)  # the lost rounds first: the rule counts, wherever they fall
    decision, counted = _decided(_rounds(*candidate_ms), monkeypatch, rounds=12)
    assert decision.decision == kept
    assert decision.reason.endswith(reason_ends), decision.reason
    assert len(counted.blocks) == 24


@pytest.mark.parametrize(
    ("candidate_rounds_ms", "kept", "reason_ends"),
    [
        (
            (9, 9, 10.5, 9, 9),
            "candidate",
            "10.0% faster than current (margin 5%), in 4 of 5 rounds (2 rounds added: it had lost one)",
        ),
        ((9, 9, 10.5, 10.2), "current", "candidate only 4.0% faster than current (margin 5%): kept current"),
    ],
)
def test_a_small_gain_that_lost_one_round_gets_more_rounds_when_steps_are_free(
    candidate_rounds_ms: tuple[float, ...], kept: str, reason_ends: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Up to `EXTRA_ROUNDS` more rounds: kept when it loses no other; a second lost round ends the extension."""
    decision, counted = _decided(_rounds(*candidate_rounds_ms), monkeypatch, free=math.inf)
    assert decision.decision == kept
    assert reason_ends in decision.reason, decision.reason
    assert len(counted.blocks) == 2 * len(candidate_rounds_ms)
    assert EXTRA_ROUNDS == 2


@pytest.mark.parametrize(
    ("candidate_blocks_ms", "blocks", "dropped"),
    [
        (((20, 20, 11), (10, 10, 10), (10, 10, 10)), 6, []),  # a load spike: one block's median twice as slow
        (((20, 20, 11), (20, 20, 11)), 4, ["candidate"]),  # clearly slower in rounds one and two
        (((20, 20, 20),), 3, ["candidate"]),  # every step 2x current's on both sides: dropped after current's second
    ],
)
def test_a_candidate_is_dropped_after_losing_two_rounds_clearly_or_one_grossly(
    candidate_blocks_ms: tuple[tuple[float, ...], ...], blocks: int, dropped: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """One block twice as slow on the median (a load spike) does not drop a candidate; two rounds clearly slower do.

    So do three in four steps of its first block over 1.5x three in four of the setting in place's blocks around it
    (`grossly_slower`), after one round (`DROP_AFTER` is the rule for the rest).
    """
    times = [t for block in candidate_blocks_ms for t in [10.0] * 3 + list(block)]
    decision, counted = _decided([*times, 10.0, 10.0, 10.0], monkeypatch)
    assert len(counted.blocks) == blocks
    assert decision.extra["dropped"] == dropped
    assert DROP_AFTER == 2


class _AtStep:
    """A Trainer stand-in at batch ``ready`` of an epoch of ``batches``: what `_extension_room` reads."""

    def __init__(self, batches: int, ready: int) -> None:
        self.num_training_batches = batches
        progress = type("Progress", (), {"current": type("Current", (), {"ready": ready})()})()
        self.fit_loop = type("Loop", (), {"epoch_loop": type("Epoch", (), {"batch_progress": progress})()})()


def test_an_added_round_runs_now_only_in_steps_no_probe_queued_behind_needs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Now: in the epoch's steps (or the run's, if fewer) beyond the windows of the probes queued behind; else later.

    A layout probe (started: it queued ahead of the loader's) ends its rounds at step 60 of a 125-batch epoch, with
    the loader's probe (54 steps, which must run in the first epoch) queued behind: 11 steps are free, too few for a
    round of two 10-step blocks now, so it runs after the loader's probe. The loader's own added round must fit in
    the epoch, or none.
    """
    monkeypatch.setattr(trials.counted, "steps_left", lambda trainer: 800.0)
    trainer: Any = _AtStep(batches=125, ready=60)
    layout = trials.counted.CountedTrials(AsIs("nchw"), [AsIs("nhwc")], steps=10, margin=0.03)
    loader = LoaderTrials(AsIs("as built"), [AsIs("1 worker"), AsIs("2 workers")], steps=6, margin=0.05)
    layout.join(trainer)
    layout.blocks.append(("nchw", []))  # started
    loader.join(trainer)
    assert layout._extension_room(trainer) == "later"
    assert loader._extension_room(trainer) == "now"  # nothing behind it: 65 steps left in the epoch
    assert loader._extension_room(_AtStep(batches=125, ready=120)) is None  # bound to the epoch: no "later"
    monkeypatch.setattr(trials.counted, "steps_left", lambda trainer: 60.0)  # the run ends first: nowhere
    assert layout._extension_room(trainer) is None


def test_an_added_round_waits_behind_the_probe_queued_after_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An added round that does not fit now runs after the probe queued behind has decided.

    The second probe was promised the steps, so it runs and decides first; then the first's added round (the setting
    in place, then the candidate), then its decision. The run trains as it would have without either probe.
    """
    first, second = _TestLever(), _OtherLever()
    original = trials.counted.CountedTrials._to_confirm
    asked: list[bool] = []

    def once(self: trials.counted.CountedTrials) -> str | None:
        if self is first._counted and not asked:
            asked.append(True)
            return "fast"
        return None if self is first._counted else original(self)

    monkeypatch.setattr(trials.counted.CountedTrials, "_to_confirm", once)
    # no candidate dropped: "fast" is as fast as "as is", and a loaded machine can make it look clearly slower twice,
    # which would end the first probe before it asks for a round
    monkeypatch.setattr(trials.counted.CountedTrials, "_slower_every_round", lambda self: [])
    monkeypatch.setattr(trials.counted, "grossly_slower", lambda *args: [])  # "slow" too: the window stays full
    plain_model, plain = _fit(tmp_path / "plain", [plain_record := _Record()])
    order = _DecidedOrder(first, second)
    model, trainer = _fit(tmp_path / "probed", [first, second, order, record := _Record()])
    assert order.decided == [second, first]
    blocks = [b["setting"] for b in first.report()["blocks"]]
    assert blocks[-2:] == ["as is", "fast"]
    assert len(blocks) > 6
    assert "(1 round added: it had lost one)" in first.report()["reason"]
    assert (trainer.global_step, record.steps) == (plain.global_step, plain_record.steps)
    assert record.samples == plain_record.samples
    for a, b in zip(model.state_dict().values(), plain_model.state_dict().values(), strict=True):
        assert torch.equal(a, b)


class _OtherLever(_TestLever):
    """A second lever of the same kind, with its own state key."""


class _DecidedOrder(L.Callback):
    """The order in which the given levers' decisions appear, checked after every training step."""

    def __init__(self, *levers: _TestLever) -> None:
        self.levers, self.decided = levers, []  # type: ignore[var-annotated]

    @override
    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        for lever in self.levers:
            if lever not in self.decided and lever.report().get("decision") is not None:
                self.decided.append(lever)


class _FittedLever(_TestLever):
    """`_TestLever` with blocks fitted to the run (``MIN_BLOCK``), as ChannelsLast and FusedOptimizer have."""

    MAX_GAIN = 0.4
    MIN_BLOCK = 10


def test_a_lever_with_min_block_fits_its_blocks_to_the_steps_left(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without ``MIN_BLOCK`` a counted block is ``probe_steps``; with it, the longest the run repays, down to it."""
    trainer = tiny_trainer(tmp_path)
    monkeypatch.setattr(trials, "steps_left", lambda trainer: 400.0)
    assert _TestLever(probe_steps=25).block_steps(trainer, 2) == 25
    assert _FittedLever(probe_steps=25).block_steps(trainer, 2) == 18  # fitted_block(25, 10, 2, 400, 0.4, 3, 0.05)
    monkeypatch.setattr(trials, "steps_left", lambda trainer: 40.0)
    assert _FittedLever(probe_steps=25).block_steps(trainer, 2) == 10  # cannot repay even MIN_BLOCK: the shortest
    assert _FittedLever(probe_steps=6).block_steps(trainer, 2) == 6  # never longer than probe_steps
    monkeypatch.setattr(trials, "steps_left", lambda trainer: math.inf)
    assert _FittedLever(probe_steps=25).block_steps(trainer, 2) == 25


@pytest.mark.slow
def test_replay_benchmark_quick_mode_replays_every_shape_on_recorded_steps(tmp_path: Path, demo_cache: Path) -> None:
    """``benchmarks/probe_replay.py --quick`` records quiet and bursty demo steps and replays every probe shape on them.

    A replayed probe is the shipped `CountedTrials` on recorded step times: each ratio and shape has its share of
    probes that kept the candidate, in [0, 1]; nothing here asserts a speed (the machine is shared).
    """
    benchmark = load_benchmark("probe_replay")
    out = tmp_path / "probe_replay.json"
    result = benchmark.main(["--quick", "--out", str(out), "--cache-dir", str(demo_cache), "--precision", "32-true"])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert set(result["traces"]) == set(result["replays"]) == {"quiet", "bursts"}
    assert [trace["steps"] for trace in result["traces"]["bursts"]] == [300]
    for rows in result["replays"].values():
        assert {(row["ratio"], row["shape"]) for row in rows} == {
            (ratio, f"{block}x{rounds}") for ratio in benchmark.RATIOS for block, rounds in benchmark.SHAPES
        }
        assert all(0.0 <= row["kept_candidate"] <= 1.0 and row["probes"] >= 1 for row in rows)


def test_a_replayed_probe_keeps_a_clearly_faster_candidate_and_refuses_a_slower_one() -> None:
    """The replay drives the shipped probe: on steady recorded steps, 15% faster is kept and 5% slower is not."""
    benchmark = load_benchmark("probe_replay")
    steady = [0.02] * 400
    assert benchmark.replay(steady, 0.85, 6, 12) == (True, 144)
    assert benchmark.replay(steady, 1.05, 6, 12)[0] is False
    assert benchmark.replay(steady, 0.85, 25, 3) == (True, 150)


def test_an_epoch_bound_probe_queues_ahead_of_the_probes_that_can_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    """A loader's probe must run in the first epoch; a layout's or an update's can run later: the loader's goes first.

    It queues behind another epoch-bound probe and behind a probe that has started, not ahead of them, and the steps
    it must leave room for (`queued_steps` with ``bound``) are theirs alone.
    """
    trainer: Any = _AtStep(batches=125, ready=0)
    layout = trials.counted.CountedTrials(AsIs("nchw"), [AsIs("nhwc")], steps=10, margin=0.03)
    update = trials.counted.CountedTrials(AsIs("foreach"), [AsIs("fused")], steps=10, margin=0.03)
    loader = LoaderTrials(AsIs("as built"), [AsIs("batched")], steps=5, margin=0.05)
    other = LoaderTrials(AsIs("as built"), [AsIs("1 worker")], steps=5, margin=0.05)
    layout.join(trainer)
    update.join(trainer)
    assert trials.counted.queued_steps(trainer, bound=True) == 0
    assert trials.counted.queued_steps(trainer) == 2 * 2 * 10 * COUNTED_ROUNDS
    loader.join(trainer)
    other.join(trainer)
    assert trials.counted._QUEUES[trainer] == [loader, other, layout, update]
    assert trials.counted.queued_steps(trainer, bound=True) == 2 * 2 * 5 * COUNTED_ROUNDS
    late = _AtStep(batches=125, ready=0)
    layout.join(late)
    layout.blocks.append(("nchw", []))  # it started before the loader's probe joined: the loader's waits for it
    loader.join(late)
    update.join(late)
    assert trials.counted._QUEUES[late] == [layout, loader, update]


def test_an_epoch_bound_probe_adds_its_round_before_the_probes_that_can_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    """The loader's probe, ahead of an update's 120-step window in a 150-batch epoch, ends its rounds at step 36.

    Its added round (two 6-step blocks) runs now, in the epoch: the update's probe can run after it, past the epoch if
    need be. Another epoch-bound probe behind still holds its steps; and the run must have the steps for all of them.
    """
    monkeypatch.setattr(trials.counted, "steps_left", lambda trainer: 864.0)
    trainer: Any = _AtStep(batches=150, ready=36)
    loader = LoaderTrials(AsIs("as built"), [AsIs("batched")], steps=6, margin=0.05)
    update = trials.counted.CountedTrials(AsIs("foreach"), [AsIs("fused")], steps=20, margin=0.03)
    update.join(trainer)
    loader.join(trainer)
    assert loader._extension_room(trainer) == "now"
    other = LoaderTrials(AsIs("as built"), [AsIs("1 worker")], steps=20, margin=0.05)
    other.join(trainer)  # 120 steps, bound to the epoch: 114 are left in it
    assert loader._extension_room(trainer) is None
    monkeypatch.setattr(trials.counted, "steps_left", lambda trainer: 130.0)
    tight: Any = _AtStep(batches=150, ready=36)
    loader.join(tight)
    update.join(tight)
    assert loader._extension_room(tight) is None  # the run's 130 steps hold the update's window, not both
