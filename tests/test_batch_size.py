from __future__ import annotations

import csv
import json
import math
import pickle
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from conftest import RankWriter, TinyClassifier, callback_of, load_benchmark, rank_records, tiny_trainer
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_speedkit.batch_size import (
    BatchSizeFinder,
    apply_margin,
    choose_batch_size,
    hold_global_batch,
    lr_scale_factor,
    next_trial_size,
)
from lightning_speedkit.oom import MemoryLimit
from lightning_speedkit.trials import TrialSession
from lightning_speedkit.warmup import WarmupScheduler

SAMPLES = 256  # per epoch; TinyClassifier's configured batch is 8
BASE_LR = 0.1


def simulate(mode: str, init_val: int, cap: int, true_max: int) -> list[int]:
    """The sizes `next_trial_size` tries against a device where sizes up to `true_max` fit."""
    results: dict[int, bool] = {}
    while (size := next_trial_size(mode, results, init_val, cap)) is not None:
        assert 1 <= size <= cap
        assert size not in results
        results[size] = size <= true_max
    return list(results)


class ScheduledClassifier(TinyClassifier):
    """TinyClassifier with a StepLR scheduler stepping every optimizer step."""

    @override
    def configure_optimizers(self) -> Any:
        """SGD with momentum plus StepLR(2, 0.5)."""
        opt = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)}}


class Unshuffled(ScheduledClassifier):
    """Training data in a fixed order, so a resumed run can match an uninterrupted one exactly."""

    @override
    def train_dataloader(self) -> DataLoader[Any]:
        """The same batches every epoch."""
        return DataLoader(self._data(0), batch_size=self.batch_size)


class BackwardLimited(ScheduledClassifier):
    """Runs out of memory in backward (not forward) on rank r when the batch exceeds `backward_limits[r]`."""

    def __init__(self, backward_limits: list[int], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.backward_limits = backward_limits

    @override
    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        """The step, with a gradient hook that plays the allocator."""
        loss = super().training_step(batch, batch_idx)
        checker, size = MemoryLimit(self.backward_limits), len(batch[0])
        loss.register_hook(lambda grad: checker.check(size, training=True) or grad)
        return loss


def limited(
    limit: int | list[int] | None = None, eval_limit: int | None = None, shuffle: bool = True, **kwargs: Any
) -> TinyClassifier:
    """A seeded ScheduledClassifier on SAMPLES samples, with an injected memory limit when one is given."""
    L.seed_everything(0, verbose=False)
    model = (ScheduledClassifier if shuffle else Unshuffled)(num_samples=SAMPLES, **kwargs)
    if limit is not None:
        MemoryLimit(limit, eval_limit).attach(model)
    return model


def fit(tmp_path: Path, model: L.LightningModule, *callbacks: Callback, **kwargs: Any) -> L.Trainer:
    """Fit on a quiet CPU Trainer (one epoch unless told otherwise)."""
    ckpt_path = kwargs.pop("ckpt_path", None)
    trainer = tiny_trainer(tmp_path, callbacks=list(callbacks), **kwargs)
    trainer.fit(model, ckpt_path=ckpt_path)
    return trainer


class FirstStepLRs(Callback):
    """Records, at the first training batch, each group's lr and initial_lr and the scheduler's base_lrs."""

    def __init__(self) -> None:
        self.seen: dict[str, list[float]] = {}

    @override
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        """Record once."""
        if not self.seen:
            groups = trainer.optimizers[0].param_groups
            self.seen = {
                "lr": [g["lr"] for g in groups],
                "initial_lr": [g["initial_lr"] for g in groups],
                "base_lrs": list(trainer.lr_scheduler_configs[0].scheduler.base_lrs),  # type: ignore[attr-defined]
            }


def rank_report(trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
    """Each rank's batch size, accumulation, LR and BatchSizeFinder decision (written by `RankWriter`)."""
    return {
        "batch_size": pl_module.batch_size,
        "accumulate": trainer.accumulate_grad_batches,
        "base_lr": trainer.lr_scheduler_configs[0].scheduler.base_lrs[0],  # type: ignore[attr-defined]
        "decision": callback_of(trainer, BatchSizeFinder).report(),
    }


# ---------------------------------------------------------------- the pure search maths


@pytest.mark.parametrize(
    ("mode", "init_val", "cap", "true_max", "expected"),
    [
        ("binsearch", 8, 1000, 70, [8, 16, 32, 64, 128, 96, 80, 72, 68, 70, 71]),
        ("power", 8, 1000, 70, [8, 16, 32, 64, 128]),
        ("power", 2, 100, 10**6, [2, 4, 8, 16, 32, 64, 100]),  # max_val=100 is tried, never 128
        ("binsearch", 32, 300, 10**6, [32, 64, 128, 256, 300]),  # the dataset length caps the search
        ("power", 300, 1000, 100, [300, 150, 75]),  # init_val too big: halve until a size fits
        ("binsearch", 300, 1000, 100, [300, 150, 75, 112, 93, 102, 97, 99, 100, 101]),
        ("binsearch", 1, 50, 0, [1]),  # nothing fits
        ("binsearch", 4, 4, 10, [4]),
    ],
)
def test_trial_sequence_table(mode: str, init_val: int, cap: int, true_max: int, expected: list[int]) -> None:
    """Doubling, capping at (not past) the cap, halving after an early failure, then bisecting in binsearch."""
    assert simulate(mode, init_val, cap, true_max) == expected


@pytest.mark.parametrize(
    ("results", "margin", "throughputs", "expected"),
    [
        ({64: True, 100: True, 101: False}, 0.1, None, 90),
        ({64: True, 128: False}, 0.1, None, 57),  # power mode gets the margin too
        ({64: True, 100: True}, 0.1, None, 100),  # a cap reached without OOM is not reduced
        ({64: True, 100: True, 101: False}, 0.0, None, 100),
        ({1: True, 2: False}, 0.5, None, 1),
        ({4: False}, 0.1, None, None),
        ({8: True, 16: True, 32: True}, 0.1, {8: 100.0, 16: 140.0, 32: 143.0}, 16),
        ({8: True, 16: True, 32: False}, 0.1, {8: 10.0, 16: 20.0}, 14),  # fastest fit, but margin from the OOM
    ],
)
def test_choose_batch_size_table(
    results: dict[int, bool], margin: float, throughputs: dict[int, float] | None, expected: int | None
) -> None:
    """The largest fit (or the smallest fast-enough size), less the margin whenever an OOM bounded it."""
    assert choose_batch_size(results, margin, throughputs).size == expected


@pytest.mark.parametrize(("size", "margin", "expected"), [(100, 0.1, 90), (10, 0.1, 9), (3, 0.5, 1), (1, 0.9, 1)])
def test_apply_margin_table(size: int, margin: float, expected: int) -> None:
    """The margin rounds down and never goes below 1."""
    assert apply_margin(size, margin) == expected


@pytest.mark.parametrize(
    ("global_batch", "reference", "rule", "expected"),
    [(64, 8, "linear", 8.0), (64, 16, "sqrt", 2.0), (64, 8, "none", 1.0), (4, 8, "linear", 0.5)],
)
def test_lr_scale_factor_table(global_batch: int, reference: int, rule: str, expected: float) -> None:
    """Linear, square-root or no scaling by the ratio of global batches."""
    assert lr_scale_factor(global_batch, reference, rule) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((8, 8, "cubic"), "`rule` must be one of 'linear', 'none', 'sqrt', got 'cubic'"),
        ((0, 8, "linear"), "`global_batch` must be a positive int, got 0"),
        ((8, 2.5, "linear"), "`reference_batch` must be a positive int, got 2.5"),
    ],
)
def test_lr_scale_factor_rejects_bad_arguments(args: tuple[Any, ...], match: str) -> None:
    """An unknown rule or a batch that is not a positive int is refused, naming the parameter and the value."""
    with pytest.raises(ValueError, match=match):
        lr_scale_factor(*args)


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((0, 8, 1), "`global_batch` must be a positive int, got 0"),
        ((64, -1, 1), "`max_per_device` must be a positive int, got -1"),
        ((64, 8, True), "`world_size` must be a positive int, got True"),
    ],
)
def test_hold_global_batch_rejects_bad_arguments(args: tuple[Any, ...], match: str) -> None:
    """A size that is not a positive int is refused, naming the parameter and the value."""
    with pytest.raises(ValueError, match=match):
        hold_global_batch(*args)


@pytest.mark.parametrize(
    ("global_batch", "max_per_device", "world", "expected"),
    [(256, 100, 1, (64, 4)), (64, 18, 1, (16, 4)), (64, 1000, 2, (32, 1)), (250, 40, 1, (25, 10)), (7, 3, 1, (3, 3))],
)
def test_hold_global_batch_table(global_batch: int, max_per_device: int, world: int, expected: tuple[int, int]) -> None:
    """Fewest accumulation steps that fit, preferring an exact split of the global batch."""
    per_device, accumulation = hold_global_batch(global_batch, max_per_device, world)
    assert (per_device, accumulation) == expected
    assert per_device <= max_per_device
    assert per_device * accumulation * world >= global_batch


# ---------------------------------------------------------------- arguments and setup


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"mode": "linear"}, "`mode`"),
        ({"objective": "speed"}, "`objective`"),
        ({"lr_scaling": "cubic"}, "`lr_scaling`"),
        ({"init_val": 0}, "`init_val`"),
        ({"max_val": 2.5}, "`max_val`"),
        ({"reference_batch_size": -1}, "`reference_batch_size`"),
        ({"margin": 1.0}, "`margin`"),
        ({"steps_per_trial": 0}, "`steps_per_trial`"),
        ({"steps_per_trial": 1, "objective": "throughput"}, "`steps_per_trial`"),
        ({"max_trials": 0}, "`max_trials`"),
        ({"throughput_tolerance": 1.5}, "`throughput_tolerance`"),
        ({"batch_arg_name": ""}, "`batch_arg_name`"),
        ({"keep_global_batch": "yes"}, "`keep_global_batch`"),
    ],
)
def test_constructor_rejects_bad_arguments(kwargs: dict[str, Any], match: str) -> None:
    """Each bad argument is named in the error."""
    with pytest.raises(ValueError, match=match):
        BatchSizeFinder(**kwargs)


def test_setup_errors_say_what_to_do(tmp_path: Path) -> None:
    """No attribute, dataloaders passed to fit, and the memory objective on CPU without max_val are refused."""
    with pytest.raises(ValueError, match=r"no `bs`.*pass `batch_arg_name`"):
        fit(tmp_path, limited(), BatchSizeFinder(max_val=64, batch_arg_name="bs"))
    model = limited()
    with pytest.raises(ValueError, match="passed straight to `fit"):
        tiny_trainer(tmp_path, callbacks=[BatchSizeFinder(max_val=64)]).fit(model, model.train_dataloader())
    with pytest.raises(ValueError, match="pass `max_val`"):
        fit(tmp_path, limited(), BatchSizeFinder())


def test_state_key_pickle_and_state_round_trip() -> None:
    """The callback pickles; its decision round-trips through state_dict; an empty state loads as no decision."""
    finder = pickle.loads(pickle.dumps(BatchSizeFinder(max_val=64)))
    assert finder.state_key.startswith("BatchSizeFinder{")
    assert "'max_val': 64" in finder.state_key
    assert finder.state_key != BatchSizeFinder(max_val=32).state_key
    assert finder.state_dict() == {"decision": None}
    finder.load_state_dict({"decision": {"decision": "32", "reason": "found", "batch_size": 32, "lr_scale": 4.0}})
    assert finder.state_dict()["decision"]["batch_size"] == 32
    assert finder.report()["source"] == "resumed"
    finder.load_state_dict({})
    assert finder.report()["batch_size"] == 32  # an empty state keeps what is there


# ---------------------------------------------------------------- honest trials


@pytest.mark.parametrize(("mode", "expected"), [("binsearch", 90), ("power", 57)])
def test_finds_the_limit_less_margin_and_training_does_not_oom(tmp_path: Path, mode: str, expected: int) -> None:
    """Under a 100-sample limit the size is 90 (binsearch) or 57 (power), verified, and a full epoch then runs."""
    model, finder = limited(100), BatchSizeFinder(mode=mode, max_val=1000)
    trainer = fit(tmp_path, model, finder)  # the limit stays attached: any OOM in training would fail the test
    assert model.batch_size == expected
    assert trainer.global_step == math.ceil(SAMPLES / expected)
    trials = finder.report()["trials"]
    assert trials[-1] == {"size": expected, "fits": True, "samples_per_s": trials[-1]["samples_per_s"], "error": ""}
    assert all(t["fits"] == (t["size"] <= 100) for t in trials)


def test_evaluation_memory_is_probed(tmp_path: Path) -> None:
    """When validation needs more memory (room for 50 in eval mode), the size respects it: 45, not 90."""
    model, finder = limited(100, eval_limit=50), BatchSizeFinder(max_val=1000)
    fit(tmp_path, model, finder)
    assert model.batch_size == 45


@pytest.mark.parametrize(("max_val", "expected"), [(100, 100), (10_000, SAMPLES)])
def test_caps_are_tried_and_never_exceeded(tmp_path: Path, max_val: int, expected: int) -> None:
    """Without an OOM the result is max_val or the dataset length, each tried itself (power mode gives 100, not 128)."""
    model, finder = limited(), BatchSizeFinder(mode="power", init_val=2, max_val=max_val)
    fit(tmp_path, model, finder, limit_val_batches=0)
    assert model.batch_size == expected
    assert max(t["size"] for t in finder.report()["trials"]) == expected


def test_dataloader_that_ignores_the_attribute_is_caught(tmp_path: Path) -> None:
    """A train dataloader with a fixed batch size makes the trial fail loudly instead of "succeeding" at batch 2."""

    class FixedBatch(ScheduledClassifier):
        @override
        def train_dataloader(self) -> DataLoader[Any]:
            return DataLoader(self._data(0), batch_size=2)

    L.seed_everything(0, verbose=False)
    with pytest.raises(ValueError, match="yielded a batch of 2 while the batch size was set to 200"):
        fit(tmp_path, FixedBatch(num_samples=SAMPLES), BatchSizeFinder(init_val=200, max_val=1000))


def test_other_errors_are_raised_untouched(tmp_path: Path) -> None:
    """An error that is not an OOM propagates with its own type and message."""

    class Fails(ScheduledClassifier):
        @override
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            if len(batch[0]) > 20:
                raise RuntimeError("shape mismatch in my layer")
            return super().training_step(batch, batch_idx)

    L.seed_everything(0, verbose=False)
    with pytest.raises(RuntimeError, match=r"^shape mismatch in my layer$"):
        fit(tmp_path, Fails(num_samples=SAMPLES), BatchSizeFinder(max_val=1000))


def test_even_batch_one_out_of_memory_is_an_error(tmp_path: Path) -> None:
    """When nothing fits the finder says so instead of training."""
    model = limited()

    def out_of_memory(module: torch.nn.Module, args: Any) -> None:
        raise torch.OutOfMemoryError("out of memory")

    model.register_forward_pre_hook(out_of_memory)
    with pytest.raises(ValueError, match="even a batch of 1 ran out of memory"):
        fit(tmp_path, model, BatchSizeFinder(max_val=64))


@pytest.mark.parametrize(("options", "cap"), [({"val_check_interval": 10}, 25), ({"limit_train_batches": 0.5}, 128)])
def test_the_size_leaves_the_trainers_own_settings_valid(tmp_path: Path, options: dict[str, Any], cap: int) -> None:
    """The size found leaves the Trainer's settings valid: the search took the whole data set, refused by Lightning.

    An epoch of it still holds ``val_check_interval`` batches, and a ``limit_train_batches`` fraction of it one batch.
    """
    finder = BatchSizeFinder(max_val=1000, remember=False)
    trainer = fit(tmp_path, limited(), finder, max_epochs=1, **options)
    assert finder.report()["batch_size"] == cap
    assert trainer.global_step > 0


def test_a_search_stopped_by_max_trials_says_so(tmp_path: Path) -> None:
    """Sizes 64 and 32 out of memory with ``max_trials=2``: the error names the stop, not "make the model smaller"."""
    with pytest.raises(ValueError, match=r"even a batch of 32 ran out .* stopped at `max_trials`=2: raise it"):
        fit(tmp_path, limited(10, batch_size=64), BatchSizeFinder(max_val=1000, max_trials=2))


class OneCycle(TinyClassifier):
    """A ``OneCycleLR`` sized from ``trainer.estimated_stepping_batches`` in ``configure_optimizers``."""

    @override
    def configure_optimizers(self) -> Any:
        """SGD under a one-cycle schedule over the fit's steps, as estimated then."""
        opt = torch.optim.SGD(self.parameters(), lr=self.lr)
        total = int(self.trainer.estimated_stepping_batches)
        cycle = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=self.lr, total_steps=total)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": cycle, "interval": "step"}}


def test_a_schedule_sized_for_the_old_step_count_is_named(tmp_path: Path) -> None:
    """``configure_optimizers`` runs before the search: a OneCycleLR sized for the configured batch's steps.

    A smaller batch (more steps) made torch raise mid-fit at the schedule's end ("Tried to step 9 times"): it is
    refused before a step, naming the cause. A larger batch cut the cycle short, silently: a warning names it.
    """
    L.seed_everything(0, verbose=False)
    shrinks = OneCycle(num_samples=SAMPLES, batch_size=64)
    MemoryLimit(20).attach(shrinks)
    with pytest.raises(
        ValueError, match=r"the fit 15 optimizer steps, but your OneCycleLR was sized for 4 .* at step 5"
    ):
        fit(tmp_path, shrinks, BatchSizeFinder(max_val=1000, remember=False))
    L.seed_everything(0, verbose=False)
    grows = OneCycle(num_samples=SAMPLES, batch_size=8)
    MemoryLimit(64).attach(grows)
    with pytest.warns(UserWarning, match=r"your OneCycleLR was sized for 32 .*: its schedule is cut short"):
        fit(tmp_path, grows, finder := BatchSizeFinder(max_val=1000, remember=False))
    assert finder.report()["batch_size"] > 8


OPTIMIZER_OOM = "CUDA out of memory. Tried to allocate the optimizer's state"


class OptimizerStepLimited(ScheduledClassifier):
    """Runs out of memory in the optimizer step (after the GradScaler's ``unscale_``) when the batch exceeds `limit`."""

    def __init__(self, limit: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.limit, self.size = limit, 0

    @override
    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        """Remember the batch size."""
        self.size = len(batch[0])
        return super().training_step(batch, batch_idx)

    @override
    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Between ``scaler.unscale_`` and ``scaler.update``, as an optimizer allocating its state would."""
        if self.size > self.limit:
            raise torch.OutOfMemoryError(OPTIMIZER_OOM)


def test_oom_between_unscale_and_update_does_not_break_the_next_trial(tmp_path: Path) -> None:
    """An OOM that leaves a real GradScaler mid-step (optimizer marked unscaled) is only an OOM: the search goes on."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    L.seed_everything(0, verbose=False)
    model, finder = OptimizerStepLimited(40, num_samples=SAMPLES), BatchSizeFinder(max_val=1000)
    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))  # 16-mixed's scaler, on the CPU
    trainer = fit(tmp_path, model, finder, plugins=[plugin])  # before the fix: "unscale_() has already been called"
    trials = finder.report()["trials"]
    assert [t["size"] for t in trials if not t["fits"]] == [64, 48, 44, 42, 41]  # each an OOM after unscale_
    assert {t["error"] for t in trials if not t["fits"]} == {OPTIMIZER_OOM}
    assert model.batch_size == 36  # 40 fitted, less the 10% margin
    assert trainer.global_step == math.ceil(SAMPLES / 36)  # and training ran on with the same scaler


def test_search_leaves_no_trace(tmp_path: Path) -> None:
    """A fit with the search ends with exactly the weights of a plain fit at the found size and scaled LR."""
    model, finder = limited(100), BatchSizeFinder(max_val=1000, steps_per_trial=2)
    fit(tmp_path, model, finder, max_epochs=2)
    decision = finder.report()
    assert decision
    L.seed_everything(0, verbose=False)
    reference = ScheduledClassifier(num_samples=SAMPLES, batch_size=decision["batch_size"])
    reference.lr = BASE_LR * decision["lr_scale"]
    fit(tmp_path, reference, max_epochs=2)
    for (name, ours), theirs in zip(model.state_dict().items(), reference.state_dict().values(), strict=True):
        assert torch.equal(ours, theirs), name


# ---------------------------------------------------------------- LR rescale, warmup, accumulation


@pytest.mark.parametrize(("rule", "factor"), [("linear", 90 / 8), ("sqrt", math.sqrt(90 / 8)), ("none", 1.0)])
def test_lr_rescale_reaches_groups_and_schedulers(tmp_path: Path, rule: str, factor: float) -> None:
    """lr, initial_lr and the scheduler's base_lrs all carry the scale, so the scheduler cannot undo it."""
    recorder = FirstStepLRs()
    fit(tmp_path, limited(100), BatchSizeFinder(max_val=1000, lr_scaling=rule), recorder, max_steps=1)
    expected = pytest.approx([BASE_LR * factor])
    assert recorder.seen == {"lr": expected, "initial_lr": expected, "base_lrs": expected}


def test_reference_batch_size_sets_the_scale(tmp_path: Path) -> None:
    """With reference_batch_size=30 (global) and a found size of 90 the LR triples."""
    finder = BatchSizeFinder(max_val=1000, reference_batch_size=30)
    fit(tmp_path, limited(100), finder, max_steps=1)
    assert finder.report()["lr_scale"] == pytest.approx(3.0)


def test_warmup_follows_the_rescale_and_lengthens(tmp_path: Path) -> None:
    """A WarmupScheduler present gets the scaled base LRs and a warmup longer by the LR factor (4 -> 45 steps)."""
    recorder, warmup = FirstStepLRs(), WarmupScheduler(warmup=4, decay="constant", total_steps=100)
    fit(tmp_path, limited(100), warmup, BatchSizeFinder(max_val=1000), recorder, max_steps=1)
    assert warmup.schedule == (math.ceil(4 * 90 / 8), 100, 0)
    assert recorder.seen["base_lrs"] == pytest.approx([BASE_LR * 90 / 8])


def test_keep_global_batch_uses_accumulation_not_lr(tmp_path: Path) -> None:
    """Configured 64 with room for 20: 16 per device x 4 accumulation keeps the global batch; the LR is unchanged."""
    model, recorder = limited(20, batch_size=64), FirstStepLRs()
    trainer = fit(tmp_path, model, BatchSizeFinder(max_val=1000, keep_global_batch=True), recorder, max_steps=2)
    assert (model.batch_size, trainer.accumulate_grad_batches) == (16, 4)
    assert recorder.seen["lr"] == pytest.approx([BASE_LR])


def test_logs_the_decision(tmp_path: Path) -> None:
    """speedkit/batch_size, lr_scale and accumulate_grad_batches reach the Trainer's loggers."""
    logger = CSVLogger(tmp_path, name="logs")
    fit(tmp_path, limited(100), BatchSizeFinder(max_val=1000), logger=logger, max_steps=1)
    rows = list(csv.DictReader((Path(logger.log_dir) / "metrics.csv").read_text().splitlines()))
    row = next(r for r in rows if r.get("speedkit/batch_size"))
    assert float(row["speedkit/batch_size"]) == 90
    assert float(row["speedkit/accumulate_grad_batches"]) == 1
    assert float(row["speedkit/lr_scale"]) == pytest.approx(90 / 8)


def test_throughput_objective_picks_the_smallest_fast_enough_size(tmp_path: Path) -> None:
    """The throughput objective keeps the smallest tried size within the tolerance of the best measured speed."""
    finder = BatchSizeFinder(objective="throughput", max_val=128, throughput_tolerance=0.1)
    fit(tmp_path, limited(), finder, max_steps=1)
    speeds = {t["size"]: t["samples_per_s"] for t in finder.report()["trials"] if t["fits"]}
    assert finder.report()["batch_size"] == min(s for s, v in speeds.items() if v >= 0.9 * max(speeds.values()))


# ---------------------------------------------------------------- resume


@pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`, callbacks used to create the checkpoint")
@pytest.mark.parametrize("keep_global_batch", [False, True])
def test_resume_restores_the_decision_without_searching(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, keep_global_batch: bool
) -> None:
    """fit(ckpt_path=...) re-applies size, LR scale and accumulation, runs no trial, and matches the full run."""
    configured = 64 if keep_global_batch else 8

    def run(ckpt_path: str | None = None) -> tuple[TinyClassifier, L.Trainer]:
        model = limited(20 if keep_global_batch else 100, batch_size=configured, shuffle=False)
        ckpt = ModelCheckpoint(tmp_path / "ckpt", save_top_k=-1, filename="{epoch}")
        finder = BatchSizeFinder(max_val=1000, keep_global_batch=keep_global_batch)
        trainer = fit(tmp_path, model, finder, ckpt, max_epochs=2, enable_checkpointing=True, ckpt_path=ckpt_path)
        return model, trainer

    full, full_trainer = run()
    runs: list[int] = []
    monkeypatch.setattr(TrialSession, "run", lambda self, setting, max_batches=None: runs.append(setting))
    resumed, resumed_trainer = run(str(tmp_path / "ckpt" / "epoch=0.ckpt"))
    assert runs == []
    assert resumed.batch_size == full.batch_size != configured
    assert resumed_trainer.accumulate_grad_batches == full_trainer.accumulate_grad_batches
    assert resumed_trainer.optimizers[0].param_groups[0]["initial_lr"] == pytest.approx(
        full_trainer.optimizers[0].param_groups[0]["initial_lr"]
    )
    for (name, ours), theirs in zip(resumed.state_dict().items(), full.state_dict().values(), strict=True):
        assert torch.equal(ours, theirs), name


def test_a_second_fit_of_the_module_scales_the_lr_from_the_users_batch(tmp_path: Path) -> None:
    """A second fit of the module searches and scales the LR from the user's batch, not the size written over it.

    The found size is written over the module's ``batch_size`` and read back by the next fit, whose optimizer is built
    again from the user's LR: it kept that LR (x1) at 36.
    """
    model = limited(40)
    for _ in range(2):
        finder = BatchSizeFinder(max_val=1000, remember=False)
        trainer = fit(tmp_path, model, finder)
        assert (finder.report()["configured_batch_size"], finder.report()["batch_size"]) == (8, 36)
        assert trainer.optimizers[0].param_groups[0]["initial_lr"] == pytest.approx(BASE_LR * 36 / 8)


def test_a_resumed_fit_keeps_the_accumulation_the_user_asks_for_now(tmp_path: Path) -> None:
    """Without ``keep_global_batch`` the accumulation is the user's: a resume given another keeps it.

    The finder wrote the checkpoint's over it, silently, though it never decides it.
    """
    ckpt = ModelCheckpoint(tmp_path / "ckpt", save_top_k=-1, filename="{epoch}")
    fit(tmp_path, limited(100), BatchSizeFinder(max_val=1000), ckpt, max_epochs=1, enable_checkpointing=True)
    trainer = fit(
        tmp_path,
        limited(100),
        BatchSizeFinder(max_val=1000),
        max_epochs=2,
        accumulate_grad_batches=2,
        ckpt_path=str(tmp_path / "ckpt" / "epoch=0.ckpt"),
    )
    assert trainer.accumulate_grad_batches == 2


# ---------------------------------------------------------------- DDP


@pytest.mark.slow
@pytest.mark.ddp
def test_ddp_spawn_ranks_agree_on_the_smaller_limit(tmp_path: Path) -> None:
    """Rank 0 fits 100 (OOM in forward above), rank 1 fits 60 (OOM in backward above): both train at 54, same LR."""
    L.seed_everything(0, verbose=False)
    model = BackwardLimited(backward_limits=[10**6, 60], num_samples=SAMPLES)
    MemoryLimit([100, 10**6]).attach(model)
    finder = BatchSizeFinder(init_val=128, max_val=1000)
    fit(tmp_path, model, finder, RankWriter(tmp_path, rank_report), strategy="ddp_spawn", devices=2)
    reports = rank_records(tmp_path)
    for report in reports:  # what may differ: timing, and which rank's own OOM message a trial carries
        report["decision"].pop("search_s")
        report["decision"].pop("probe_s")  # the same seconds, each rank's own clock
        report["decision"]["trials"] = [
            (t["size"], t["fits"], t["samples_per_s"]) for t in report["decision"]["trials"]
        ]
    assert reports[0] == reports[1]
    assert reports[0]["batch_size"] == 54
    assert reports[0]["accumulate"] == 1
    assert reports[0]["base_lr"] == pytest.approx(BASE_LR * 54 / 8)
    sizes = [(size, fits) for size, fits, _ in reports[0]["decision"]["trials"]]
    assert sizes == [(128, False), (64, False), (32, True), (48, True), (56, True), (60, True), (62, False),
                     (61, False), (54, True)]  # fmt: skip


@pytest.mark.slow
def test_benchmark_quick_mode_runs(tmp_path: Path) -> None:
    """The benchmark's main() runs in quick mode, writes its JSON, and our finder never leaves an OOM behind."""
    benchmark = load_benchmark("batch_size")
    result = benchmark.main(quick=True, out=tmp_path / "batch_size.json")
    assert json.loads((tmp_path / "batch_size.json").read_text()) == result
    ours = [row for row in result["rows"] if row["finder"] == "speedkit"]
    assert all(row["after_search"] == "ok" and row["found"] <= row["true_max"] for row in ours)
