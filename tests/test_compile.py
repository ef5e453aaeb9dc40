"""Compile: torch.compile kept only when it pays back in the run; failures fall back to eager; checkpoints stay clean.

The decision tests inject step times and compile seconds through ``Compile._trial`` (the trials still run, on the
cheap ``eager`` dynamo backend); the other tests compile for real with inductor.
"""

from __future__ import annotations

import copy
import json
import math
import os
import pickle
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from conftest import (
    ROOT,
    KeyLogger,
    RankWriter,
    TinyClassifier,
    callback_of,
    load_benchmark,
    rank_records,
    tiny_trainer,
)
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_speedkit import Compile, trials
from lightning_speedkit.compile import compile_pays_back, compile_worth_probing
from lightning_speedkit.compile.dynamo import ISA_TAG, tag_compile_cache
from lightning_speedkit.hardware import ISA_ENV


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> None:
    """Dynamo's compiled code is cached per code object across module instances: each test compiles afresh."""
    torch._dynamo.reset()


# ---------------------------------------------------------------------------------------------------- pure rules
@pytest.mark.parametrize(
    ("eager_s", "compiled_s", "compile_s", "left", "margin", "keep", "reason_starts"),
    [
        (0.030, 0.020, 10.0, 5000, 0.1, True, "compiled: 50.0 s saved over 5000 steps left > 11.0 s"),
        (0.030, 0.020, 10.0, 500, 0.1, False, "eager: 5.0 s saved over 500 steps left <= 11.0 s"),
        (0.030, 0.020, 10.0, 1050, 0.1, False, "eager: 10.5 s saved"),  # repays the compile, not the margin
        (0.030, 0.020, 10.0, 1050, 0.0, True, "compiled: 10.5 s saved"),
        (0.030, 0.031, 0.0, 10**9, 0.1, False, "eager: the compiled step is not faster"),
        (0.030, 0.029, 100.0, math.inf, 0.1, True, "compiled: 3.3% faster per step in an unbounded run"),
    ],
)
def test_compile_pays_back_only_when_the_saving_exceeds_the_compile_and_margin(
    eager_s: float, compiled_s: float, compile_s: float, left: float, margin: float, keep: bool, reason_starts: str
) -> None:
    """Compiled iff (eager - compiled) * steps_left > compile_s * (1 + margin); a slower compiled step never wins."""
    decided, reason = compile_pays_back(eager_s, compiled_s, compile_s, left, margin)
    assert decided is keep
    assert reason.startswith(reason_starts), reason


@pytest.mark.parametrize(
    ("eager_s", "left", "min_compile_s", "worth"),
    [(0.010, 200, 2.0, False), (0.010, 2000, 2.0, True), (1.0, 3, 2.0, False), (0.001, math.inf, 60.0, True)],
)
def test_compile_worth_probing_assumes_the_best_case(
    eager_s: float, left: float, min_compile_s: float, worth: bool
) -> None:
    """The probe runs only if steps 50% shorter over the steps left could repay a minimal compile with the margin."""
    assert compile_worth_probing(eager_s, left, min_compile_s)[0] is worth


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [
        ({"mode": "fastest"}, "mode"),
        ({"backend": "no-such-backend"}, "backend"),
        ({"backend": 3}, "backend"),
        ({"margin": 1.0}, "margin"),
        ({"margin": -0.1}, "margin"),
        ({"probe_steps": 1}, "probe_steps"),
        ({"fullgraph": "yes"}, "fullgraph"),
        ({"measure": None}, "measure"),
        ({"dynamic": "auto"}, "dynamic"),
        ({"options": ["trace"]}, "options"),
        ({"mode": "max-autotune", "options": {"trace.enabled": False}}, "options"),
        ({"max_graph_breaks": -1}, "max_graph_breaks"),
        ({"min_compile_s": -1.0}, "min_compile_s"),
    ],
)
def test_bad_arguments_are_refused_naming_them(kwargs: dict[str, Any], argument: str) -> None:
    """Each bad argument is a ValueError whose message names it (backticked) and shows what was given."""
    with pytest.raises(ValueError, match=f"`{argument}`") as caught:
        Compile(**kwargs)
    assert "got" in str(caught.value)


# ---------------------------------------------------------------------------------------------------- helpers
class _Ordered(TinyClassifier):
    """TinyClassifier without shuffling, so a resumed run sees the batches an uninterrupted one sees."""

    @override
    def train_dataloader(self) -> DataLoader[tuple[torch.Tensor, ...]]:
        return DataLoader(self._data(0), batch_size=self.batch_size)


class _GraphBreak(TinyClassifier):
    """A forward with one explicit graph break."""

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.net[1](self.net[0](x))
        torch._dynamo.graph_break()
        return self.net[2](hidden)  # type: ignore[no-any-return]


def _failing_backend(graph: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Any:
    raise RuntimeError("this backend cannot compile anything")


class _Injected(Compile):
    """Real trials, with the step times and the compile seconds they report replaced by fixed values."""

    def __init__(self, eager_ms: float, compiled_ms: float, compile_s: float, **kwargs: Any) -> None:
        super().__init__(backend="eager", **kwargs)
        self.injected = {"eager": eager_ms / 1e3, "compiled": compiled_ms / 1e3}
        self.injected_compile_s = compile_s

    @override
    def _timed(self, result: trials.TrialResult) -> trials.TrialResult:
        result.step_s = [self.injected[result.setting]] * len(result.step_s)
        return result

    @override
    def _conclude(self, report: dict[str, Any], results: Any, compiled: Any, left: float, failed: bool) -> None:
        compiled.compile_s = self.injected_compile_s
        super()._conclude(report, results, compiled, left, failed)


class _StopAfter(L.Callback):
    """Ends the fit after ``steps`` optimizer steps (the budget the callbacks see stays the Trainer's)."""

    def __init__(self, steps: int) -> None:
        self.steps = steps

    @override
    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step >= self.steps:
            trainer.should_stop = True


def _ours(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if str(w.message).startswith("Compile:")]


def _weights(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


# ---------------------------------------------------------------------------------------------------- decisions
@pytest.mark.parametrize(
    ("max_steps", "decision", "reason"),
    [
        (200, "eager", "eager: 4.0 s saved over 200 steps left <= 11.0 s (compile 10.0 s + 10%)"),
        (800, "compiled", "compiled: 16.0 s saved over 800 steps left > 11.0 s (compile 10.0 s + 10%)"),
    ],
)
def test_a_short_budget_stays_eager_and_a_long_one_compiles(
    tmp_path: Path, max_steps: int, decision: str, reason: str
) -> None:
    """Eager 100 ms, compiled 80 ms, compile 10 s (injected): 200 steps cannot repay it, 800 can; the module follows."""
    L.seed_everything(0, verbose=False)
    model, logger = TinyClassifier(), KeyLogger()
    callback = _Injected(eager_ms=100.0, compiled_ms=80.0, compile_s=10.0)
    trainer = tiny_trainer(
        tmp_path, max_epochs=-1, max_steps=max_steps, callbacks=[callback, _StopAfter(30)], logger=logger
    )
    trainer.fit(model)
    report = callback.report()
    assert report["decision"] == decision
    assert report["reason"] == reason
    assert report["probed"]
    assert report["compile_s"] == 10.0
    assert report["step_ms"] == {"eager": pytest.approx(100.0), "compiled": pytest.approx(80.0)}
    assert report["saving_s"] == pytest.approx(0.02 * max_steps)
    assert report["cost_s"] == pytest.approx(11.0)
    assert (model._compiled_call_impl is not None) is (decision == "compiled")
    assert report["status"] == ("compiled" if decision == "compiled" else reason)
    assert {"speedkit/compile/eager_step_ms", "speedkit/compile/compiled_step_ms"} <= logger.keys
    assert {"speedkit/compile/probe_s", "speedkit/compile/compile_s"} <= logger.keys


def test_a_run_too_short_for_the_probe_skips_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """20 steps cannot repay a counted probe's 10 steps at worst: nothing is tried, the module stays eager."""
    monkeypatch.setattr(trials, "TrialSession", lambda *a, **k: pytest.fail("probed a run too short for it"))
    callback = Compile()
    tiny_trainer(tmp_path, max_epochs=-1, max_steps=20, callbacks=[callback]).fit(model := TinyClassifier())
    report = callback.report()
    assert report["decision"] == "eager"
    assert not report["probed"]
    assert report["reason"].startswith("skipped: the probe (10 steps) cannot pay back in 20 steps left")
    assert model._compiled_call_impl is None


def test_when_no_gain_could_repay_a_compile_it_stops_after_one_eager_block(tmp_path: Path) -> None:
    """After one eager block, even 2x faster steps over 200 steps cannot repay a 1000 s compile: nothing compiles."""
    callback = Compile(min_compile_s=1000.0)
    tiny_trainer(tmp_path, max_epochs=-1, max_steps=200, callbacks=[callback, _StopAfter(30)]).fit(
        model := TinyClassifier()
    )
    report = callback.report()
    assert report["decision"] == "eager"
    assert report["probed"]
    assert report["reason"].startswith("skipped: steps 50% faster would save at most")
    assert report["reason"].endswith("less than a 1000.0 s compile + 10%")
    assert set(report["step_ms"]) == {"eager"}
    assert report["compile_s"] is None
    assert model._compiled_call_impl is None


def test_the_probe_steps_train_the_run_so_steps_and_weights_are_those_of_a_fit_without_it(tmp_path: Path) -> None:
    """Counted blocks, nothing restored: 40 optimizer steps, and the weights of the same fit without Compile.

    The ``eager`` backend compiles steps with eager numerics, so the weights agree to float tolerance.
    """

    def fit(callbacks: list[L.Callback]) -> tuple[L.Trainer, torch.nn.Module]:
        L.seed_everything(0, verbose=False)
        callbacks = [*callbacks, _StopAfter(40)]
        trainer = tiny_trainer(tmp_path, max_epochs=-1, max_steps=400, callbacks=callbacks, limit_val_batches=0)
        trainer.fit(model := TinyClassifier())
        return trainer, model

    callback = Compile(backend="eager", min_compile_s=0.0)
    probed, model = fit([callback])
    plain, reference = fit([])
    report = callback.report()
    assert report["probed"], report
    assert report["counted"], report
    assert {block["setting"] for block in report["blocks"]} == {"eager", "compiled"}
    assert probed.global_step == plain.global_step == 40
    for ours, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(ours, theirs)


def test_the_decision_follows_the_measurement_in_a_real_fit(tmp_path: Path) -> None:
    """Inductor, timed for real: the decision is what `compile_pays_back` says of the reported times, and sticks."""
    L.seed_everything(0, verbose=False)
    callback = Compile(min_compile_s=0.0)
    trainer = tiny_trainer(tmp_path, max_epochs=-1, max_steps=100_000, callbacks=[callback, _StopAfter(30)])
    trainer.fit(model := TinyClassifier())
    report = callback.report()
    assert report["probed"]
    assert report["compile_s"] > 0
    assert report["graphs"] >= 1  # the training graph (the validation graph compiles at the first validation)
    eager_s, compiled_s = report["step_ms"]["eager"] / 1e3, report["step_ms"]["compiled"] / 1e3
    keep, reason = compile_pays_back(eager_s, compiled_s, report["compile_s"], report["steps_left"], 0.1)
    assert report["decision"] == ("compiled" if keep else "eager")
    assert report["reason"] == reason
    assert (model._compiled_call_impl is not None) is keep


def _triples_the_output(graph: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Any:
    """A backend whose graph returns three times what the module computes: fast, and wrong."""

    def run(*args: Any) -> Any:
        out = graph.forward(*args)
        return tuple(o * 3 for o in out) if isinstance(out, (tuple, list)) else out * 3

    return run


class _Regression(TinyClassifier):
    """A mean-squared-error fit of one output on TinyClassifier's data, whose loss tells a scaled output at once."""

    @override
    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self(x)[:, 0], y.float())


@pytest.mark.parametrize("seed", [0, 1])
def test_a_compiled_module_that_computes_something_else_stays_eager(tmp_path: Path, seed: int) -> None:
    """A backend whose graph returns 3x the output: its first block's loss is far above eager's, and it is refused.

    An allowance for the blocks' batch noise (three standard errors over 4-step blocks) let it through on every seed
    tried; an identical module refused on noisy small batches only stays eager, as without the lever.
    """
    torch.manual_seed(seed)
    callback = Compile(backend=_triples_the_output, min_compile_s=0.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tiny_trainer(tmp_path, max_epochs=-1, max_steps=2000, callbacks=[callback, _StopAfter(30)]).fit(_Regression())
    report = callback.report()
    assert report["decision"] == "eager", report["reason"]
    assert report["reason"].startswith("eager: the compiled loss differs (mean loss ")
    assert any("trains differently" in w for w in _ours(caught))


def _nan_after(calls: int) -> Callable[..., Any]:
    """A backend whose graph's output turns NaN after ``calls`` calls (0: from the first)."""
    made = [0]

    def backend(graph: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Any:
        def run(*args: Any) -> Any:
            made[0] += 1
            out = graph.forward(*args)
            scale = 1.0 if made[0] <= calls else float("nan")
            return tuple(o * scale for o in out) if isinstance(out, (tuple, list)) else out * scale

        return run

    return backend


@pytest.mark.parametrize(
    ("calls", "measure", "reason"),
    [
        (0, True, "eager: the compiled loss differs (non-finite loss) (its steps undone, back to step 4)"),
        (8, True, "eager: a compiled block's loss was not finite (its steps undone, back to step 12)"),
        (0, False, "eager: the compiled loss differs (non-finite loss)"),
    ],
)
def test_a_compiled_module_whose_loss_breaks_stays_eager_on_finite_weights(
    tmp_path: Path, calls: int, measure: bool, reason: str
) -> None:
    """A NaN in a compiled block (the first, a later one, or ``measure=False``'s trial): eager, the block undone.

    The probe's blocks train the run, so the NaN steps were kept: "training goes on eager" went on with NaN weights;
    a NaN after the first compiled block was not even looked at, and ``measure=False`` checked no loss at all.
    """
    torch.manual_seed(0)
    callback = Compile(backend=_nan_after(calls), min_compile_s=0.0, measure=measure)
    model = TinyClassifier()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tiny_trainer(tmp_path, max_epochs=-1, max_steps=2000, callbacks=[callback, _StopAfter(40)]).fit(model)
    assert callback.report()["reason"] == reason
    assert any("training goes on eager" in w for w in _ours(caught))
    assert all(torch.isfinite(p).all() for p in model.parameters())


class _ExponentialLR(TinyClassifier):
    @override
    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        scheduler = torch.optim.lr_scheduler.ExponentialLR(optimizer, 0.99)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def test_an_undone_block_keeps_the_lr_the_schedule_reached(tmp_path: Path) -> None:
    """The undo puts back the weights and moments of the block's start, not its LR: the step count goes on.

    Put back with the optimizer's state, the block's first LR went on under ``ExponentialLR`` (which steps from the
    current LR): 4% above the schedule's for the rest of the run.
    """
    torch.manual_seed(0)
    callback = Compile(backend=_nan_after(3), min_compile_s=0.0)  # NaN at the first compiled block's last step
    trainer = tiny_trainer(tmp_path, max_epochs=-1, max_steps=200, callbacks=[callback], limit_val_batches=0)
    trainer.fit(_ExponentialLR(num_samples=512))
    assert callback.report()["reason"].endswith("(its steps undone, back to step 4)")
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.1 * 0.99**200)


# ---------------------------------------------------------------------------------------------------- real compiles
def test_a_compiled_fit_trains_with_clean_keys_and_few_recompiles(tmp_path: Path) -> None:
    """measure=False compiles (inductor) and trains; a partial last batch and a batch-size change recompile once.

    70 samples in batches of 8 (last 6), then of 12 (last 10) from epoch 2: four training shapes over five epochs,
    yet each graph is recompiled at most once (automatic dynamic shapes), not at every step.
    """

    class _Resize(L.Callback):
        @override
        def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            if trainer.current_epoch == 2:
                pl_module.batch_size = 12  # type: ignore[assignment]

    L.seed_everything(0, verbose=False)
    model = TinyClassifier(num_samples=70)
    before = _weights(model)
    callback = Compile(measure=False)
    tiny_trainer(tmp_path, max_epochs=5, callbacks=[callback, _Resize()], reload_dataloaders_every_n_epochs=1).fit(
        model
    )
    report = callback.report()
    assert report["status"] == "compiled"
    assert report["decision"] == "compiled"
    assert report["compile_s"] > 0
    assert report["graph_breaks"] == 0
    assert 1 <= report["recompiles"] <= 3, report
    assert model._compiled_call_impl is not None
    assert not any("_orig_mod" in key for key in model.state_dict())
    assert any(not torch.equal(a, b) for a, b in zip(before, _weights(model), strict=True))
    eager_copy = copy.deepcopy(model)  # a copy is eager: the compiled function belongs to the original
    assert eager_copy._compiled_call_impl is None
    assert pickle.loads(pickle.dumps(model))._compiled_call_impl is None
    x = torch.randn(5, 16)
    with torch.no_grad():
        torch.testing.assert_close(eager_copy(x), model(x))


def test_the_cache_key_names_the_cpu_isa_beside_the_users_tag(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.compile's cache key tag gets the ISA torch compiles for (and a oneDNN cap), after the user's own tag."""
    for name in ISA_ENV:
        monkeypatch.delenv(name, raising=False)
    capability = torch.backends.cpu.get_cpu_capability()
    with torch.compiler.config.patch(cache_key_tag="mine"):  # put back on exit (pytest's monkeypatch deletes it)
        assert tag_compile_cache() == f"mine|speedkit-cpu-isa={capability}"
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
        assert tag_compile_cache() == f"mine|speedkit-cpu-isa={capability}/AVX2"  # replaced, not appended again
        assert torch.compiler.config.cache_key_tag == f"mine|speedkit-cpu-isa={capability}/AVX2"


@pytest.mark.slow
def test_one_inductor_cache_shared_by_two_isas_gives_each_its_own_graphs(tmp_path: Path) -> None:
    """A fit compiled under a forced AVX2 ISA, then one at this CPU's own, on one cache: both compute as eager does.

    Each in its own process (``tests/scripts/compile_cache.py``: the forced ISA is read when torch starts). Keyed by
    nothing of the CPU, the second process loaded the first one's graph: on the AVX-512 EPYC the compiled module's
    outputs were NaN after the fit, or the heap was corrupted. On an AVX2-only CPU both runs are at AVX2.
    """
    script = ROOT / "tests" / "scripts" / "compile_cache.py"
    forced = (*ISA_ENV, "TORCH_COMPILE_CACHE_KEY_TAG")
    own = {name: value for name, value in os.environ.items() if name not in forced}
    own |= {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"), "SPEEDKIT_DECISIONS_DIR": str(tmp_path / "dec")}
    runs = {}
    for name, env in (("avx2", {**own, "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}), ("own", own)):
        out = tmp_path / f"{name}.json"
        done = subprocess.run([sys.executable, str(script), str(out)], env=env, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-4000:]
        runs[name] = json.loads(out.read_text())
    assert runs["avx2"]["capability"] == "AVX2"
    assert runs["avx2"]["cache_key_tag"] == "speedkit-cpu-isa=AVX2/AVX2"
    assert runs["own"]["cache_key_tag"] == f"speedkit-cpu-isa={runs['own']['capability']}"
    for run in runs.values():
        assert run["compiled"], run
        assert run["max_abs_gap"] is not None, run
        assert run["max_abs_gap"] < 1e-4, run


def test_a_backend_that_fails_falls_back_to_eager_with_one_warning(tmp_path: Path) -> None:
    """A backend that raises: one warning, the module stays eager, and the fit trains to the end."""
    model = TinyClassifier()
    before = _weights(model)
    callback = Compile(backend=_failing_backend, min_compile_s=0.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tiny_trainer(tmp_path, max_epochs=-1, max_steps=300, callbacks=[callback, _StopAfter(20)]).fit(model)
    report = callback.report()
    assert len(_ours(caught)) == 1, _ours(caught)
    assert "compiling the module failed (BackendCompilerFailed" in _ours(caught)[0]
    assert report["decision"] == "eager"
    assert report["reason"].startswith("eager: compiling failed (BackendCompilerFailed")
    assert "compiled" in report["rejected"]
    assert model._compiled_call_impl is None
    assert any(not torch.equal(a, b) for a, b in zip(before, _weights(model), strict=True))


def test_a_failure_after_the_decision_falls_back_at_the_call(tmp_path: Path) -> None:
    """A saved 'compiled' decision whose compile fails now: one warning at the first call, eager from then on."""
    callback = Compile(backend=_failing_backend)
    callback.load_state_dict({"decision": {"decision": "compiled", "reason": "compiled: injected"}})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tiny_trainer(tmp_path, max_epochs=2, callbacks=[callback]).fit(model := TinyClassifier())
    assert len(_ours(caught)) == 1, _ours(caught)
    assert callback.report()["status"].startswith("eager: compiling failed at a call (BackendCompilerFailed")
    assert callback.state_dict()["decision"]["decision"] == "eager"
    assert model._compiled_call_impl is None


@pytest.mark.parametrize(
    ("kwargs", "reason_starts"),
    [
        ({"max_graph_breaks": 0}, "eager: 1 graph breaks (more than max_graph_breaks=0)"),
        ({"fullgraph": True}, "eager: compiling failed (Unsupported"),
    ],
)
def test_graph_breaks_beyond_the_bound_keep_the_module_eager(
    tmp_path: Path, kwargs: dict[str, Any], reason_starts: str
) -> None:
    """A forward with a graph break: over ``max_graph_breaks``, or under ``fullgraph=True``, stays eager and warns."""
    callback = Compile(backend="eager", measure=False, **kwargs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tiny_trainer(tmp_path, max_epochs=1, callbacks=[callback], limit_val_batches=0).fit(model := _GraphBreak())
    report = callback.report()
    assert len(_ours(caught)) == 1, _ours(caught)
    assert report["reason"].startswith(reason_starts), report
    assert report["decision"] == "eager"
    assert model._compiled_call_impl is None


def test_a_module_the_user_compiled_is_left_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``model.compile()`` before fit: no probe, the user's compiled call stays; its graphs' cache keys name the ISA."""
    monkeypatch.setattr(trials, "TrialSession", lambda *a, **k: pytest.fail("probed a user-compiled module"))
    model = TinyClassifier()
    model.compile(backend="eager")
    users = model._compiled_call_impl
    with torch.compiler.config.patch(cache_key_tag=""):  # the graphs compile at the fit's first call
        tiny_trainer(tmp_path, max_epochs=1, callbacks=[callback := Compile()]).fit(model)
        assert torch.compiler.config.cache_key_tag.startswith(ISA_TAG)
    assert callback.report()["status"] == "compiled by the user: left as it is"
    assert model._compiled_call_impl is users


def test_a_second_fit_keeps_its_own_compiled_module_and_the_callback_pickles(tmp_path: Path) -> None:
    """Fitting again with the same callback and module reuses the decision (not 'compiled by the user')."""
    model, callback = TinyClassifier(), Compile(backend="eager", measure=False)
    tiny_trainer(tmp_path, max_epochs=1, callbacks=[callback]).fit(model)
    compiled_call = model._compiled_call_impl
    tiny_trainer(tmp_path, max_epochs=2, callbacks=[callback]).fit(model)
    assert callback.report()["status"] == "compiled"
    assert model._compiled_call_impl is compiled_call
    restored = pickle.loads(pickle.dumps(callback))
    assert restored.report()["decision"] == "compiled"


# ---------------------------------------------------------------------------------------------------- checkpoints
def test_a_compiled_checkpoint_resumes_and_loads_into_an_eager_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A compiled run's checkpoint resumes compiled without probing, and loads into an eager model.

    Keys carry no ``_orig_mod.``; the resumed run ends where an uninterrupted compiled run ends;
    ``load_from_checkpoint`` gives an eager model with the same weights, and an eager state loads back.
    """
    L.seed_everything(0, verbose=False)
    straight = _Ordered()
    tiny_trainer(tmp_path / "straight", max_epochs=4, callbacks=[Compile(measure=False)]).fit(straight)

    L.seed_everything(0, verbose=False)
    first = _Ordered()
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    tiny_trainer(
        tmp_path / "first", max_epochs=2, callbacks=[Compile(measure=False), checkpoint], enable_checkpointing=True
    ).fit(first)
    path = tmp_path / "ckpt" / "last.ckpt"
    saved = torch.load(path, weights_only=True)
    assert not any("_orig_mod" in key for key in saved["state_dict"])
    state = next(v for k, v in saved["callbacks"].items() if k.startswith("Compile"))
    assert state["decision"]["decision"] == "compiled"

    eager = _Ordered.load_from_checkpoint(path)
    assert eager._compiled_call_impl is None
    for a, b in zip(eager.state_dict().values(), first.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    first.load_state_dict(eager.state_dict())  # and an eager state loads into the compiled module

    monkeypatch.setattr(trials, "TrialSession", lambda *a, **k: pytest.fail("probed again on resume"))
    resumed, callback = _Ordered(), Compile(measure=False)
    tiny_trainer(tmp_path / "resumed", max_epochs=4, callbacks=[callback]).fit(resumed, ckpt_path=path)
    assert callback.report()["status"] == "compiled"
    assert resumed._compiled_call_impl is not None
    for a, b in zip(resumed.parameters(), straight.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------------------------------- DDP
def _rank_state(trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
    """Each rank's compile state, report and weights at the end of training (written by `RankWriter`)."""
    report = callback_of(trainer, Compile).report()
    return {
        "compiled": pl_module._compiled_call_impl is not None,
        "decision": report["decision"],
        "status": report["status"],
        "graphs": report["graphs"],
        "graph_breaks": report["graph_breaks"],
        "global_step": trainer.global_step,
        "weights": [p.detach().flatten().tolist() for p in pl_module.parameters()],
    }


@pytest.mark.slow
@pytest.mark.ddp
def test_ddp_trains_compiled_with_both_ranks_in_step(tmp_path: Path) -> None:
    """2-process DDP (gloo): the module inside the DDP wrapper is compiled on both ranks; their weights end equal.

    Lightning runs ``training_step`` through the wrapper as the module's ``forward``; only the module's own forward is
    compiled, so ``self.log`` in the step breaks no graph.
    """
    L.seed_everything(0, verbose=False)
    strategy = DDPStrategy(start_method="spawn", process_group_backend="gloo")
    trainer = tiny_trainer(
        tmp_path,
        max_epochs=2,
        strategy=strategy,
        devices=2,
        callbacks=[Compile(measure=False), RankWriter(tmp_path, _rank_state)],
    )
    trainer.fit(TinyClassifier(num_samples=70))
    ranks = rank_records(tmp_path)
    assert [r["compiled"] for r in ranks] == [True, True]
    assert [r["status"] for r in ranks] == ["compiled", "compiled"]
    assert all(r["graphs"] >= 1 and r["graph_breaks"] == 0 for r in ranks)  # forward compiled, not the step's logging
    assert ranks[0]["global_step"] == ranks[1]["global_step"] > 0
    for a, b in zip(ranks[0]["weights"], ranks[1]["weights"], strict=True):
        assert a == pytest.approx(b, abs=1e-6)


# ---------------------------------------------------------------------------------------------------- benchmark
def test_benchmark_quick_mode_writes_the_decisions_beside_the_truth(tmp_path: Path) -> None:
    """``benchmarks/compile.py --quick`` times both per step, fits both budgets, and records the callback's decision."""
    benchmark = load_benchmark("compile")
    result = benchmark.main(["--quick", "--out", str(tmp_path / "compile.json"), "--cache-dir", str(tmp_path)])
    assert json.loads((tmp_path / "compile.json").read_text()) == result
    assert result["per_step"]["eager_ms"] > 0
    assert result["per_step"]["compiled_ms"] > 0
    assert {row["budget"] for row in result["budgets"]} == {"short", "long"}
    for row in result["budgets"]:
        assert row["eager_fit_s"] > 0
        assert row["compiled_fit_s"] > 0
        assert row["faster"] in ("eager", "compiled")
        assert row["decision"] in ("eager", "compiled")
        assert row["reason"]
