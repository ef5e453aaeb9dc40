"""ChannelsLast, the callback: a real fit converts conv nets (and only those), checkpoints and DDP keep working."""

from __future__ import annotations

import json
import time
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from conftest import RankWriter, TinyClassifier, load_benchmark, rank_records, tiny_trainer
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from typing_extensions import override

from lightning_speedkit import ChannelsLast, trials
from lightning_speedkit.decisions import weigh_by_rounds
from lightning_speedkit.demo import DemoClassifier
from lightning_speedkit.hardware import cpu_info
from lightning_speedkit.layout import has_convolutions, is_channels_last, nhwc_unsafe_convs
from lightning_speedkit.trials.counted import CONSISTENT


def _images(n: int = 32, size: int = 16, batch_size: int = 8) -> DataLoader[tuple[torch.Tensor, ...]]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(n, 3, size, size, generator=generator)
    y = torch.randint(0, 10, (n,), generator=generator)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size)


def _fit(
    tmp_path: Path, callbacks: list[L.Callback], model: DemoClassifier | None = None, **kwargs: object
) -> tuple[DemoClassifier, L.Trainer]:
    L.seed_everything(0, verbose=False)
    model = model or DemoClassifier(width=16, crop_size=16)
    trainer = tiny_trainer(tmp_path, max_epochs=2, callbacks=callbacks, **kwargs)
    trainer.fit(model, _images(), _images(16))
    return model, trainer


def test_fit_trains_in_channels_last_to_the_same_weights(tmp_path: Path) -> None:
    """A real fit with the callback ends with NHWC weights equal (to float tolerance) to a run without it."""
    plain, _ = _fit(tmp_path / "plain", [])
    fast, trainer = _fit(tmp_path / "fast", [ChannelsLast(measure=False)])
    assert is_channels_last(fast)
    assert not is_channels_last(plain)
    assert trainer.callbacks[0].converted > 0  # type: ignore[attr-defined]
    for (name, a), b in zip(plain.state_dict().items(), fast.state_dict().values(), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-3, atol=1e-4, msg=name)


def test_checkpoint_loads_into_either_layout_and_resume_stays_channels_last(tmp_path: Path) -> None:
    """A checkpoint of an NHWC model loads into a fresh default-layout module; resuming with the callback stays NHWC."""
    model, trainer = _fit(tmp_path, [ChannelsLast(measure=False)])
    path = tmp_path / "last.ckpt"
    trainer.save_checkpoint(path)
    fresh = DemoClassifier(width=16, crop_size=16)
    fresh.load_state_dict(torch.load(path, weights_only=True)["state_dict"])
    assert not is_channels_last(fresh)
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values(), strict=True))
    resumed = DemoClassifier(width=16, crop_size=16)
    tiny_trainer(tmp_path, max_epochs=3, callbacks=[ChannelsLast(measure=False)]).fit(
        resumed, _images(), _images(16), ckpt_path=path
    )
    assert is_channels_last(resumed)


def test_model_without_convolutions_and_disabled_callback_are_left_alone(tmp_path: Path) -> None:
    """A conv-free model keeps even its 4-D parameters; ``enabled=False`` converts nothing even on a conv net."""
    model = TinyClassifier()
    model.positions = nn.Parameter(torch.zeros(1, 2, 4, 4))
    callback = ChannelsLast(measure=False)
    tiny_trainer(tmp_path, max_epochs=1, callbacks=[callback]).fit(model)
    report = callback.report()
    assert (report["status"], report["converted"]) == ("no convolutions at setup", 0)
    assert (report["decision"], report["source"], report["reason"]) == ("default", "skipped", report["status"])
    assert not has_convolutions(model)
    assert not model.positions.is_contiguous(memory_format=torch.channels_last)
    model, _ = _fit(tmp_path, [ChannelsLast(enabled=False)])
    assert not is_channels_last(model)


class _ViewNet(DemoClassifier):
    """LeNet-style flattening with ``view``, which fails on an NHWC activation."""

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = self.model.stem(x)
        return self.model.classifier(features.view(features.size(0), -1)[:, : self.model.classifier.in_features])


def test_a_model_that_fails_channels_last_is_left_in_its_layout(tmp_path: Path) -> None:
    """``view`` on an activation fails NHWC: the check on ``example_input_array`` reverts, warns, and fit runs."""
    L.seed_everything(0, verbose=False)
    model = _ViewNet(width=16, crop_size=16)
    callback = ChannelsLast(measure=False)
    with pytest.warns(UserWarning, match="does not run channels-last"):
        tiny_trainer(tmp_path, max_epochs=1, callbacks=[callback]).fit(model, _images(), _images(16))
    assert not is_channels_last(model)
    assert callback.report()["status"].startswith("reverted: RuntimeError")
    assert callback.converted == 0


def test_a_second_fit_checks_its_own_model_before_any_layout_is_applied(tmp_path: Path) -> None:
    """The callback that put one model in NHWC, fitting a model that fails NHWC next, leaves that one as it is.

    The first fit's "checked" flag survived: the second model, reverted by its own check, was converted anyway and
    its fit died in ``view`` (or, for a layer oneDNN cannot train NHWC, in a corrupted heap).
    """
    callback = ChannelsLast(probe_steps=2)
    _fit(tmp_path / "first", [callback])
    callback._decision = trials.Decision("channels_last", "measured faster", probed=True)  # as a fit may decide
    L.seed_everything(0, verbose=False)
    second = _ViewNet(width=16, crop_size=16)
    with pytest.warns(UserWarning, match="does not run channels-last"):
        tiny_trainer(tmp_path / "second", max_epochs=1, callbacks=[callback]).fit(second, _images(), _images(16))
    assert not is_channels_last(second)
    assert callback.report()["status"].startswith("reverted: RuntimeError")


def test_the_check_keeps_each_submodules_train_or_eval_mode(tmp_path: Path) -> None:
    """Running the example in eval mode for the check leaves a submodule the user froze (eval) frozen."""
    model = DemoClassifier(width=16, crop_size=16)
    model.model.stem[1].eval()  # a frozen BatchNorm
    ChannelsLast(measure=False).setup(tiny_trainer(tmp_path), model, "fit")
    assert is_channels_last(model)
    assert model.training
    assert not model.model.stem[1].training


def test_without_an_example_input_only_verify_false_converts(tmp_path: Path) -> None:
    """No ``example_input_array`` means no check: left alone by default, converted with ``verify=False``."""
    for verify, expected in ((True, False), (False, True)):
        L.seed_everything(0, verbose=False)
        model = DemoClassifier(width=16, crop_size=16)
        model.example_input_array = None
        tiny_trainer(tmp_path, max_epochs=1, callbacks=[ChannelsLast(verify=verify, measure=False)]).fit(
            model, _images()
        )
        assert is_channels_last(model) is expected


class _LateConvs(L.LightningModule):
    """Builds its layers in ``configure_model``, after the callbacks' ``setup``."""

    def __init__(self) -> None:
        super().__init__()
        self.net: nn.Module | None = None

    @override
    def configure_model(self) -> None:
        if self.net is None:
            self.net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 10))

    @override
    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        assert self.net is not None
        return nn.functional.cross_entropy(self.net(batch[0]), batch[1])

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_convolutions_built_in_configure_model_are_reported(tmp_path: Path) -> None:
    """Layers that appear after setup cannot be converted there: fit start says so and how to do it."""
    with pytest.warns(UserWarning, match="configure_model"):
        tiny_trainer(tmp_path, max_epochs=1, callbacks=[ChannelsLast(measure=False)]).fit(_LateConvs(), _images())


def test_resuming_a_default_layout_checkpoint_aligns_the_optimizer_state(tmp_path: Path) -> None:
    """Adam moments saved in NCHW strides get the NHWC weights' strides when a ChannelsLast run resumes from them."""
    _, trainer = _fit(tmp_path, [])
    path = tmp_path / "nchw.ckpt"
    trainer.save_checkpoint(path)
    resumed = DemoClassifier(width=16, crop_size=16)
    resumer = tiny_trainer(tmp_path, max_epochs=3, callbacks=[ChannelsLast(measure=False)])
    resumer.fit(resumed, _images(), _images(16), ckpt_path=path)
    optimizer = resumer.optimizers[0]
    convs = [m.weight for m in resumed.modules() if isinstance(m, nn.Conv2d)]
    assert is_channels_last(resumed)
    assert all(optimizer.state[w]["exp_avg"].stride() == w.stride() for w in convs)


def test_validate_after_fit_keeps_the_report(tmp_path: Path) -> None:
    """A later ``validate`` finds the model converted and keeps fit's count."""
    model, trainer = _fit(tmp_path, [callback := ChannelsLast(measure=False)])
    converted = callback.converted
    trainer.validate(model, _images(16), verbose=False)
    report = callback.report()
    assert (report["status"], report["converted"], report["decision"]) == ("channels_last", converted, "channels_last")
    assert converted > 0


def test_validate_test_and_predict_leave_the_layout_a_fit_did_not_choose(tmp_path: Path) -> None:
    """Outside a fit the layout is the fit's measured decision: none, or the default, leaves the model as it is.

    ``validate``/``test``/``predict`` (every stage but fit) converted every conv net to channels-last, unmeasured,
    and after a fit that kept the default layout (a short run, or NHWC measured slower) too. ``measure=False``
    (convert without timing) still converts.
    """
    L.seed_everything(0, verbose=False)
    model, callback = DemoClassifier(width=16, crop_size=16), ChannelsLast()
    trainer = tiny_trainer(tmp_path / "eval", max_epochs=1, callbacks=[callback], limit_val_batches=2)
    trainer.validate(model, _images(16), verbose=False)
    assert not is_channels_last(model)
    assert callback.report()["status"] == "left as it is: no fit measured it"
    trainer.fit(model, _images(), _images(16))  # a few steps: the probe cannot pay back, the default is kept
    assert callback.report()["decision"] == "default"
    trainer.validate(model, _images(16), verbose=False)  # every stage but fit takes the same branch
    assert not is_channels_last(model)
    assert callback.report()["status"] == "default layout, as the fit decided"
    unmeasured = ChannelsLast(measure=False)
    tiny_trainer(tmp_path / "asked", callbacks=[unmeasured]).validate(model, _images(16), verbose=False)
    assert is_channels_last(model)


def _rank_state(trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
    """Each rank's layout and weights at the end of training (written by `RankWriter`)."""
    weights = [p.detach().flatten().tolist() for p in pl_module.parameters()]
    return {"channels_last": is_channels_last(pl_module), "weights": weights}


@pytest.mark.slow
@pytest.mark.ddp
def test_ddp_with_channels_last_weights_keeps_ranks_in_sync(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """2-process DDP (gloo, bucket views as preset builds them) trains NHWC weights; both ranks end identical.

    The reducer never has to copy a gradient whose strides differ from its bucket view (1x1 convs included).
    """
    strategy = DDPStrategy(start_method="spawn", process_group_backend="gloo", gradient_as_bucket_view=True)
    _fit(tmp_path, [ChannelsLast(measure=False), RankWriter(tmp_path, _rank_state)], strategy=strategy, devices=2)
    ranks = rank_records(tmp_path)
    assert ranks[0]["channels_last"]
    assert ranks[1]["channels_last"]
    for a, b in zip(ranks[0]["weights"], ranks[1]["weights"], strict=True):
        assert a == pytest.approx(b, abs=1e-6)
    assert "Grad strides do not match bucket view strides" not in capfd.readouterr().err


def test_benchmark_quick_mode_compares_both_layouts_in_one_run(tmp_path: Path) -> None:
    """``benchmarks/channels_last.py --quick`` times both layouts, writes its JSON, and converts only the conv net."""
    benchmark = load_benchmark("channels_last")
    result = benchmark.main(["--quick", "--out", str(tmp_path / "channels_last.json")])
    assert json.loads((tmp_path / "channels_last.json").read_text()) == result
    converted = {row["model"]: row["tensors_converted"] for row in result["rows"]}
    assert converted["resnet"] > 0
    assert converted["mlp"] == 0
    assert all(row["nchw_ms"] > 0 and row["nhwc_ms"] > 0 for row in result["rows"])
    decided = {d["model"]: d for d in result["decisions"]}
    assert set(decided) == {"resnet", "flat_head"}
    assert all(d["decision"] in ("channels_last", "default") and d["reason"] for d in decided.values())


# ---------------------------------------------------------------------------------------------------- measured layout
class _SlowerChannelsLast(DemoClassifier):
    """FlatHeadNet with a real, fixed penalty in NHWC (a sleep), so the layout decision is the same on any machine.

    FlatHeadNet itself is slower in NHWC here (``benchmarks/results/channels_last.json``), but by a margin a busy
    machine could hide; this pins the direction the test is about.
    """

    def __init__(self) -> None:
        super().__init__(width=8, crop_size=32, architecture="flat_head")

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if is_channels_last(self):
            time.sleep(0.05)
        return super().forward(x)


def _measured_fit(
    tmp_path: Path, architecture: str, callback: ChannelsLast, steps: int = 500, **kwargs: object
) -> tuple[DemoClassifier, L.Trainer]:
    """A fit of ``steps`` batches of 32 images, long enough (by default) for the layout probe to pay back."""
    L.seed_everything(0, verbose=False)
    if architecture == "slower_nhwc":
        model: DemoClassifier = _SlowerChannelsLast()
    else:
        model = DemoClassifier(width=16 if architecture == "resnet" else 8, crop_size=32, architecture=architecture)
    callbacks = [callback, *kwargs.pop("extra", [])]  # type: ignore[misc]
    trainer = tiny_trainer(tmp_path, max_epochs=1, callbacks=callbacks, limit_val_batches=0, **kwargs)
    trainer.fit(model, _images(32 * steps, size=32, batch_size=32))
    return model, trainer


def test_a_model_nhwc_does_not_speed_up_stays_in_the_default_layout(tmp_path: Path) -> None:
    """A net that is slower in NHWC is timed in both layouts and kept NCHW, with both step times reported."""
    model, _ = _measured_fit(tmp_path, "slower_nhwc", callback := ChannelsLast(probe_steps=4))
    report = callback.report()
    assert report["probed"]
    assert report["decision"] == "default", report
    assert report["step_ms"]["channels_last"] > report["step_ms"]["default"]
    assert not is_channels_last(model)
    assert report["converted"] == 0


def test_the_decision_follows_the_measurement(tmp_path: Path) -> None:
    """On the demo ResNet the layout kept is NHWC exactly when its measured step is at least the margin faster.

    The measured step is the one the decision weighs: the median step of the default layout times NHWC's median
    ratio to it round by round (`decisions.weigh_by_rounds` over the report's counted blocks; the pooled medians in
    ``step_ms`` can put a gain on the other side of the margin). A gain under three margins must also have held in
    every round of the counted blocks (`trials.counted`): a switch refused for a lost round says so, and only such a
    small gain can be refused that way (twelve rounds: it may lose three, `decisions.may_lose`).
    """
    model, _ = _measured_fit(tmp_path, "resnet", callback := ChannelsLast(margin=0.03, probe_steps=4))
    report = callback.report()
    assert report["blocks"], report
    blocks = [(block["setting"], block["step_s"]) for block in report["blocks"]]
    step_s = {name: ms / 1e3 for name, ms in report["step_ms"].items()}
    weighed = weigh_by_rounds(step_s, blocks, "default", warmup=ChannelsLast.WARMUP)
    gain = 1 - weighed["channels_last"] / weighed["default"]
    faster, lost_a_round = gain >= 0.03, "rounds only" in report["reason"]
    assert not lost_a_round or (faster and gain < CONSISTENT * 0.03)
    assert report["decision"] == ("channels_last" if faster and not lost_a_round else "default")
    assert is_channels_last(model) == (report["decision"] == "channels_last")
    assert report["probe_s"] > 0


def test_blocks_shrink_to_what_the_run_can_repay(tmp_path: Path) -> None:
    """A 160-step run cannot repay 12 rounds of 6-step blocks (`probe_steps`): it gets the longest it can, 5."""
    _measured_fit(tmp_path, "resnet", callback := ChannelsLast(), steps=160)
    report = callback.report()
    assert report["probed"], report
    assert report["blocks"]
    assert {len(block["step_s"]) for block in report["blocks"]} == {5}  # fitted_block(6, 4, 2, 160, 0.4, 12, 0.03)


def test_a_short_run_skips_the_probe_and_keeps_the_users_layout(tmp_path: Path) -> None:
    """Tens of steps cannot repay timing both layouts: no probe, the default layout stays, the reason says so."""
    model, _ = _measured_fit(tmp_path, "resnet", callback := ChannelsLast(), steps=40)
    report = callback.report()
    assert not report["probed"]
    assert report["decision"] == "default"
    assert report["reason"].startswith("skipped: the probe (12 steps) cannot pay back in 40 steps left")
    assert not is_channels_last(model)


def test_resume_keeps_the_measured_layout_without_probing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A resumed fit applies the saved decision and runs no trial."""
    _measured_fit(tmp_path / "a", "slower_nhwc", original := ChannelsLast(probe_steps=4), enable_checkpointing=True)
    saved = original.report()["decision"]
    checkpoint = next((tmp_path / "a").rglob("*.ckpt"))
    monkeypatch.setattr(trials, "measure", lambda *args, **kwargs: pytest.fail("probed again on resume"))
    resumed_callback = ChannelsLast(probe_steps=4)
    L.seed_everything(0, verbose=False)
    resumed = _SlowerChannelsLast()
    trainer = tiny_trainer(tmp_path / "b", max_epochs=2, callbacks=[resumed_callback], limit_val_batches=0)
    trainer.fit(resumed, _images(32 * 160, size=32, batch_size=32), ckpt_path=str(checkpoint))
    assert resumed_callback.report()["decision"] == saved
    assert is_channels_last(resumed) == (saved == "channels_last")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"margin": 1.0}, "`margin`"),
        ({"margin": -0.01}, "`margin`"),
        ({"probe_steps": 1}, "`probe_steps`"),
        ({"measure": "yes"}, "`measure`"),
    ],
)
def test_bad_measurement_arguments_are_refused(kwargs: dict[str, object], match: str) -> None:
    """A margin outside [0, 1), fewer than 2 probe steps or a non-bool ``measure`` get a ValueError naming it."""
    with pytest.raises(ValueError, match=match):
        ChannelsLast(**kwargs)  # type: ignore[arg-type]


@pytest.mark.slow
@pytest.mark.ddp
def test_ddp_reverting_to_the_default_layout_keeps_ranks_in_sync(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """2-process DDP: the ranks agree to revert a net slower in NHWC, timed inside the DDP wrapper; both end identical.

    Reverting to NCHW after wrapping rebuilds the wrapper, so the reducer never copies a gradient whose strides differ
    from its bucket view.
    """
    strategy = DDPStrategy(start_method="spawn", process_group_backend="gloo", gradient_as_bucket_view=True)
    _measured_fit(
        tmp_path,
        "flat_head",
        ChannelsLast(probe_steps=4),
        steps=96,
        strategy=strategy,
        devices=2,
        extra=[RankWriter(tmp_path, _rank_state)],
    )
    ranks = rank_records(tmp_path)
    assert ranks[0]["channels_last"] is ranks[1]["channels_last"] is False  # reverted after the DDP wrap
    for a, b in zip(ranks[0]["weights"], ranks[1]["weights"], strict=True):
        assert a == pytest.approx(b, abs=1e-6)
    assert "Grad strides do not match bucket view strides" not in capfd.readouterr().err


def test_the_check_runs_where_the_weights_are_not_where_lightning_says(tmp_path: Path) -> None:
    """The check runs on the weights' device, not on ``module.device``, so a GPU run converts.

    In ``setup`` Lightning 2.6 already reports ``module.device`` as the target (cuda:0 on a GPU) while the weights
    are still on the CPU.
    """

    class CudaAlready(L.Callback):
        def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
            pl_module._device = torch.device("cuda", 0)  # what Lightning reports there on a GPU machine

    model, _ = _fit(tmp_path, [CudaAlready(), callback := ChannelsLast(measure=False)])
    assert callback.report()["status"] == "channels_last"
    assert is_channels_last(model)


class _NarrowShortcut(DemoClassifier):
    """A stem of 4 channels feeding a strided 1x1 convolution: the layer oneDNN's NHWC weight gradient overruns."""

    def __init__(self) -> None:
        super().__init__(width=4, crop_size=16)


@pytest.mark.skipif(not nhwc_unsafe_convs(_NarrowShortcut(), cpu_info()), reason="no x86 AVX2/AVX-512 CPU")
def test_a_model_onednn_cannot_train_channels_last_stays_in_the_default_layout(tmp_path: Path) -> None:
    """A strided 1x1 conv with 4 input channels is never moved to NHWC on a CPU: the report and a warning say why."""
    callback = ChannelsLast(measure=False)
    with pytest.warns(UserWarning, match="oneDNN cannot train"):
        model, _ = _fit(tmp_path, [callback], model=_NarrowShortcut())
    assert not is_channels_last(model)
    report = callback.report()
    assert report["converted"] == 0
    assert "#6035" in report["status"]
    assert "`model.stages.1.shortcut.0`" in report["status"]


class _Order(L.Callback):
    """Records each step's global step, LR and first input value (the sample order)."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, float, float]] = []

    @override
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int) -> None:
        lr = trainer.optimizers[0].param_groups[0]["lr"]
        self.seen.append((trainer.global_step, lr, float(batch[0].flatten()[0])))


def test_counted_layout_trials_leave_the_runs_steps_schedule_and_order_as_they_were(tmp_path: Path) -> None:
    """The layout probe trains on the fit's first steps: step count, epochs, LR and sample order are the plain run's.

    (Weights are compared exactly for a setting that keeps the math bit for bit in ``tests/test_trials_counted.py``;
    NHWC and NCHW sum in another order, and Adam turns that into visibly different weights within a few steps.)
    """
    probed, trainer = _measured_fit(
        tmp_path / "probed", "resnet", callback := ChannelsLast(probe_steps=4), steps=500, extra=[order := _Order()]
    )
    report = callback.report()
    assert (report["probed"], report["counted"], report["steps"]) == (True, True, len(report["blocks"]) * 4)
    assert is_channels_last(probed) is (report["decision"] == "channels_last")
    _, plain = _measured_fit(
        tmp_path / "plain", "resnet", ChannelsLast(enabled=False), steps=500, extra=[plain_order := _Order()]
    )
    assert (trainer.global_step, trainer.current_epoch) == (plain.global_step, plain.current_epoch) == (500, 1)
    assert order.seen == plain_order.seen


@pytest.mark.slow
def test_stability_benchmark_quick_mode_decides_afresh_and_judges_against_the_reference(
    tmp_path: Path, demo_cache: Path
) -> None:
    """``benchmarks/layout_stability.py --quick``: each run probes (nothing remembered), and the verdict counts them."""
    benchmark = load_benchmark("layout_stability")
    out = tmp_path / "layout_stability.json"
    result = benchmark.main(["--quick", "--out", str(out), "--cache-dir", str(demo_cache)])
    assert json.loads(out.read_text()) == result
    assert [run["decision"] in ("channels_last", "default") for run in result["runs"]] == [True, True]
    assert all("counted trials" in run["reason"] for run in result["runs"])
    assert result["reference"]["steps_per_layout"] == 6
    verdict = result["verdict"]
    assert verdict["runs"] == 2
    assert 0 <= verdict["agree"] <= 2
    assert verdict["most_common"] >= 1


class _ViewInTheStep(DemoClassifier):
    """Its forward runs channels-last; its ``training_step`` flattens the features with ``view``, which NHWC breaks."""

    def __init__(self) -> None:
        super().__init__(width=16, crop_size=16)
        self.steps = 0
        self.views = True  # False: ``flatten``, which runs in either layout

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model.stem(x)

    @override
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.steps += 1
        features = self(batch[0])
        flat = features.view(features.size(0), -1) if self.views else features.flatten(1)
        return nn.functional.cross_entropy(
            self.model.classifier(flat[:, : self.model.classifier.in_features]), batch[1]
        )

    @override
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        pass


@pytest.mark.parametrize("measure", [False, True], ids=["unmeasured", "counted_probe"])
def test_a_training_step_that_breaks_channels_last_is_caught_before_the_run_and_trains_as_without_it(
    tmp_path: Path, measure: bool
) -> None:
    """The check on ``example_input_array`` runs forward only: a ``view`` in ``training_step`` crashed the fit.

    At fit start one real step runs channels-last with everything put back afterwards; it fails there and runs in the
    default layout, so the model goes back to the default layout, the callback warns and says why, and the run is the
    run without the callback, weight for weight (the check's steps are not steps of the run).
    """
    plain, layout = _ViewInTheStep(), _ViewInTheStep()
    layout.load_state_dict(plain.state_dict())
    steps = 200 if measure else 8
    callback = ChannelsLast(measure=measure, probe_steps=4)
    for model, callbacks in ((plain, []), (layout, [callback])):
        L.seed_everything(0, verbose=False)
        trainer = tiny_trainer(tmp_path, max_epochs=1, callbacks=callbacks, limit_val_batches=0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(model, _images(8 * steps, batch_size=8))
    assert any("fails channels-last" in str(w.message) for w in caught)
    report = callback.report()
    assert report["decision"] == "default", report
    assert "fails channels-last (RuntimeError: view size" in report["reason"]
    assert not is_channels_last(layout)
    assert layout.steps == plain.steps + 2  # the check's step in each layout (NHWC failed, NCHW ran), put back
    for a, b in zip(plain.parameters(), layout.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def _step_class(views: bool) -> type[_ViewInTheStep]:
    """A class named ``Step`` whose ``training_step`` views the features, or flattens them: one structure, two codes."""
    if views:

        class Step(_ViewInTheStep):
            @override
            def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
                self.views = True
                return super().training_step(batch, batch_idx)

    else:

        class Step(_ViewInTheStep):  # type: ignore[no-redef]
            @override
            def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
                self.views = False
                return super().training_step(batch, batch_idx)

    return Step


def test_an_earlier_fits_channels_last_decision_is_checked_against_this_fits_step(tmp_path: Path) -> None:
    """Three fits, one callback: the first's step runs NHWC, the second's ``view``s its features, the third's runs.

    The models have one class name and one structure: their jobs differ by their steps' code alone (as a notebook's
    edited ``training_step``), which the fingerprint does not hold. An earlier fit's decision held for a fit whose
    step fails channels-last; the default a failed check chose does not hold for a fit whose step runs again.
    """
    callback = ChannelsLast(measure=False)
    decisions = []
    for views in (False, True, False):
        L.seed_everything(0, verbose=False)
        model = _step_class(views)()
        trainer = tiny_trainer(tmp_path, max_epochs=1, callbacks=[callback], limit_val_batches=0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(model, _images(64, batch_size=8))
        decisions.append((callback.report()["decision"], is_channels_last(model)))
    assert decisions == [("channels_last", True), ("default", False), ("channels_last", True)]


def _assert_ddp_ranks_revert_alike(tmp_path: Path, model: DemoClassifier) -> None:
    """A 2-process DDP fit (gloo) of ``model`` under ``ChannelsLast(measure=False)``: both ranks NCHW, identical."""
    strategy = DDPStrategy(  # the model trains its stem and head only
        start_method="spawn", process_group_backend="gloo", gradient_as_bucket_view=True, find_unused_parameters=True
    )
    L.seed_everything(0, verbose=False)
    callbacks = [ChannelsLast(measure=False), RankWriter(tmp_path, _rank_state)]
    trainer = tiny_trainer(
        tmp_path, max_epochs=1, callbacks=callbacks, limit_val_batches=0, strategy=strategy, devices=2
    )
    trainer.fit(model, _images(64, batch_size=8))
    ranks = rank_records(tmp_path)
    assert ranks[0]["channels_last"] is ranks[1]["channels_last"] is False
    for a, b in zip(ranks[0]["weights"], ranks[1]["weights"], strict=True):
        assert a == pytest.approx(b, abs=1e-6)


@pytest.mark.slow
@pytest.mark.ddp
def test_ddp_a_step_that_breaks_channels_last_reverts_on_every_rank_before_training(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """2-process DDP: both ranks' check fails alike, and both go back to NCHW at fit start.

    The wrapper is rebuilt at fit start, outside any step; both ranks train and end with identical weights.
    """
    _assert_ddp_ranks_revert_alike(tmp_path, _ViewInTheStep())
    assert "Grad strides do not match bucket view strides" not in capfd.readouterr().err


class _ViewsInValidation(_ViewInTheStep):
    """Trains with ``flatten`` (either layout); its ``validation_step`` ``view``s the features."""

    def __init__(self) -> None:
        super().__init__()
        self.views = False

    @override
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        features = self(batch[0])
        features.view(features.size(0), -1)


class _StopAtStart(L.Callback):
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        trainer.should_stop = True


class _Broken(_ViewInTheStep):
    """A bug of the user's own in ``training_step``, in any layout."""

    @override
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        raise KeyError("logits")


def test_the_step_check_blames_the_layout_only_for_what_the_layout_breaks(tmp_path: Path) -> None:
    """The check validates only a run that validates, and blames the layout only for what fails in NHWC alone.

    A step that fails in the default layout too keeps NHWC (the run then raises the user's own error, with no word
    about layouts); a stop asked at fit start is kept, not erased by the check's trial.
    """
    quiet = {"max_epochs": 1, "enable_checkpointing": False}
    for limit, layout in ((0, True), (2, False)):  # `validation_step` views: only a run that validates reverts
        callback, model = ChannelsLast(measure=False), _ViewsInValidation()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tiny_trainer(tmp_path, callbacks=[callback], limit_val_batches=limit, **quiet).fit(
                model, _images(32), _images(16)
            )
        assert is_channels_last(model) is layout, callback.report()
    tiny_trainer(tmp_path, callbacks=[callback]).validate(model, _images(16), verbose=False)  # the reverted one
    assert not is_channels_last(model)  # validating after the fit keeps the default layout its steps needed
    callback, broken = ChannelsLast(measure=False), _Broken()
    trainer = tiny_trainer(tmp_path, callbacks=[callback], limit_val_batches=0, **quiet)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(KeyError, match="logits"):
            trainer.fit(broken, _images(32))
    assert not any("fails channels-last" in str(w.message) for w in caught)
    assert is_channels_last(broken)
    stopped, callback = _ViewInTheStep(), ChannelsLast(measure=False)
    trainer = tiny_trainer(tmp_path, callbacks=[_StopAtStart(), callback], limit_val_batches=0, **quiet)
    trainer.fit(stopped, _images(32))
    assert (trainer.global_step, stopped.steps) == (0, 0)


@pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`")
def test_a_resumed_channels_last_decision_reports_the_default_layout_its_failed_check_chose(tmp_path: Path) -> None:
    """A checkpoint of an NHWC run, resumed by a model whose step ``view``s: the report says default, as the layout is.

    A resumed decision was taken as it was: the report and the next checkpoint said NHWC on an NCHW model.
    """
    first = _ViewInTheStep()
    first.views = False
    trainer = tiny_trainer(tmp_path, max_epochs=1, callbacks=[ChannelsLast(measure=False)], limit_val_batches=0)
    trainer.fit(first, _images(32))
    trainer.save_checkpoint(tmp_path / "nhwc.ckpt")
    callback, resumed = ChannelsLast(measure=False), _ViewInTheStep()
    trainer = tiny_trainer(tmp_path, max_epochs=2, callbacks=[callback], limit_val_batches=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(resumed, _images(32), ckpt_path=tmp_path / "nhwc.ckpt")
    assert not is_channels_last(resumed)
    assert callback.report()["decision"] == "default"
    trainer.save_checkpoint(tmp_path / "after.ckpt")
    saved = torch.load(tmp_path / "after.ckpt", weights_only=False)["callbacks"]
    assert [state["decision"]["decision"] for key, state in saved.items() if "ChannelsLast" in key] == ["default"]
    again, callback = _ViewInTheStep(), ChannelsLast(measure=False)  # resuming that checkpoint (it says default)
    trainer = tiny_trainer(tmp_path, max_epochs=3, callbacks=[callback], limit_val_batches=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(again, _images(32), ckpt_path=tmp_path / "after.ckpt")  # crashed: NHWC kept, no check
    assert (trainer.global_step, is_channels_last(again), callback.report()["decision"]) == (12, False, "default")


@pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`")
def test_a_resumed_channels_last_decision_is_checked_on_a_run_too_short_to_probe(tmp_path: Path) -> None:
    """A short resumed run with a step that ``view``s: the resumed NHWC decision is checked too, and reverted.

    Setup, before the checkpoint loads, found that no probe could repay and left NCHW; the resumed NHWC decision then
    put NHWC back unchecked, and the first step crashed.
    """
    first = _ViewInTheStep()
    first.views = False
    trainer = tiny_trainer(tmp_path, max_epochs=1, callbacks=[ChannelsLast(measure=False)], limit_val_batches=0)
    trainer.fit(first, _images(32))
    trainer.save_checkpoint(tmp_path / "nhwc.ckpt")
    callback, resumed = ChannelsLast(probe_steps=4), _ViewInTheStep()  # measured: 8 more steps cannot repay a probe
    checkpoint = torch.load(tmp_path / "nhwc.ckpt", weights_only=False)  # as if that fit had measured NHWC
    states = checkpoint["callbacks"]
    states[callback.state_key] = states.pop(next(key for key in states if "ChannelsLast" in key))
    torch.save(checkpoint, tmp_path / "nhwc.ckpt")
    trainer = tiny_trainer(tmp_path, max_epochs=3, callbacks=[callback], limit_val_batches=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(resumed, _images(32), ckpt_path=tmp_path / "nhwc.ckpt")
    assert (trainer.global_step, is_channels_last(resumed), callback.report()["decision"]) == (12, False, "default")


class _ViewsOnRankOne(_ViewInTheStep):
    """Only rank 1's step ``view``s (as a data-dependent path would): the ranks' checks fail apart."""

    @override
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.views = self.global_rank == 1
        return super().training_step(batch, batch_idx)


class _BrokenOnRankOne(_ViewInTheStep):
    """Only rank 1's step raises, in either layout (a bug on a data-dependent path); rank 0's runs in both."""

    def __init__(self) -> None:
        super().__init__()
        self.views = False

    @override
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.global_rank == 1:
            raise KeyError("logits")
        return super().training_step(batch, batch_idx)


@pytest.mark.slow
@pytest.mark.ddp
def test_ddp_a_step_that_fails_on_one_rank_in_both_layouts_raises_instead_of_hanging(tmp_path: Path) -> None:
    """Rank 1 fails the NCHW trial too: NHWC stays (not the layout's fault) and the run raises the user's error.

    The failed rank answered its peer's sync point only after reverting the trial's layout, whose DDP rebuild runs
    collectives of its own: the two ranks waited in different collectives for ever.
    """
    strategy = DDPStrategy(start_method="spawn", process_group_backend="gloo", find_unused_parameters=True)
    trainer = tiny_trainer(
        tmp_path, callbacks=[ChannelsLast(measure=False)], limit_val_batches=0, strategy=strategy, devices=2
    )
    with pytest.raises(Exception, match="logits"):
        trainer.fit(_BrokenOnRankOne(), _images(64, batch_size=8))


@pytest.mark.slow
@pytest.mark.ddp
def test_ddp_a_check_that_fails_on_one_rank_reverts_every_rank(tmp_path: Path) -> None:
    """2-process DDP: rank 1's step fails NHWC, rank 0's runs; both get one verdict and revert at fit start.

    No rank is left waiting in a collective; both train and end identical.
    """
    _assert_ddp_ranks_revert_alike(tmp_path, _ViewsOnRankOne())
