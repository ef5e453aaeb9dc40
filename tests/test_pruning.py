from __future__ import annotations

import csv
import json
import pickle
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from conftest import TinyClassifier, load_benchmark, run_ddp_script, tiny_trainer
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from typing_extensions import override

from lightning_speedkit.demo import DemoClassifier, DemoResNet
from lightning_speedkit.pruning import (
    StructuredPruning,
    apply_pruning_history,
    channel_step_ratio,
    count_macs_params,
    load_pruned_checkpoint,
    output_layer_names,
    plan_pruning,
    pruning_history,
    unsupported_layer_names,
)
from lightning_speedkit.warmup import WarmupScheduler


class OrderedTiny(TinyClassifier):
    """TinyClassifier without shuffling, so a resumed run sees the same batches as an uninterrupted one."""

    @override
    def train_dataloader(self) -> DataLoader[tuple[torch.Tensor, ...]]:
        return DataLoader(self._data(0), batch_size=self.batch_size)


class Probe(Callback):
    """Snapshots the parameters right after the pruning step and records the LR of every optimizer step."""

    def __init__(self, epoch: int) -> None:
        self.epoch = epoch
        self.snapshot: dict[str, torch.Tensor] = {}
        self.lrs: list[tuple[int, float]] = []

    @override
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        """Copy the pruned parameters at the first batch of the pruning epoch."""
        if trainer.current_epoch == self.epoch and batch_idx == 0:
            self.snapshot = {n: p.detach().clone() for n, p in pl_module.named_parameters()}

    @override
    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        """Record the LR this step uses."""
        self.lrs.append((trainer.global_step, float(optimizer.param_groups[0]["lr"])))


# ---------------------------------------------------------------- pure functions


@pytest.mark.parametrize(("amount", "steps"), [(0.5, 1), (0.5, 2), (0.3, 3), (0.9, 4)])
def test_channel_step_ratios_compound_to_amount(amount: float, steps: int) -> None:
    """The per-step ratios of the current channels remove `amount` of the original channels in all."""
    kept = 1.0
    for step in range(steps):
        kept *= 1.0 - channel_step_ratio(amount, step, steps)
    assert kept == pytest.approx(1.0 - amount)


@pytest.mark.parametrize(
    ("model", "expected"),
    [
        (nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4), nn.Softmax(-1)), ["2"]),
        (DemoResNet(width=8), ["classifier"]),
    ],
)
def test_output_layer_names(model: nn.Module, expected: list[str]) -> None:
    """The layers that produce the model output are found, through activations and pooling."""
    x = torch.zeros(1, 16) if isinstance(model, nn.Sequential) else torch.zeros(1, 3, 32, 32)
    assert output_layer_names(model, x) == expected


def test_plan_and_apply_shrink_for_real_and_replay_exactly() -> None:
    """Channels are removed from the tensors, and a fresh model replays the history and loads the weights exactly."""
    torch.manual_seed(0)
    model, x = DemoResNet(width=8), torch.randn(2, 3, 32, 32)
    macs, params = count_macs_params(model, x)
    plan = plan_pruning(model, x, 0.5, ["classifier"], round_to=None)
    assert count_macs_params(model, x) == (macs, params)  # planning works on a copy
    apply_pruning_history(model, x, plan)
    new_macs, new_params = count_macs_params(model, x)
    assert new_params < 0.4 * params
    assert new_macs < 0.4 * macs
    assert model.stem[0].out_channels == 4
    assert model.classifier.out_features == 10
    fresh = DemoResNet(width=8)
    apply_pruning_history(fresh, x, pruning_history(model))
    fresh.load_state_dict(model.state_dict())
    model.eval(), fresh.eval()
    assert torch.equal(fresh(x), model(x))


class _TiedLM(nn.Module):
    """A language model whose output layer shares the embedding's weight."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.mid, self.back = nn.Embedding(40, 32), nn.Linear(32, 64), nn.Linear(64, 32)
        self.dec = nn.Linear(32, 40, bias=False)
        self.dec.weight = self.emb.weight

    @override
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        hidden = self.emb(ids)
        return self.dec(hidden + self.back(torch.relu(self.mid(hidden))))[:, -1]


def test_tied_parameters_stay_one_parameter_through_planning_pruning_and_replay() -> None:
    """A weight shared by two layers is still one parameter after pruning (torch-pruning gives each place its own)."""
    torch.manual_seed(0)
    model, ids = _TiedLM(), torch.zeros(1, 8, dtype=torch.long)
    with pytest.raises(RuntimeError, match=r"emb\.weight and dec\.weight share one parameter.*`ignored_layers`"):
        plan_pruning(model, ids, 0.5, round_to=None)  # the output layer's classes pruned, the embedding's rows kept
    plan = plan_pruning(model, ids, 0.5, ["dec"], round_to=None)
    apply_pruning_history(model, ids, plan)
    assert model.dec.weight is model.emb.weight
    assert model.emb.weight.shape[1] < 32
    assert len(list(model.parameters())) == 5  # the shared weight once, and mid's and back's weights and biases
    fresh = _TiedLM()
    apply_pruning_history(fresh, ids, pruning_history(model))
    assert fresh.dec.weight is fresh.emb.weight


class _TiedThroughALayer(nn.Module):
    """The output layer shares the embedding's weight; a layer between them feeds the output layer's inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.e, self.m, self.dec = nn.Embedding(20, 16), nn.Linear(16, 16), nn.Linear(16, 20, bias=False)
        self.dec.weight = self.e.weight

    @override
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.dec(torch.relu(self.m(self.e(ids).mean(1))))


def test_a_tie_cut_apart_names_the_layer_whose_outputs_cut_it() -> None:
    """``m``'s output channels are ``dec``'s inputs, a dimension of the tied weight: the refusal names ``m``.

    It advised ignoring ``e`` or ``dec``, which changes nothing, wrapped as a failure to run the pruned copy.
    """
    torch.manual_seed(0)
    model, ids = _TiedThroughALayer(), torch.zeros(1, 6, dtype=torch.long)
    with pytest.raises(RuntimeError, match=r"share one parameter.*\(20, 16\) and \(20, 8\)\): add `m` to") as caught:
        plan_pruning(model, ids, 0.5, ["dec"], round_to=None)
    assert "pruned copy" not in str(caught.value)
    assert pruning_history(model) == []
    assert plan_pruning(model, ids, 0.5, ["dec", "m"], round_to=None) is not None  # the advice taken: it plans


class _Recurrent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.r, self.fc = nn.LSTM(6, 16, batch_first=True), nn.Linear(16, 3)

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.r(x)[0][:, -1])


def test_an_lstm_is_left_whole_and_a_cut_torch_pruning_cannot_make_names_the_layer() -> None:
    """torch-pruning 1.6 cannot prune ``nn.LSTM`` (a bare IndexError inside its surgery, "outside any layer").

    `StructuredPruning` leaves it whole (`unsupported_layer_names`); asked directly, the error names it.
    """
    assert unsupported_layer_names(_Recurrent()) == ["r"]
    with pytest.raises(RuntimeError, match=r"could not remove the channels of `r` \(LSTM\).*`ignored_layers`"):
        plan_pruning(_Recurrent(), torch.zeros(2, 5, 6), 0.5, ["fc"], round_to=None)


class _NumpyRound(nn.Module):
    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(x.numpy().round())  # fine under no_grad, untraceable with autograd on


def test_untraceable_model_names_the_layer() -> None:
    """A submodule that cannot run with autograd on (as tracing needs) fails planning with an error naming it."""
    model = nn.Sequential(nn.Linear(4, 8), _NumpyRound(), nn.Linear(8, 2))
    with pytest.raises(RuntimeError, match="`1` \\(_NumpyRound\\)"):
        plan_pruning(model, torch.zeros(1, 4), 0.5, ["2"], round_to=None)


def test_only_cross_attention_is_reported_unsupported() -> None:
    """`nn.MultiheadAttention` with its own key/value widths is listed (left whole); plain self-attention is not."""
    model = nn.Sequential(nn.Linear(4, 8), nn.MultiheadAttention(8, 2), nn.MultiheadAttention(8, 2, kdim=4, vdim=4))
    assert unsupported_layer_names(model) == ["2"]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({}, "`amount`, `target_speedup` and `target_latency`"),
        ({"amount": 0.5, "target_speedup": 2.0}, "`amount`, `target_speedup` and `target_latency`"),
        ({"amount": 1.0}, "`amount`"),
        ({"amount": 0.0}, "`amount`"),
        ({"target_speedup": 1.0}, "`target_speedup`"),
        ({"target_speedup": 0.5}, "`target_speedup`"),
        ({"amount": 0.5, "iterative_steps": 0}, "`iterative_steps`"),
        ({"amount": 0.5, "start_epoch": -1}, "`start_epoch`"),
        ({"amount": 0.5, "finetune_epochs": -1}, "`finetune_epochs`"),
        ({"amount": 0.5, "importance": "taylor"}, "`importance`"),
        ({"amount": 0.5, "round_to": 0}, "`round_to`"),
        ({"amount": 0.5, "rewarm": 1.5}, "`rewarm`"),
        ({"amount": 0.5, "latency_batch_sizes": (0,)}, "`latency_batch_sizes`"),
    ],
)
def test_bad_arguments_raise(kwargs: dict[str, Any], match: str) -> None:
    """Bad constructor arguments raise ValueError naming them."""
    with pytest.raises(ValueError, match=match):
        StructuredPruning(**kwargs)


@pytest.mark.parametrize(
    ("trainer_kwargs", "cb_kwargs", "match"),
    [
        ({"max_epochs": 2}, {"start_epoch": 1, "finetune_epochs": 1}, "`max_epochs` >= 3"),
        ({"fast_dev_run": True}, {"start_epoch": 1}, r"got 1: `fast_dev_run` runs one epoch"),  # not "raise max_epochs"
        ({"strategy": "ddp_spawn", "devices": 2}, {}, "ddp_spawn"),
        ({"max_epochs": 3}, {"ignored_layers": ["nope"]}, "`ignored_layers`"),
    ],
)
def test_setup_checks(tmp_path: Path, trainer_kwargs: dict[str, Any], cb_kwargs: dict[str, Any], match: str) -> None:
    """Too few epochs, a spawn strategy or an unknown layer name fail in setup, saying what to do."""
    trainer = tiny_trainer(tmp_path, **trainer_kwargs)
    callback = StructuredPruning(amount=0.5, **cb_kwargs)
    with pytest.raises(ValueError, match=match):
        callback.setup(trainer, TinyClassifier(), "fit")


# ---------------------------------------------------------------- the callback in real fits


def test_fit_shrinks_and_rebuilt_optimizer_updates_every_parameter(tmp_path: Path, tiny_model: TinyClassifier) -> None:
    """After pruning the optimizer holds exactly the new parameters, and training changes every one of them."""
    probe = Probe(epoch=1)
    pruning = StructuredPruning(amount=0.5, start_epoch=1, finetune_epochs=1, round_to=None, latency_batch_sizes=())
    trainer = tiny_trainer(tmp_path, max_epochs=3, callbacks=[pruning, probe])
    trainer.fit(tiny_model)
    assert tiny_model.net[0].out_features == 16
    assert tiny_model.net[2].in_features == 16
    assert {id(p) for g in trainer.optimizers[0].param_groups for p in g["params"]} == {
        id(p) for p in tiny_model.parameters()
    }
    for name, param in tiny_model.named_parameters():
        assert param.shape == probe.snapshot[name].shape
        assert not torch.equal(param, probe.snapshot[name]), name
    report = pruning.report()
    assert report["finished"]
    assert report["params_after"] < report["params_before"]
    assert report["metric_before"] is not None
    assert report["metric_after"] is not None
    assert pickle.loads(pickle.dumps(pruning)).amount == 0.5


def test_a_step_that_removes_no_channel_says_why_and_what_to_pass(tmp_path: Path, tiny_model: TinyClassifier) -> None:
    """A step that removes nothing warns why and names round_to=None, where it said "removed 0 channels" only.

    At 90% with round_to=8 the 32-unit layer would keep 3 channels, under 8, so it is left whole.
    """
    pruning = StructuredPruning(amount=0.9, finetune_epochs=1, latency_batch_sizes=())
    trainer = tiny_trainer(tmp_path, max_epochs=2, callbacks=[pruning])
    with pytest.warns(UserWarning, match=r"removed no channel: with round_to=8 .* pass round_to=None"):
        trainer.fit(tiny_model)
    assert tiny_model.net[0].out_features == 32
    assert pruning.report()["params_after"] == pruning.report()["params_before"]


def _image_loader(n: int, seed: int) -> DataLoader[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(seed)
    return DataLoader(
        TensorDataset(torch.randn(n, 3, 32, 32, generator=g), torch.randint(0, 10, (n,), generator=g)), batch_size=8
    )


def test_target_speedup_on_a_resnet_logs_the_report(tmp_path: Path) -> None:
    """On the demo ResNet, target_speedup=2 gives >= 2x fewer MACs, logged under speedkit/pruning/."""
    L.seed_everything(0, verbose=False)
    model = DemoClassifier(width=8, crop_size=32)
    pruning = StructuredPruning(target_speedup=2.0, start_epoch=1, round_to=2, monitor="val_acc")
    logger = CSVLogger(tmp_path, name="csv")
    trainer = tiny_trainer(tmp_path, max_epochs=3, logger=logger, callbacks=[pruning], limit_train_batches=2)
    trainer.fit(model, _image_loader(16, 0), _image_loader(8, 1))
    report = pruning.report()
    assert report["macs_before"] / report["macs_after"] >= 2.0
    assert set(report["latency_ms_before"]) == {1}
    assert report["monitor"] == "val_acc"
    with open(Path(logger.log_dir) / "metrics.csv") as handle:
        keys = set(next(csv.reader(handle)))
    for key in ("macs_speedup", "params_after", "latency_ms_b1_after", "val_acc_after", "step"):
        assert f"speedkit/pruning/{key}" in keys


class RenamedWarmup(WarmupScheduler):
    """A user's subclass of the warmup under another name: found by the cooperation protocol, not by class name."""


@pytest.mark.parametrize("warmup_class", [WarmupScheduler, RenamedWarmup])
def test_warmup_restarts_at_the_pruning_step(
    tmp_path: Path, tiny_model: TinyClassifier, warmup_class: type[WarmupScheduler]
) -> None:
    """A warmup callback's warmup starts again at the pruning step: that step's LR is the warmup's first (0)."""
    probe = Probe(epoch=1)
    warmup = warmup_class(warmup=2, decay="constant")
    pruning = StructuredPruning(amount=0.5, start_epoch=1, rewarm=4, round_to=None, latency_batch_sizes=())
    trainer = tiny_trainer(tmp_path, max_epochs=3, callbacks=[warmup, pruning, probe], limit_val_batches=0)
    trainer.fit(tiny_model)
    assert warmup.schedule is not None
    assert warmup.schedule[:1] == (4,)
    assert warmup.schedule[2] == 8
    lrs = dict(probe.lrs)
    assert lrs[7] == pytest.approx(0.1)
    assert lrs[8] == 0.0
    assert lrs[10] == pytest.approx(0.05)


@pytest.mark.parametrize("resume_epoch", [1, 2])
def test_resume_matches_uninterrupted_run(tmp_path: Path, resume_epoch: int) -> None:
    """Resuming between or after the steps (weights_only load) continues with the pruned architecture exactly."""

    def run(root: Path, ckpt_path: str | None = None) -> tuple[OrderedTiny, StructuredPruning]:
        L.seed_everything(0, verbose=False)
        model = OrderedTiny()
        pruning = StructuredPruning(amount=0.5, start_epoch=1, iterative_steps=2, round_to=None, latency_batch_sizes=())
        checkpoints = ModelCheckpoint(dirpath=root, save_top_k=-1, filename="{epoch}")
        trainer = tiny_trainer(root, max_epochs=4, callbacks=[pruning, checkpoints], enable_checkpointing=True)
        trainer.fit(model, ckpt_path=ckpt_path, weights_only=True)
        return model, pruning

    full, full_pruning = run(tmp_path / "full")
    resumed, resumed_pruning = run(tmp_path / "resumed", str(tmp_path / "full" / f"epoch={resume_epoch}.ckpt"))
    assert pruning_history(resumed) == pruning_history(full)
    assert len(pruning_history(full)) == 2
    assert resumed_pruning.report()["steps"] == full_pruning.report()["steps"]
    for (name, a), (_, b) in zip(full.named_parameters(), resumed.named_parameters(), strict=True):
        torch.testing.assert_close(a, b, msg=name)

    fresh = load_pruned_checkpoint(TinyClassifier(), tmp_path / "full" / "epoch=3.ckpt")
    x = torch.randn(5, 16)
    torch.testing.assert_close(fresh(x), full.eval()(x))


@pytest.mark.slow
@pytest.mark.ddp
def test_ddp_ranks_prune_identically_and_stay_in_sync(tmp_path: Path) -> None:
    """Under 2-process DDP both ranks apply the same plan and, re-wrapped, end with identical weights."""
    rank0, rank1 = run_ddp_script("pruning_ddp", tmp_path)
    assert rank0["history"] == rank1["history"]
    assert rank0["history"]
    assert rank0["shapes"]["net.0.weight"] == [16, 16]
    assert rank0["weights"] == rank1["weights"]
    assert rank0["optimizer_has_all"]
    assert rank1["optimizer_has_all"]
    assert rank1["ddp_wraps_module"]


@pytest.mark.slow
def test_benchmark_quick_mode(tmp_path: Path, demo_cache: Path) -> None:
    """The benchmark runs every variant end to end in quick mode and writes its JSON."""
    bench = load_benchmark("pruning")
    result = bench.main(["--quick", "--out", str(tmp_path / "out.json"), "--root", str(demo_cache)])
    assert json.loads((tmp_path / "out.json").read_text())["rows"].keys() == set(bench.VARIANTS)
    for name in ("structured", "vit_structured", "text_structured"):
        assert result["rows"][name]["macs_ratio"] >= 2.0, name
    assert result["rows"]["latency"]["search_speedup"] >= result["settings"]["latency_target"]
    assert result["rows"]["modelpruning"]["params_ratio"] == 1.0


class ProtocolWarmup(Callback):
    """Not a WarmupScheduler at all: a callback with the methods of `lightning_speedkit.lr.WarmupLike`."""

    warmup: int | float = 2
    total_steps: int | None = None

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def rescale_base_lrs(self, trainer: Any, factor: float) -> None:
        self.calls.append(("rescale_base_lrs", factor))

    def set_warmup_steps(self, warmup_steps: int) -> None:
        self.calls.append(("set_warmup_steps", warmup_steps))

    def restart(self, warmup: int | float, total_steps: int | None = None) -> None:
        self.calls.append(("restart", warmup))

    @override
    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.calls.append(("on_train_batch_start", batch))


def test_restart_warmup_drives_every_warmup_through_the_protocol() -> None:
    """Each callback with the warmup protocol is restarted and attached at once, whatever its class; others are not."""
    from types import SimpleNamespace

    from lightning_speedkit.pruning.optimizers import restart_warmup

    first, second = ProtocolWarmup(), ProtocolWarmup()
    bystander = Probe(epoch=1)
    trainer = SimpleNamespace(callbacks=[first, bystander, second])
    restart_warmup(trainer, None, "batch", 0.25)  # type: ignore[arg-type]
    assert first.calls == second.calls == [("restart", 0.25), ("on_train_batch_start", "batch")]


class _WithExample(TinyClassifier):
    """TinyClassifier with the ``example_input_array`` Lightning reads for summaries and exports (float32)."""

    def __init__(self) -> None:
        super().__init__()
        self.example_input_array = torch.randn(2, 16)


@pytest.mark.parametrize("given", ["example_input_array", "example_input"])
def test_a_bf16_true_module_prunes_with_its_float32_example(tmp_path: Path, given: str) -> None:
    """Under ``precision="bf16-true"`` the example is converted as Lightning feeds the module, so pruning runs.

    The float32 example went to the bfloat16 module as it was: "mat1 and mat2 must have the same dtype" at the step.
    """
    L.seed_everything(0, verbose=False)
    example = {"example_input": torch.randn(2, 16)} if given == "example_input" else {}
    pruning = StructuredPruning(amount=0.5, finetune_epochs=1, round_to=None, latency_batch_sizes=(), monitor=None,
                                **example)  # fmt: skip
    trainer = tiny_trainer(tmp_path, max_epochs=2, precision="bf16-true", callbacks=[pruning], limit_val_batches=0)
    trainer.fit(_WithExample())
    report = pruning.report()
    assert report["params_after"] < report["params_before"]


def test_a_fit_resumed_before_the_pruning_step_reports_the_metric_before_it(tmp_path: Path) -> None:
    """``metric_before`` is the last validation's value before pruning, also when that validation ran before a resume.

    It was read from ``trainer.callback_metrics`` at the pruning step, empty in a fit resumed from the checkpoint
    of the epoch before: the report said ``None``.
    """

    def run(root: Path, ckpt_path: str | None = None) -> StructuredPruning:
        L.seed_everything(0, verbose=False)
        pruning = StructuredPruning(
            amount=0.5, start_epoch=1, round_to=None, latency_batch_sizes=(), monitor="val_loss"
        )
        checkpoints = ModelCheckpoint(dirpath=root, save_top_k=-1, filename="{epoch}")
        trainer = tiny_trainer(root, max_epochs=3, callbacks=[pruning, checkpoints], enable_checkpointing=True)
        trainer.fit(OrderedTiny(), ckpt_path=ckpt_path)
        return pruning

    full = run(tmp_path / "full").report()
    resumed = run(tmp_path / "resumed", str(tmp_path / "full" / "epoch=0.ckpt")).report()
    assert full["metric_before"] is not None
    assert resumed["metric_before"] == full["metric_before"]
    assert resumed["metric_after"] == pytest.approx(full["metric_after"])
