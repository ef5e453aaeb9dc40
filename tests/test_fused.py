"""FusedOptimizer: which groups it switches, that a switch mid-run trains as the default would, and its life cycle."""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from conftest import RankWriter, TinyClassifier, load_benchmark, rank_records, tiny_trainer
from lightning.pytorch.strategies import DDPStrategy
from typing_extensions import override

from lightning_speedkit import FusedOptimizer
from lightning_speedkit.fused import fusable_groups, set_fused
from lightning_speedkit.trials import Decision


class _Chosen(TinyClassifier):
    """TinyClassifier with Adam built from ``options`` (the user's own ``fused``/``foreach`` choices)."""

    def __init__(self, num_samples: int = 64, **options: Any) -> None:
        super().__init__(num_samples=num_samples, optimizer="adam")
        self.options = options

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=0.01, **self.options)


class _Flags(L.Callback):
    """Records each optimizer group's ``fused`` flag at every training step."""

    def __init__(self) -> None:
        self.flags: list[list[Any]] = []

    @override
    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.flags.append([g["fused"] for o in trainer.optimizers for g in o.param_groups])


def _fit(
    tmp_path: Path, model: L.LightningModule, lever: FusedOptimizer, ckpt_path: Path | None = None, **kwargs: Any
) -> L.Trainer:
    L.seed_everything(0, verbose=False)
    trainer = tiny_trainer(tmp_path, callbacks=[lever, *kwargs.pop("callbacks", [])], limit_val_batches=0, **kwargs)
    trainer.fit(model, ckpt_path=ckpt_path)
    return trainer


@pytest.mark.parametrize(
    ("build", "why"),
    [
        (lambda w: torch.optim.Adam([w], fused=False), "set by you (foreach=None, fused=False)"),
        (lambda w: torch.optim.Adam([w], fused=True), "set by you (foreach=None, fused=True)"),
        (lambda w: torch.optim.AdamW([w], foreach=True), "set by you (foreach=True, fused=None)"),
        (lambda w: torch.optim.Adam([w], differentiable=True), "differentiable=True"),
        (lambda w: torch.optim.Adagrad([w]), "Adagrad has no fused kernel here"),
    ],
)
def test_only_groups_the_user_left_unset_qualify(build: Any, why: str) -> None:
    """An explicit ``fused``/``foreach``, a differentiable optimizer or one without a fused kernel is not switched."""
    groups, reason = fusable_groups(build(torch.nn.Parameter(torch.zeros(3))))
    assert groups == []
    assert why in reason


def test_a_float64_default_dtype_is_not_switched() -> None:
    """The fused kernels count steps in float32: under a float64 default dtype nothing qualifies."""
    w = torch.nn.Parameter(torch.zeros(3))
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        assert fusable_groups(torch.optim.Adam([w]))[1] == "torch's default dtype is torch.float64, not float32"
    finally:
        torch.set_default_dtype(previous)


@pytest.mark.parametrize(
    "build",
    [
        lambda ps: torch.optim.Adam(ps, lr=0.01),
        lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1, amsgrad=True),
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-3),
    ],
)
def test_switching_to_fused_and_back_mid_run_trains_as_the_default_does(build: Any) -> None:
    """Steps alternating the default and the fused update (state made by either) end where default steps end."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    twin = copy.deepcopy(net)
    x, y = torch.randn(32, 8), torch.randint(0, 2, (32,))
    plain, switched = build(list(net.parameters())), build(list(twin.parameters()))
    for step in range(8):
        set_fused(switched.param_groups, step % 3 == 1)  # default, fused, default, default, fused...
        for model, optimizer in ((net, plain), (twin, switched)):
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
    for a, b in zip(net.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_fit_measures_both_updates_and_the_flag_follows_the_decision(tmp_path: Path) -> None:
    """400 steps: counted blocks of each setting (the run's own steps: none lost), then the decided flag stays on."""
    lever, flags = FusedOptimizer(), _Flags()
    trainer = _fit(tmp_path, _Chosen(num_samples=1600), lever, max_epochs=2, callbacks=[flags])
    report = lever.report()
    assert report["probed"], report
    assert report["source"] == "measured"
    assert report["decision"] in ("fused", "default")
    assert set(report["step_ms"]) == {"fused", "default"}
    assert trainer.global_step == 400
    assert {tuple(f) for f in flags.flags} >= {(True,), (None,)}  # both settings trained real steps
    assert flags.flags[-1] == [True if report["decision"] == "fused" else None]
    assert report["fused_groups"] == (1 if report["decision"] == "fused" else 0)


@pytest.mark.parametrize("options", [{"fused": False}, {"fused": True}, {"foreach": True}])
def test_a_users_own_choice_is_left_as_it_is(tmp_path: Path, options: dict[str, bool]) -> None:
    """An optimizer built with ``fused`` or ``foreach`` set is not probed and keeps its flags for the whole fit."""
    lever, flags = FusedOptimizer(), _Flags()
    _fit(tmp_path, _Chosen(num_samples=1600, **options), lever, callbacks=[flags])
    report = lever.report()
    assert not report["probed"]
    assert report["reason"].startswith("left as it is: Adam: `foreach`/`fused` set by you")
    assert {tuple(f) for f in flags.flags} == {(options.get("fused"),)}


class _SparseEmbedding(L.LightningModule):
    """An embedding with sparse gradients under SGD, as a recommender's: torch's fused SGD refuses those."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding, self.head = torch.nn.Embedding(100, 8, sparse=True), torch.nn.Linear(8, 2)

    @override
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids, labels = batch
        return torch.nn.functional.cross_entropy(self.head(self.embedding(ids)), labels)

    @override
    def train_dataloader(self) -> Any:
        ids = torch.randint(0, 100, (1600,), generator=torch.Generator().manual_seed(0))
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids, ids % 2), batch_size=8)

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_an_optimizer_of_sparse_gradients_is_left_as_it_is(tmp_path: Path) -> None:
    """An ``Embedding(sparse=True)`` under SGD is not switched: the fit trains, the report says why.

    Its weight is a dense float tensor, so it qualified: the first fused block died in "_fused_sgd does not support
    sparse gradients".
    """
    lever = FusedOptimizer()
    trainer = _fit(tmp_path, _SparseEmbedding(), lever, max_epochs=2)
    assert trainer.global_step == 400
    report = lever.report()
    assert (report["probed"], report["reason"]) == (
        False,
        "left as it is: sparse gradients (an Embedding with sparse=True)",
    )


def test_a_short_run_skips_the_probe(tmp_path: Path) -> None:
    """Eight steps cannot repay timing both updates: the default stays and the reason says so."""
    lever = FusedOptimizer()
    _fit(tmp_path, _Chosen(), lever)
    report = lever.report()
    assert not report["probed"]
    assert report["decision"] == "default"
    assert report["reason"].startswith("skipped: the probe (11 steps) cannot pay back in 8 steps left")


class _LoadsOldState(L.Callback):
    """At step 3, loads the optimizer state of step 1 (as a `TrainingGuard` rollback does)."""

    def __init__(self) -> None:
        self.saved: dict[str, Any] | None = None

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        optimizer = trainer.optimizers[0]
        if trainer.global_step == 1:
            self.saved = copy.deepcopy(optimizer.state_dict())
            self.saved["param_groups"][0]["fused"] = None  # a state saved before the switch
        if trainer.global_step == 3 and self.saved is not None:
            optimizer.load_state_dict(self.saved)


def test_a_decision_outlives_a_loaded_optimizer_state(tmp_path: Path) -> None:
    """A fused decision stays in place after ``optimizer.load_state_dict`` of a state saved without it."""
    lever, flags = FusedOptimizer(), _Flags()
    lever.load_state_dict({"decision": Decision("fused", "as measured before", probed=True).as_dict()})
    _fit(tmp_path, _Chosen(), lever, callbacks=[_LoadsOldState(), flags])
    assert flags.flags == [[True]] * 8
    assert lever.report()["source"] == "resumed"


def test_resume_applies_the_saved_decision_without_probing(tmp_path: Path) -> None:
    """A resumed fit puts the checkpoint's decision back (the optimizer state loaded after it keeps it)."""
    first = FusedOptimizer()
    _fit(tmp_path / "a", _Chosen(num_samples=1600), first, max_epochs=2, enable_checkpointing=True)
    checkpoint = next((tmp_path / "a").rglob("*.ckpt"))
    resumed, flags = FusedOptimizer(), _Flags()
    L.seed_everything(0, verbose=False)
    trainer = tiny_trainer(tmp_path / "b", max_epochs=3, callbacks=[resumed, flags], limit_val_batches=0)
    trainer.fit(_Chosen(num_samples=1600), ckpt_path=str(checkpoint))
    report = resumed.report()
    assert report["source"] == "resumed"
    assert report["decision"] == first.report()["decision"]
    assert {tuple(f) for f in flags.flags} == {(True if report["decision"] == "fused" else None,)}


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"margin": 1.0}, "`margin`"),
        ({"margin": -0.1}, "`margin`"),
        ({"probe_steps": 1}, "`probe_steps`"),
        ({"remember": "yes"}, "`remember`"),
    ],
)
def test_bad_arguments_are_refused(kwargs: dict[str, Any], match: str) -> None:
    """A margin outside [0, 1), fewer than 2 probe steps or a non-bool ``remember`` get a ValueError naming it."""
    with pytest.raises(ValueError, match=match):
        FusedOptimizer(**kwargs)


def _rank_state(trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
    """Each rank's decision, flag and weights at the end of training (written by `RankWriter`)."""
    lever = next(c for c in trainer.callbacks if isinstance(c, FusedOptimizer))  # type: ignore[attr-defined]
    weights = [p.detach().flatten().tolist() for p in pl_module.parameters()]
    flag = trainer.optimizers[0].param_groups[0]["fused"]
    return {"decision": lever.report()["decision"], "fused": flag, "weights": weights}


@pytest.mark.slow
@pytest.mark.ddp
def test_ddp_ranks_decide_alike_and_stay_in_sync(tmp_path: Path) -> None:
    """2-process DDP (gloo): both ranks keep the same update (rank zero's timings decide) and end with equal weights."""
    strategy = DDPStrategy(start_method="spawn", process_group_backend="gloo")
    writer = RankWriter(tmp_path, _rank_state)
    _fit(tmp_path, _Chosen(num_samples=3200), FusedOptimizer(), strategy=strategy, devices=2, callbacks=[writer])
    ranks = rank_records(tmp_path)
    assert ranks[0]["decision"] == ranks[1]["decision"]
    assert ranks[0]["fused"] == ranks[1]["fused"] == (True if ranks[0]["decision"] == "fused" else None)
    for a, b in zip(ranks[0]["weights"], ranks[1]["weights"], strict=True):
        assert a == pytest.approx(b, abs=1e-6)


@pytest.mark.slow
def test_benchmark_quick_mode_fits_with_and_without_the_lever_and_times_both_updates(tmp_path: Path) -> None:
    """``benchmarks/fused_optimizer.py --quick`` runs each task plain and with the lever, and times both updates."""
    result = load_benchmark("fused_optimizer").main(["--quick", "--out", str(tmp_path / "fused.json")])
    assert (tmp_path / "fused.json").exists()
    assert [row["task"] for row in result["fits"]] == ["mlp", "conv", "transformer", "demo"]
    assert {(r["task"], r["variant"]) for r in result["runs"]} == {
        (task, variant) for task in ("mlp", "conv", "transformer", "demo") for variant in ("plain", "fused_optimizer")
    }
    assert all(r["lever"]["decision"] in ("fused", "default") for r in result["runs"] if "lever" in r)
    assert all(row["default_ms"] > 0 and row["fused_ms"] > 0 for row in result["steps"])


class _SlowForward(_Chosen):
    """A training step whose forward takes 5 ms more: in both settings alike, so no part of the decision."""

    @override
    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        time.sleep(0.005)
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_the_blocks_time_the_update_unless_gradients_accumulate(tmp_path: Path, accumulate: int) -> None:
    """The probe times each step from the gradients to its end, leaving a slow forward out.

    Under gradient accumulation, where a batch without an update has no such span, it times whole steps.
    """
    lever = FusedOptimizer()
    _fit(tmp_path, _SlowForward(num_samples=1600 * accumulate), lever, max_epochs=2, accumulate_grad_batches=accumulate)
    report = lever.report()
    assert report["probed"], report
    if accumulate == 1:
        assert max(report["step_ms"].values()) < 2.5
        assert report["reason"].endswith("(the update timed: from the gradients to the step's end)")
    else:
        assert min(report["step_ms"].values()) > 2.5
        assert "the update timed" not in report["reason"]


def test_a_remembered_decision_is_applied_with_its_reason_as_measured(tmp_path: Path) -> None:
    """The same job again applies the first fit's decision without probing; its reason is the measured one."""
    first, again = FusedOptimizer(), FusedOptimizer()
    _fit(tmp_path / "a", _Chosen(num_samples=1600), first, max_epochs=2)
    _fit(tmp_path / "b", _Chosen(num_samples=1600), again, max_epochs=2)
    report = again.report()
    assert report["source"] == "remembered"
    assert report["decision"] == first.report()["decision"]
    assert report["reason"] == first.report()["reason"]
    assert report["reason"].count("(the update timed") == 1


class _SlowValidation(_Chosen):
    """Validation that takes 150 ms a batch: between two epochs, no part of any training step."""

    @override
    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        time.sleep(0.15)
        super().validation_step(batch, batch_idx)


def test_a_counted_block_across_an_epoch_end_does_not_time_the_validation(tmp_path: Path) -> None:
    """Whole-step counted blocks (gradients accumulate) across epoch ends leave the validation out.

    The first step of an epoch is timed from its own start, not from the previous step's end.
    """
    lever = FusedOptimizer()
    L.seed_everything(0, verbose=False)
    trainer = tiny_trainer(tmp_path, callbacks=[lever], max_epochs=20, limit_val_batches=1, accumulate_grad_batches=2)
    trainer.fit(_SlowValidation(num_samples=320))
    report = lever.report()
    assert report["probed"], report
    steps = [t for block in report["blocks"] for t in block["step_s"]]
    assert len(steps) > 40  # more than one epoch of batches: the blocks cross epoch ends
    assert max(steps) < 0.1


class _SaveInFusedBlock(L.Callback):
    """Writes one checkpoint while the lever is still probing, inside a block of the fused update."""

    def __init__(self, lever: FusedOptimizer, path: Path) -> None:
        self.lever, self.path, self.fused_in_memory = lever, path, False

    @override
    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if self.lever.decision is None and self.lever.fused_on and not self.path.exists():
            self.fused_in_memory = trainer.optimizers[0].param_groups[0]["fused"] is True
            trainer.save_checkpoint(self.path)


def test_a_checkpoint_written_mid_probe_holds_the_update_from_before_the_probe(tmp_path: Path) -> None:
    """A checkpoint written in a block of the fused update holds torch's default; a resume runs what it decides.

    The optimizer state carried the candidate's ``fused=True``: a resume that kept the default (too few steps left
    to probe) trained fused while its report said "default".
    """
    lever, path = FusedOptimizer(remember=False), tmp_path / "mid_probe.ckpt"
    saver = _SaveInFusedBlock(lever, path)
    _fit(tmp_path, _Chosen(num_samples=1600), lever, max_epochs=2, callbacks=[saver])
    assert saver.fused_in_memory
    assert torch.load(path, weights_only=False)["optimizer_states"][0]["param_groups"][0]["fused"] is None
    step = torch.load(path, weights_only=False)["global_step"]
    resumed, flags = FusedOptimizer(remember=False), _Flags()  # 8 steps left: no probe can pay back
    model = _Chosen(num_samples=1600)
    _fit(tmp_path / "resumed", model, resumed, path, max_steps=step + 8, max_epochs=2, callbacks=[flags])
    assert resumed.report()["decision"] == "default"
    assert {tuple(f) for f in flags.flags} == {(None,)}
