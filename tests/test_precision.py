"""PrecisionTuner: the precision is chosen by timing real steps, and a slower or unsound candidate is rejected."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import TinyClassifier, load_benchmark, tiny_trainer
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from typing_extensions import override

from lightning_speedkit import trials
from lightning_speedkit.precision import PrecisionTuner, precision_candidates

BOTH = ["32-true", "bf16-mixed"]


class _Handicapped(TinyClassifier):
    """Slower (a real sleep), non-finite or worse in one precision: what the tuner does with such a candidate."""

    def __init__(self, slow_in: str | None = None, nan_in: str | None = None, worse_in: str | None = None) -> None:
        super().__init__(num_samples=256, batch_size=4)
        self.slow_in, self.nan_in, self.worse_in = slow_in, nan_in, worse_in
        self.autocast_seen: list[bool] = []

    @override
    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        precision = self.trainer.precision
        self.autocast_seen.append(torch.is_autocast_enabled("cpu"))
        if precision == self.slow_in:
            time.sleep(0.05)
        loss = super().training_step(batch, batch_idx)
        if precision == self.worse_in:
            return loss * 3.0
        return loss * float("nan") if precision == self.nan_in else loss

    @override
    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.autocast_seen.append(torch.is_autocast_enabled("cpu"))
        super().validation_step(batch, batch_idx)


def _fit(tmp_path: Path, model: TinyClassifier, tuner: PrecisionTuner, **kwargs: Any) -> Any:
    trainer = tiny_trainer(tmp_path, callbacks=[tuner], limit_val_batches=0, **kwargs)
    trainer.fit(model)
    return trainer


def test_candidates_follow_the_hardware() -> None:
    """bf16 is tried on a CPU only with bf16 instructions; on CUDA fp16 and (where supported) bf16 autocast."""
    assert precision_candidates("cpu", cpu_bf16=True) == BOTH
    assert precision_candidates("cpu", cpu_bf16=False) == ["32-true"]
    assert precision_candidates("cuda", cuda_bf16=False) == ["16-mixed"]


def test_a_faster_candidate_is_installed_and_trains(tmp_path: Path) -> None:
    """When fp32 steps are slower, bf16 autocast wins by more than the margin and the fit then runs under it.

    Seeded: the weights and batches then do not depend on the tests before it. Unseeded, on 2 of 40 seeds under forced
    AVX2 the bf16 block's mean loss of 4 batches of 4 came out over 10% (and 3 standard errors) above fp32's block
    before it, and the loss guard rejected bf16 (its own test:
    `test_a_candidate_with_a_clearly_worse_loss_is_undone_and_rejected`).
    """
    torch.manual_seed(0)
    model = _Handicapped(slow_in="32-true")
    trainer = _fit(tmp_path, model, tuner := PrecisionTuner(candidates=BOTH, probe_steps=4), max_epochs=2)
    report = tuner.report()
    assert report["decision"] == "bf16-mixed", report
    assert report["probed"]
    assert report["probe_s"] > 0
    assert report["step_ms"]["bf16-mixed"] < report["step_ms"]["32-true"]
    assert trainer.precision == "bf16-mixed"
    assert model.autocast_seen[-1] is True


def test_the_precision_kept_is_the_trainers_after_the_fit(tmp_path: Path) -> None:
    """Once bf16 is installed, a `validate` after the fit runs in it too, as under ``Trainer(precision=...)``."""
    torch.manual_seed(0)
    model = _Handicapped(slow_in="32-true")
    tuner = PrecisionTuner(candidates=BOTH, probe_steps=4)
    trainer = tiny_trainer(tmp_path, callbacks=[tuner], max_epochs=2, limit_val_batches=2, num_sanity_val_steps=0)
    trainer.fit(model)
    assert tuner.report()["decision"] == "bf16-mixed"
    model.autocast_seen.clear()
    trainer.validate(model, verbose=False)
    assert trainer.precision == "bf16-mixed"
    assert model.autocast_seen
    assert all(model.autocast_seen)


def test_a_slower_candidate_is_rejected(tmp_path: Path) -> None:
    """An injected slower bf16 loses the measurement: fp32 stays, and the reason says bf16 was not faster."""
    model = _Handicapped(slow_in="bf16-mixed")
    trainer = _fit(tmp_path, model, tuner := PrecisionTuner(candidates=BOTH, probe_steps=4), max_epochs=2)
    assert tuner.report()["decision"] == "32-true"
    assert "not faster" in tuner.report()["reason"]
    assert trainer.precision == "32-true"
    assert model.autocast_seen[-1] is False


def test_a_candidate_with_a_non_finite_loss_is_rejected(tmp_path: Path) -> None:
    """A candidate whose trial loss is NaN is rejected even when it is faster; fp32 stays."""
    model = _Handicapped(slow_in="32-true", nan_in="bf16-mixed")
    trainer = _fit(tmp_path, model, tuner := PrecisionTuner(candidates=BOTH, probe_steps=4), max_epochs=2)
    report = tuner.report()
    assert report["decision"] == "32-true"
    assert report["rejected"] == {"bf16-mixed": "non-finite loss"}
    assert trainer.precision == "32-true"
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_the_probe_steps_train_the_run(tmp_path: Path) -> None:
    """The probe is the fit's first steps in blocks of each precision: no step is thrown away or run twice."""
    model = _Handicapped(slow_in="32-true")
    trainer = _fit(tmp_path, model, tuner := PrecisionTuner(candidates=BOTH, probe_steps=4), max_epochs=2)
    report = tuner.report()
    assert report["counted"], report
    assert report["reason"].endswith("counted trials")
    assert len(model.autocast_seen) == trainer.global_step == 2 * 64  # every step ran once, in one precision
    blocks = report["blocks"]
    assert [b["setting"] for b in blocks[:4]] == ["32-true", "bf16-mixed", "32-true", "bf16-mixed"]
    assert model.autocast_seen[:8] == [False] * 4 + [True] * 4  # each block in its precision, in order


def test_a_candidate_with_a_clearly_worse_loss_is_undone_and_rejected(tmp_path: Path) -> None:
    """A faster candidate whose block's loss is far above the reference block's is rejected, its block undone.

    Its steps did not train the run, so the probe's cost counts all of its time, though its steps ran faster than
    fp32's (before, only their time over fp32's step counted: none).
    """
    model = _Handicapped(slow_in="32-true", worse_in="bf16-mixed")
    trainer = _fit(tmp_path, model, tuner := PrecisionTuner(candidates=BOTH, probe_steps=4), max_epochs=2)
    report = tuner.report()
    assert report["decision"] == "32-true"
    assert "more than 10% worse" in report["rejected"]["bf16-mixed"]
    assert "bf16-mixed rejected" in report["reason"]
    assert [b["setting"] for b in report["blocks"]] == ["32-true", "bf16-mixed"]  # no block after the rejection
    assert trainer.precision == "32-true"
    assert report["probe_s"] >= sum(report["blocks"][1]["step_s"])  # the undone block's time, all of it


def test_a_short_job_skips_the_probe_and_keeps_the_precision(tmp_path: Path) -> None:
    """Tens of steps cannot repay a probe: no trial runs, the Trainer's precision stays and the reason says why."""
    model = _Handicapped(slow_in="32-true")
    _fit(tmp_path, model, tuner := PrecisionTuner(candidates=BOTH, probe_steps=4), max_epochs=1, max_steps=20)
    report = tuner.report()
    assert report["decision"] == "32-true"
    assert not report["probed"]
    assert report["reason"].startswith("skipped: the probe (9 steps) cannot pay back in 20 steps left")
    assert len(model.autocast_seen) == 20  # only the real steps ran


def test_resume_installs_the_decision_without_probing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A resumed fit installs the saved precision and runs no trial."""
    ckpt = ModelCheckpoint(tmp_path / "ckpt", save_top_k=-1, filename="{epoch}")
    first = PrecisionTuner(candidates=BOTH, probe_steps=4)
    trainer = tiny_trainer(
        tmp_path, callbacks=[first, ckpt], limit_val_batches=0, enable_checkpointing=True, max_epochs=2
    )
    trainer.fit(_Handicapped(slow_in="32-true"))
    saved = first.report()
    assert saved["probed"]
    monkeypatch.setattr(trials, "measure", lambda *args, **kwargs: pytest.fail("probed again on resume"))
    resumed_tuner = PrecisionTuner(candidates=BOTH, probe_steps=4)
    resumed = tiny_trainer(tmp_path, callbacks=[resumed_tuner], limit_val_batches=0, max_epochs=2)
    model = _Handicapped(slow_in="32-true")
    resumed.fit(model, ckpt_path=str(tmp_path / "ckpt" / "epoch=0.ckpt"))
    assert resumed_tuner.report()["decision"] == saved["decision"]
    assert resumed_tuner.report()["source"] == "resumed"
    assert resumed.precision == saved["decision"]
    assert set(model.autocast_seen) == {saved["decision"] == "bf16-mixed"}  # no block in the other precision


def test_a_non_autocast_plugin_is_left_alone(tmp_path: Path) -> None:
    """A Trainer built with a true-half precision keeps it: only autocast plugins are swapped."""
    trainer = _fit(tmp_path, TinyClassifier(), tuner := PrecisionTuner(), precision="bf16-true")
    assert trainer.precision == "bf16-true"
    assert "not an autocast plugin" in tuner.report()["reason"]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"candidates": []}, "`candidates`"),
        ({"candidates": ["16-true"]}, "`candidates`"),
        ({"candidates": "bf16-mixed"}, "`candidates`"),
        ({"probe_steps": 1}, "`probe_steps`"),
        ({"margin": 1.0}, "`margin`"),
        ({"margin": -0.1}, "`margin`"),
        ({"loss_tolerance": -1}, "`loss_tolerance`"),
    ],
)
def test_bad_arguments_are_refused(kwargs: dict[str, Any], match: str) -> None:
    """Each bad argument gets a ValueError that names it."""
    with pytest.raises(ValueError, match=match):
        PrecisionTuner(**kwargs)


def test_benchmark_quick_mode_records_the_cpu_and_both_precisions(tmp_path: Path, demo_cache: Path) -> None:
    """``benchmarks/precision.py --quick`` times both precisions per step and end to end and records the CPU's flags."""
    benchmark = load_benchmark("precision")
    result = benchmark.main(["--quick", "--out", str(tmp_path / "precision.json"), "--cache-dir", str(demo_cache)])
    assert json.loads((tmp_path / "precision.json").read_text()) == result
    assert {row["layout"] for row in result["per_step"]} == {"NCHW", "NHWC"}
    assert all(row["fp32_ms"] > 0 and row["bf16_ms"] > 0 for row in result["per_step"])
    assert {row["run"] for row in result["end_to_end"]} == {"32-true", "bf16-mixed", "PrecisionTuner"}
    assert "bf16_instructions" in result["cpu"]


def test_fp16_asked_for_on_a_cpu_is_refused_before_any_step(tmp_path: Path) -> None:
    """``candidates=["16-mixed"]`` on a CPU (Lightning would quietly run bf16) is a ValueError naming `candidates`."""
    model = TinyClassifier()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"`candidates` must not hold '16-mixed' on CPU.*got \['16-mixed'\]"):
        tiny_trainer(tmp_path, callbacks=[PrecisionTuner(candidates=["16-mixed"])]).fit(model)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


class _ValidationPrecision(Callback):
    """At each validation batch: whether the tuner had decided yet, and the precision the step runs in."""

    def __init__(self, tuner: PrecisionTuner) -> None:
        self.tuner, self.seen = tuner, list[tuple[bool, str]]()

    @override
    def on_validation_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int, *args: Any) -> None:
        self.seen.append((self.tuner.decision is not None, str(trainer.precision)))


def test_a_validation_inside_a_candidates_block_runs_in_the_runs_precision(tmp_path: Path) -> None:
    """Validations that fall inside a bf16 block of the probe run in fp32, the precision the run has while it probes.

    They ran in the candidate's: a monitored checkpoint could be chosen on a metric of a precision later rejected
    (after the decision, here bf16, validations run in it, as under ``Trainer(precision=...)``).
    """
    torch.manual_seed(0)
    model, tuner = _Handicapped(slow_in="32-true"), PrecisionTuner(candidates=BOTH, probe_steps=4)
    watch = _ValidationPrecision(tuner)
    options: dict[str, Any] = {"val_check_interval": 2, "limit_val_batches": 1, "num_sanity_val_steps": 0}
    tiny_trainer(tmp_path, callbacks=[tuner, watch], max_epochs=2, **options).fit(model)
    report = tuner.report()
    assert report["decision"] == "bf16-mixed", report
    assert any(block["setting"] == "bf16-mixed" for block in report["blocks"])
    probing = [precision for decided, precision in watch.seen if not decided]
    assert len(probing) >= 4  # validations fell among the probe's blocks, bf16 ones included
    assert set(probing) == {"32-true"}


class _NanAt(TinyClassifier):
    """A NaN loss at one global step (here inside the probe's first bf16 block)."""

    def __init__(self, step: int) -> None:
        super().__init__(num_samples=256, batch_size=4)
        self.step = step

    @override
    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        return loss * float("nan") if self.trainer.global_step == self.step else loss


def test_a_guard_rollback_inside_a_candidates_block_stands(tmp_path: Path) -> None:
    """A NaN in a bf16 block: the guard rolls back and halves the LR, and the block's rejection does not undo that.

    The rejected block put back the copy it took at its start: the weights of before the rollback, the LR unhalved.
    """
    from lightning_speedkit import TrainingGuard

    torch.manual_seed(0)
    model, tuner = _NanAt(step=6), PrecisionTuner(candidates=BOTH, probe_steps=4)
    guard = TrainingGuard(every_n_steps=2, backoff=0.5)
    trainer = tiny_trainer(tmp_path, callbacks=[tuner, guard], max_epochs=2, limit_val_batches=0)
    trainer.fit(model)
    assert [event["trigger"] for event in guard.report()["events"]] == ["non-finite loss"]
    assert tuner.report()["rejected"] == {"bf16-mixed": "non-finite loss"}
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.5 * model.lr)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_a_rejected_block_is_undone_in_the_weight_average_too(tmp_path: Path) -> None:
    """A bf16 block rejected (a NaN loss) puts its start's weights back, and the `WeightAverage` starts again there.

    Nothing told the average, which had taken in every step of the undone block: it ended the fit not finite (a
    block merely worse leaves it ahead of the weights the run trained, for its whole time constant).
    """
    from lightning_speedkit import WeightAverage

    torch.manual_seed(0)
    model, tuner = _NanAt(step=6), PrecisionTuner(candidates=BOTH, probe_steps=4)
    average = WeightAverage(decay=0.9)
    trainer = tiny_trainer(tmp_path, callbacks=[tuner, average], max_epochs=2, limit_val_batches=0)
    trainer.fit(model)
    assert tuner.report()["rejected"] == {"bf16-mixed": "non-finite loss"}
    assert average.report()["restarts"] == ["rolled back to step 4"]  # the bf16 block's first step
    assert all(torch.isfinite(p).all() for p in model.parameters())  # the average, put in at the fit's end


class _FailsInBf16(TinyClassifier):
    """Raises in its first bf16 step when asked to: a fit an exception ends inside the probe's candidate block."""

    def __init__(self, fail: bool) -> None:
        super().__init__(num_samples=256, batch_size=4)
        self.fail, self.precisions = fail, list[str]()

    @override
    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.precisions.append(str(self.trainer.precision))
        if self.fail and self.trainer.precision == "bf16-mixed":
            raise RuntimeError("the run broke inside a bf16 block")
        return super().training_step(batch, batch_idx)


def test_a_tuner_reused_after_a_fit_that_broke_mid_probe_starts_afresh(tmp_path: Path) -> None:
    """The next fit of the same tuner trains in its Trainer's precision: the broken fit's probe is not continued.

    Its counted trials were kept, and the next fit (too short to probe) trained its first steps in their bf16 blocks.
    """
    tuner = PrecisionTuner(candidates=BOTH, probe_steps=4)
    with pytest.raises(RuntimeError, match="inside a bf16 block"):
        tiny_trainer(tmp_path, callbacks=[tuner], max_epochs=8, limit_val_batches=0).fit(_FailsInBf16(fail=True))
    model = _FailsInBf16(fail=False)
    tiny_trainer(tmp_path / "again", callbacks=[tuner], max_epochs=1, limit_val_batches=0).fit(model)
    assert tuner.report()["decision"] == "32-true"
    assert set(model.precisions) == {"32-true"}
