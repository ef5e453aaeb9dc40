from __future__ import annotations

import csv
import json
import pickle
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from conftest import (
    OutlierClassifier,
    RankWriter,
    TinyClassifier,
    callback_of,
    load_benchmark,
    rank_records,
    tiny_trainer,
)
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from onnx import numpy_helper
from torch import nn
from torchmetrics.classification import MulticlassAccuracy
from typing_extensions import override

from lightning_speedkit.demo import DemoClassifier, DemoDataModule, DemoResNet
from lightning_speedkit.int8 import Int8Export, Int8VerificationError, export_int8, export_paths
from lightning_speedkit.pruning import StructuredPruning

# ---------------------------------------------------------------- helpers and models


@torch.library.custom_op("speedkit_test::mystery", mutates_args=())
def mystery(x: torch.Tensor) -> torch.Tensor:
    """An operator with no ONNX translation."""
    return x * 2


@mystery.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


class Mystery(nn.Module):
    """Calls an operator that ONNX cannot express."""

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return mystery(x)  # type: ignore[no-any-return]


class Gate(nn.Module):
    """Branches on the data, which torch.export cannot trace."""

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x if x.sum() > 0 else -x


class Wrapped(nn.Module):
    """A Linear, then ``inner`` as ``block.1``."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.block = nn.Sequential(nn.ReLU(), inner)

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(self.fc(x))  # type: ignore[no-any-return]


class StampedClassifier(DemoClassifier):
    """DemoClassifier that also logs its epoch as ``stamp``: ``monitor="stamp", mode="min"`` keeps epoch 0."""

    @override
    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        super().validation_step(batch, batch_idx)
        self.log("stamp", float(self.current_epoch))


def export_report(trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
    """The Int8Export report each rank holds after training (written by `RankWriter` to ``report_rank{r}.json``)."""
    return callback_of(trainer, Int8Export).report()


def listing(directory: Path) -> dict[str, bytes]:
    """Every file under ``directory`` (hidden ones too) with its bytes."""
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def visible(directory: Path) -> list[str]:
    """The names in ``directory`` a user sees (not the hidden pointer and export directories)."""
    return sorted(p.name for p in directory.iterdir() if not p.name.startswith("."))


def zero_points(path: str | Path) -> list[np.ndarray]:
    """The zero-point initializers of every QuantizeLinear / DequantizeLinear node."""
    model = onnx.load(str(path))
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    return [
        inits[node.input[2]]
        for node in model.graph.node
        if node.op_type in ("QuantizeLinear", "DequantizeLinear") and len(node.input) > 2 and node.input[2] in inits
    ]


def initializers(path: str | Path) -> dict[str, np.ndarray]:
    """The initializers of an ONNX model (external data loaded)."""
    return {i.name: numpy_helper.to_array(i) for i in onnx.load(str(path)).graph.initializer}


def run_ort(path: str | Path, x: torch.Tensor) -> np.ndarray:
    """The first output of the model at ``path`` on ``x`` in ONNX Runtime on CPU."""
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return np.asarray(session.run(None, {session.get_inputs()[0].name: x.numpy()})[0])


def eager_accuracy(module: nn.Module, loader: Any) -> float:
    """Top-1 accuracy of ``module`` in eval mode over ``loader``."""
    module.eval()
    correct = total = 0
    with torch.no_grad():
        for x, y in loader:
            correct += int((module(x).argmax(1) == y).sum())
            total += len(y)
    return correct / total


def mlp_data(outlier: bool = False) -> tuple[nn.Module, list[torch.Tensor], list[tuple[torch.Tensor, torch.Tensor]]]:
    """An MLP, calibration batches and labelled validation batches (labels = the FP32 argmax: accuracy 1.0).

    With ``outlier`` the calibration inputs are 1000x the validation inputs, so INT8 rounds real inputs to ~0.
    """
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4)).eval()
    x = torch.randn(64, 8)
    with torch.no_grad():
        y = net(x).argmax(1)
    return net, [x[:32] * (1000.0 if outlier else 1.0), x[32:]], [(x, y)]


# ---------------------------------------------------------------- shared exports (module scope: each takes seconds)


@pytest.fixture(scope="module")
def datamodule(demo_cache: Path) -> DemoDataModule:
    """200 demo images: 160 train, 40 validation (batches of 16)."""
    dm = DemoDataModule(num_images=200, batch_size=16, root=demo_cache)
    dm.prepare_data()
    dm.setup("fit")
    return dm


@pytest.fixture(scope="module")
def pure(tmp_path_factory: pytest.TempPathFactory, datamodule: DemoDataModule) -> dict[str, Any]:
    """`export_int8` of an untrained small DemoResNet, calibrated and verified on the demo validation set."""
    torch.manual_seed(0)
    net = DemoResNet(width=8)
    path = tmp_path_factory.mktemp("pure") / "resnet.onnx"
    metric = MulticlassAccuracy(num_classes=10, average="micro")
    report = export_int8(net, datamodule.val_dataloader(), path, metric=metric, latency_repeats=2)
    return {"net": net, "path": path, "report": report}


@pytest.fixture(scope="module")
def fitted(tmp_path_factory: pytest.TempPathFactory, datamodule: DemoDataModule) -> dict[str, Any]:
    """A 2-epoch fit of the demo classifier with a best-checkpoint (epoch 0), a CSV logger and a symmetric export."""
    root = tmp_path_factory.mktemp("fitted")
    L.seed_everything(0, verbose=False)
    model = StampedClassifier(width=8, lr=3e-3)
    checkpoint = ModelCheckpoint(dirpath=root / "ckpt", monitor="stamp", mode="min", save_top_k=1)
    export = Int8Export(root / "int8", calibration_batches=2, symmetric=True, latency_repeats=2)
    trainer = tiny_trainer(
        root,
        max_epochs=2,
        limit_train_batches=4,
        num_sanity_val_steps=0,
        enable_checkpointing=True,
        logger=CSVLogger(root, name="logs"),
        callbacks=[export, checkpoint],
    )
    trainer.fit(model, datamodule)
    return {"root": root, "model": model, "trainer": trainer, "export": export, "checkpoint": checkpoint}


# ---------------------------------------------------------------- the pure function


def test_export_int8_runs_end_to_end_in_onnx_runtime(pure: dict[str, Any], datamodule: DemoDataModule) -> None:
    """A conv net becomes a QDQ INT8 model with a dynamic batch that matches FP32 in ORT, with a complete report."""
    report, path = pure["report"], pure["path"]
    paths = export_paths(path)
    assert visible(path.parent) == sorted(p.name for key, p in paths.items() if not key.endswith("_data"))
    assert report["manifest"].keys() == {paths["fp32"].name, path.name}  # weights inline: no sidecars
    assert report["fp32_bytes"] == paths["fp32"].stat().st_size
    assert report["int8_bytes"] == path.stat().st_size
    assert report["size_ratio"] == pytest.approx(report["fp32_bytes"] / report["int8_bytes"])
    assert json.loads(paths["report"].read_text()) == report
    assert report["opset"] == 20
    ops = {node.op_type for node in onnx.load(str(path)).graph.node}
    assert {"QuantizeLinear", "DequantizeLinear", "Conv"} <= ops
    assert report["quantization"] | {"calibration_batches": 3, "calibration_samples": 40} == report["quantization"]
    assert set(report["latency"]) == {"threads", "repeats", "batch_1", "batch_32"}

    x = torch.randn(5, 3, 56, 56)
    with torch.no_grad():
        expected = pure["net"].eval()(x).numpy()
    np.testing.assert_allclose(run_ort(paths["fp32"], x), expected, atol=1e-4)
    int8_out = run_ort(path, x)  # batch 5: the batch dimension is dynamic
    assert int8_out.shape == (5, 10)
    assert np.abs(int8_out - expected).max() < 0.1 * np.abs(expected).max()

    verification = report["verification"]
    assert verification["samples"] == 40
    assert verification["top1_agreement"] >= 0.9
    assert verification["metric"] == "MulticlassAccuracy"
    assert verification["metric_fp32"] == pytest.approx(eager_accuracy(pure["net"], datamodule.val_dataloader()))
    assert report["passed"] is True


@pytest.mark.parametrize(
    ("fixture", "symmetric", "activations"), [("pure", False, "QUInt8"), ("fitted", True, "QInt8")]
)
def test_symmetric_mode_gives_only_zero_zero_points(
    fixture: str, symmetric: bool, activations: str, request: pytest.FixtureRequest
) -> None:
    """``symmetric=True`` gives int8 activations and only zero zero points (TensorRT's rule); the default does not."""
    value = request.getfixturevalue(fixture)
    report = value["report"] if fixture == "pure" else value["export"].report()
    points = zero_points(report["int8_path"])
    assert len(points) > 10
    assert report["quantization"]["activation_symmetric"] is symmetric
    assert report["quantization"]["activation_type"] == activations
    assert all(not p.any() for p in points) is symmetric
    assert any(p.dtype == np.uint8 for p in points) is not symmetric  # activations; biases are int32 either way


def test_default_int8_model_runs_on_integer_kernels(pure: dict[str, Any], tmp_path: Path) -> None:
    """With the default (asymmetric uint8 activations) ONNX Runtime fuses every Conv into a QLinearConv."""
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(pure["report"]["int8_path"], options, providers=["CPUExecutionProvider"])
    ops = [node.op_type for node in onnx.load(str(tmp_path / "optimized.onnx")).graph.node]
    assert ops.count("QLinearConv") == 9  # stem + 2 per block x 3 + 2 shortcut projections
    assert "Conv" not in ops


@pytest.mark.parametrize(
    ("inner", "match"),
    [
        (Mystery(), r"operator `speedkit_test.mystery` in layer `block.1` \(Mystery\)"),
        (Gate(), r"torch.export could not trace .* in layer `block.1` \(Gate\)"),
    ],
)
def test_failed_export_names_the_layer_and_leaves_the_directory_untouched(
    tmp_path: Path, inner: nn.Module, match: str
) -> None:
    """An export that fails names the operator or layer, and the directory (a previous export too) is unchanged."""
    for name, content in (("model.onnx", b"previous"), ("model.json", b"{}"), ("notes.txt", b"mine")):
        (tmp_path / name).write_bytes(content)
    before = listing(tmp_path)
    with pytest.raises(RuntimeError, match=match):
        export_int8(Wrapped(inner), [torch.randn(4, 8)], tmp_path / "model.onnx", overwrite=True)
    assert listing(tmp_path) == before


def test_existing_export_is_kept_unless_overwrite(tmp_path: Path) -> None:
    """A second export to the same path raises and changes nothing; ``overwrite=True`` replaces it completely."""
    net, calibration, validation = mlp_data()
    path = tmp_path / "mlp.onnx"
    first = export_int8(net, calibration, path, validation_data=validation, latency_repeats=0)
    before = listing(tmp_path)
    with pytest.raises(FileExistsError, match="overwrite=True"):
        export_int8(net, calibration, path, latency_repeats=0)
    assert listing(tmp_path) == before

    second = export_int8(net, calibration, path, symmetric=True, keep_fp32=False, overwrite=True, latency_repeats=0)
    assert visible(tmp_path) == ["mlp.json", "mlp.onnx"]  # the old FP32 files went too
    assert first["fp32_path"] is not None
    assert second["fp32_path"] is None
    assert json.loads((tmp_path / "mlp.json").read_text())["quantization"]["activation_symmetric"] is True


@pytest.mark.parametrize("on_metric_drop", ["warn", "raise"])
def test_metric_drop_beyond_the_limit_warns_or_raises(tmp_path: Path, on_metric_drop: str) -> None:
    """A badly calibrated model loses accuracy: ``warn`` writes and says by how much, ``raise`` writes nothing."""
    net, calibration, validation = mlp_data(outlier=True)
    kwargs: dict[str, Any] = {"validation_data": validation, "max_metric_drop": 0.01, "latency_repeats": 0}
    path = tmp_path / "mlp.onnx"
    if on_metric_drop == "raise":
        with pytest.raises(Int8VerificationError, match=r"a drop of \d\.\d+, more than max_metric_drop=0.01") as info:
            export_int8(net, calibration, path, on_metric_drop="raise", **kwargs)
        assert list(tmp_path.iterdir()) == []
        report = info.value.report
    else:
        with pytest.warns(UserWarning, match=r"top1_accuracy is 0\.\d+ vs FP32 1\.0000 .* a drop of"):
            report = export_int8(net, calibration, path, **kwargs)
        assert path.is_file()
    assert report["passed"] is False
    assert report["verification"]["metric_fp32"] == 1.0
    assert report["metric_drop"] > 0.2


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [
        ({"calibration_batches": 0}, "calibration_batches"),
        ({"max_metric_drop": -0.1}, "max_metric_drop"),
        ({"on_metric_drop": "ignore"}, "on_metric_drop"),
        ({"verify_batches": 0}, "verify_batches"),
        ({"latency_batch_size": 0}, "latency_batch_size"),
        ({"latency_repeats": -1}, "latency_repeats"),
        ({"num_threads": 1.5}, "num_threads"),
        ({"path": "model.pt"}, "path"),
        ({"activation_type": "fp8"}, "activation_type"),
        ({"symmetric": True, "activation_type": "uint8"}, "activation_type"),
    ],
)
def test_export_int8_rejects_bad_arguments(tmp_path: Path, kwargs: dict[str, Any], argument: str) -> None:
    """Each bad argument is refused with its name before any work is done."""
    arguments: dict[str, Any] = {"path": tmp_path / "m.onnx", **kwargs}
    with pytest.raises(ValueError, match=f"`{argument}`"):
        export_int8(nn.Linear(2, 2), [torch.zeros(2, 2)], **arguments)
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------- the callback


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [
        ({"calibration_batches": 0}, "calibration_batches"),
        ({"max_metric_drop": -1}, "max_metric_drop"),
        ({"on_metric_drop": "fail"}, "on_metric_drop"),
        ({"filename": "model.pt"}, "filename"),
        ({"filename": "sub/model.onnx"}, "filename"),
        ({"latency_batch_size": 0}, "latency_batch_size"),
        ({"symmetric": True, "activation_type": "uint8"}, "activation_type"),
        ({"symmetric": "yes"}, "symmetric"),
        ({"verify": 1}, "verify"),
        ({"overwrite": "no"}, "overwrite"),
        ({"use_best_checkpoint": None}, "use_best_checkpoint"),
    ],
)
def test_callback_rejects_bad_arguments(kwargs: dict[str, Any], argument: str) -> None:
    """The callback checks its arguments in ``__init__`` and names the bad one."""
    with pytest.raises(ValueError, match=f"`{argument}`"):
        Int8Export(**kwargs)


def test_a_non_bool_symmetric_is_refused_with_its_value() -> None:
    """``symmetric="yes"`` is not taken as true: the error names ``symmetric`` and the value received."""
    with pytest.raises(ValueError, match=r"`symmetric` must be True or False, got 'yes'\."):
        Int8Export(symmetric="yes")  # type: ignore[arg-type]


def test_report_before_an_export_says_nothing_was_exported(tmp_path: Path) -> None:
    """``report()`` is a method that returns a dict before any fit (``exported: False``), like every callback's."""
    report = Int8Export(tmp_path).report()
    assert report["exported"] is False
    assert "end of fit" in report["reason"]


def test_callback_exports_the_best_checkpoint(fitted: dict[str, Any], datamodule: DemoDataModule) -> None:
    """At the end of fit the best checkpoint's weights (not the last) are exported and verified with val_acc."""
    report, best = fitted["export"].report(), fitted["checkpoint"].best_model_path
    assert "epoch=0" in best
    assert report["weights"] == f"best checkpoint {best}"
    best_model = StampedClassifier(width=8)
    best_model.load_state_dict(torch.load(best, weights_only=True)["state_dict"])
    x = next(iter(datamodule.val_dataloader()))[0]
    with torch.no_grad():
        expected, final = best_model.eval()(x).numpy(), fitted["model"].eval()(x).numpy()
    exported = run_ort(report["fp32_path"], x)
    np.testing.assert_allclose(exported, expected, atol=1e-4)
    assert np.abs(exported - final).max() > 1e-3  # the final weights differ: the test can tell them apart
    verification = report["verification"]
    assert verification["metric"] == "MulticlassAccuracy"  # the module's own val_acc
    assert verification["metric_fp32"] == pytest.approx(eager_accuracy(best_model, datamodule.val_dataloader()))
    assert verification["samples"] == 40
    assert report["quantization"]["calibration_batches"] == 2


def test_callback_writes_the_report_and_logs_metrics(fitted: dict[str, Any]) -> None:
    """The report JSON sits beside the model and the numbers are logged under ``speedkit/int8/``."""
    report = fitted["export"].report()
    assert report.pop("exported") is True
    assert json.loads(Path(report["report_path"]).read_text()) == report
    assert Path(report["report_path"]).parent == fitted["root"] / "int8"
    with open(Path(fitted["trainer"].logger.log_dir) / "metrics.csv") as handle:
        rows = [row for row in csv.DictReader(handle) if row.get("speedkit/int8/size_ratio")]
    assert len(rows) == 1
    assert float(rows[0]["speedkit/int8/size_ratio"]) == pytest.approx(report["size_ratio"])
    for key in ("int8_mb", "speedup_b1", "latency_int8_b32_ms", "top1_agreement", "metric_drop"):
        assert rows[0][f"speedkit/int8/{key}"] != ""


@pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`, callbacks used to create the checkpoint")
@pytest.mark.filterwarnings("ignore:Checkpoint directory .* exists and is not empty")
def test_resume_exports_the_same_model_as_the_uninterrupted_run(
    fitted: dict[str, Any], datamodule: DemoDataModule
) -> None:
    """Resumed from the epoch-0 checkpoint, the fit exports the same INT8 model beside the first, never over it."""
    root, first = fitted["root"], fitted["export"].report()
    before = listing(root / "int8")
    L.seed_everything(1, verbose=False)  # the resumed epoch trains differently; the best checkpoint stays epoch 0
    export = Int8Export(root / "int8", calibration_batches=2, symmetric=True, latency_repeats=2)
    trainer = tiny_trainer(
        root / "resumed",
        max_epochs=2,
        limit_train_batches=4,
        num_sanity_val_steps=0,
        enable_checkpointing=True,
        callbacks=[export, ModelCheckpoint(dirpath=root / "ckpt", monitor="stamp", mode="min", save_top_k=1)],
    )
    trainer.fit(StampedClassifier(width=8, lr=3e-3), datamodule, ckpt_path=fitted["checkpoint"].best_model_path)
    second = export.report()
    assert second["exported"] is True
    assert Path(second["int8_path"]).name == "model-v1.onnx"
    assert {k: v for k, v in listing(root / "int8").items() if k in before} == before
    assert second["weights"] == first["weights"]
    assert second["verification"] == first["verification"]
    a, b = initializers(first["int8_path"]), initializers(second["int8_path"])
    assert a.keys() == b.keys()
    assert all(np.array_equal(a[k], b[k]) for k in a)
    restored = Int8Export(root / "int8")
    restored.load_state_dict(pickle.loads(pickle.dumps(export.state_dict())))
    assert restored.report() == second


def test_pruned_model_is_exported_after_fine_tuning(tmp_path: Path, datamodule: DemoDataModule) -> None:
    """Prune, fine-tune and INT8 in one fit: the unpruned best checkpoint no longer fits, so the pruned weights go."""
    L.seed_everything(0, verbose=False)
    model = StampedClassifier(width=8, lr=3e-3)
    pruning = StructuredPruning(amount=0.5, start_epoch=1, finetune_epochs=1, round_to=None, latency_batch_sizes=())
    export = Int8Export(tmp_path / "int8", calibration_batches=2, latency_repeats=0)
    trainer = tiny_trainer(
        tmp_path,
        max_epochs=3,
        limit_train_batches=4,
        num_sanity_val_steps=0,
        enable_checkpointing=True,
        callbacks=[pruning, export, ModelCheckpoint(dirpath=tmp_path, monitor="stamp", mode="min")],
    )
    with pytest.warns(UserWarning, match="does not fit the module any more .* size mismatch for model"):
        trainer.fit(model, datamodule)
    report = export.report()
    assert report["exported"] is True
    assert report["weights"] == "final weights"
    unpruned = DemoResNet(width=8).state_dict()
    exported = initializers(report["fp32_path"])
    assert sum(a.size for a in exported.values()) < 0.4 * sum(t.numel() for t in unpruned.values())
    x = next(iter(datamodule.val_dataloader()))[0]
    assert run_ort(report["int8_path"], x).shape == (16, 10)
    assert report["verification"]["top1_agreement"] >= 0.8
    with torch.no_grad():  # the final weights, whole: not those the checkpoint's matching shapes overwrote
        final = model.eval()(x).numpy()
    assert np.abs(run_ort(report["fp32_path"], x) - final).max() < 1e-4


@pytest.mark.parametrize("on_metric_drop", ["warn", "raise"])
def test_callback_reports_a_metric_drop_once_or_fails(tmp_path: Path, on_metric_drop: str) -> None:
    """Past ``max_metric_drop`` the callback warns once in its own name (and writes), or fails the fit (no files)."""
    L.seed_everything(0, verbose=False)
    export = Int8Export(tmp_path / "int8", calibration_batches=1, latency_repeats=0, on_metric_drop=on_metric_drop)
    trainer = tiny_trainer(tmp_path, max_epochs=3, num_sanity_val_steps=0, callbacks=[export])
    if on_metric_drop == "raise":
        with pytest.raises(Int8VerificationError, match=r"more than max_metric_drop=0\.01"):
            trainer.fit(OutlierClassifier())
        assert list((tmp_path / "int8").iterdir()) == []  # the staging directory went too
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(OutlierClassifier())
    drops = [str(w.message) for w in caught if "max_metric_drop" in str(w.message)]
    assert len(drops) == 1
    assert drops[0].startswith("Int8Export: FAILED its accuracy target: INT8 top1_accuracy is ")
    assert export.report()["exported"] is True
    assert export.report()["passed"] is False
    assert (tmp_path / "int8" / "model.onnx").is_file()


def test_setup_rejects_a_metric_the_module_lacks(tmp_path: Path, tiny_model: TinyClassifier) -> None:
    """``metric`` must name a torchmetrics attribute of the module; the check runs before training."""
    trainer = tiny_trainer(tmp_path, callbacks=[Int8Export(tmp_path, metric="val_f1")])
    with pytest.raises(ValueError, match="`metric='val_f1'`"):
        trainer.fit(tiny_model)
    assert not (tmp_path / "model.onnx").exists()


def test_wandb_logger_gets_the_metrics(
    tmp_path: Path, tiny_model: TinyClassifier, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a (disabled) W&B logger the metrics land in the run summary and the artifact step does not fail."""
    from lightning.pytorch.loggers import WandbLogger

    monkeypatch.setenv("WANDB_MODE", "disabled")
    logger = WandbLogger(save_dir=str(tmp_path))
    export = Int8Export(tmp_path / "int8", latency_repeats=1)
    tiny_trainer(tmp_path, logger=logger, callbacks=[export]).fit(tiny_model)
    summary = dict(logger.experiment.summary)
    assert summary["speedkit/int8/size_ratio"] == pytest.approx(export.report()["size_ratio"])
    assert "speedkit/int8/metric_fp32" in summary


@pytest.mark.slow
@pytest.mark.ddp
def test_ddp_only_rank_zero_exports_and_every_rank_gets_the_report(tmp_path: Path) -> None:
    """Under 2-process DDP one export is written (by rank 0) and both ranks end with the same report."""
    L.seed_everything(0, verbose=False)
    tiny_trainer(
        tmp_path,
        strategy="ddp_spawn",
        devices=2,
        callbacks=[
            Int8Export(tmp_path / "int8", latency_repeats=1),
            RankWriter(tmp_path, export_report, prefix="report_rank"),
        ],
    ).fit(TinyClassifier())
    assert visible(tmp_path / "int8") == ["model.fp32.onnx", "model.json", "model.onnx"]
    reports = rank_records(tmp_path, prefix="report_rank")
    assert reports[0] == reports[1] == json.loads((tmp_path / "int8" / "model.json").read_text()) | {"exported": True}
    assert reports[0]["verification"]["samples"] == 64  # the whole validation set, not rank 0's shard


# ---------------------------------------------------------------- the benchmark


@pytest.mark.slow
def test_benchmark_quick_mode_writes_its_table(tmp_path: Path, demo_cache: Path) -> None:
    """``benchmarks/int8.py --quick`` runs every workload on this CPU and under a forced AVX2 ISA, and the formats."""
    module = load_benchmark("int8")
    out = tmp_path / "int8.json"
    results = module.main(["--quick", "--out", str(out), "--cache-dir", str(demo_cache)])
    assert json.loads(out.read_text()) == results
    assert [run["isa_pass"] for run in results["runs"]] == ["native", "avx2"]
    assert results["runs"][1]["environment"] == {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    assert "avx512f" not in results["runs"][1]["cpu"]["flags"]
    for run in results["runs"]:
        assert [row["workload"] for row in run["rows"]] == ["conv", "depthwise", "encoder"]
        for row in run["rows"]:
            assert row["size_ratio"] > 1.2
            assert 0.0 <= row["top1_agreement"] <= 1.0
            assert row["int8_format"].startswith(("U8S8", "S8S8"))
        assert run["rows"][-1]["input_names"] == ["input_ids", "attention_mask"]
    formats = results["runs"][0]["formats"]
    assert set(formats) == {"conv", "depthwise", "encoder"}
    assert set(formats["conv"]) >= set(module.FORMATS) | {"FP32"}


@pytest.mark.parametrize("export_first", [True, False])
def test_a_weight_average_is_exported_whichever_comes_first_in_the_list(tmp_path: Path, export_first: bool) -> None:
    """With a `WeightAverage`, the export holds the average the module ends the fit with, in either callback order.

    Before, an `Int8Export` listed first exported at its ``on_train_end``, before the average went in: the trained
    weights, while the module (and README) ended with the average.
    """
    from lightning_speedkit import WeightAverage

    L.seed_everything(0, verbose=False)
    model = TinyClassifier(num_samples=64)
    average, export = WeightAverage(decay=0.9), Int8Export(tmp_path / "int8", latency_repeats=0, max_metric_drop=None)
    trainer = tiny_trainer(tmp_path, max_epochs=2, callbacks=[export, average] if export_first else [average, export])
    trainer.fit(model)
    x = torch.randn(5, 16)
    with torch.no_grad():
        ended_with = model.eval()(x).numpy()
        trained = TinyClassifier()
        trained.load_state_dict(dict(zip(average._names, average._after_fit or [], strict=True)))
        trained_out = trained.eval()(x).numpy()
    exported = run_ort(export.report()["fp32_path"], x)
    # the average and the trained weights can be told apart (put in twice, the average would be both)
    assert np.abs(ended_with - trained_out).max() > 1e-3
    np.testing.assert_allclose(exported, ended_with, atol=1e-5)


def test_the_export_follows_a_guard_rollback_judged_at_the_fit_end(tmp_path: Path) -> None:
    """Listed first, the export settles the guard's last check, then the average: it holds the weights put back.

    The average went in before the guard judged the last (NaN) step and rolled it back: the export held a NaN average
    while the module ended with the weights put back.
    """
    from lightning_speedkit import TrainingGuard, WeightAverage

    class _BreaksLastStep(TinyClassifier):
        @override
        def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
            loss = super().training_step(batch, batch_idx)
            return loss * float("nan") if self.trainer.global_step == 4 else loss

    L.seed_everything(0, verbose=False)
    model = _BreaksLastStep(num_samples=64)
    guard, average = TrainingGuard(every_n_steps=2, check_every_n_steps=5), WeightAverage(decay=0.5)
    export = Int8Export(tmp_path / "int8", latency_repeats=0, max_metric_drop=None)
    trainer = tiny_trainer(tmp_path, max_steps=5, callbacks=[export, guard, average])
    trainer.fit(model)
    assert guard.report()["rollbacks"] == 1
    x = torch.randn(5, 16)
    with torch.no_grad():
        ended_with = model.eval()(x).numpy()
    assert np.isfinite(ended_with).all()
    np.testing.assert_allclose(run_ort(export.report()["fp32_path"], x), ended_with, atol=1e-5)


def test_a_one_logit_binary_classifier_gets_no_top1_verdict(tmp_path: Path) -> None:
    """One output column (a binary logit) has no argmax to compare: agreement and accuracy are not reported.

    Argmax over one column is always 0, so "top-1 agreement" was always 1.0 and "top1_accuracy" the share of label 0:
    ``min_agreement`` and ``max_metric_drop`` passed whatever the INT8 model did.
    """
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))
    x = torch.randn(256, 4)
    data = [(x[i : i + 64], (x[i : i + 64, 0] > 0).long()) for i in range(0, 256, 64)]
    report = export_int8(net, data, tmp_path / "m.onnx", latency_repeats=0, min_agreement=0.99, max_metric_drop=0.01)
    checked = report["verification"]
    assert (checked["top1_agreement"], checked["metric"], checked["metric_fp32"]) == (None, None, None)
    assert checked["samples"] == 256
    assert "agreement n/a" in report["status"]


def test_a_metric_of_a_one_logit_model_gets_the_output_squeezed_as_its_validation_step_does(tmp_path: Path) -> None:
    """A ``(batch, 1)`` output is checked by a metric of ``(batch,)`` targets; a metric that refuses it is named.

    ``validation_step`` squeezes a binary logit or a regression before its metric; the export fed the metric the raw
    ``(batch, 1)`` output and the fit ended in torchmetrics' shape error, after training, with nothing exported.
    """
    from torchmetrics import MeanSquaredError
    from torchmetrics.classification import BinaryAccuracy

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))
    x = torch.randn(256, 4)
    data = [(x[i : i + 64], (x[i : i + 64, 0] > 0).long()) for i in range(0, 256, 64)]
    report = export_int8(net, data, tmp_path / "m.onnx", latency_repeats=0, metric=BinaryAccuracy())
    with torch.no_grad():
        expected = BinaryAccuracy()(net(x).squeeze(-1), (x[:, 0] > 0).long())
    assert report["verification"]["metric"] == "BinaryAccuracy"
    assert report["verification"]["metric_fp32"] == pytest.approx(float(expected))
    pairs = [(inputs, torch.zeros(len(inputs), 2)) for inputs, _ in data]  # two targets a sample, one output
    with pytest.raises(
        ValueError, match=r"MeanSquaredError \(`metric`\) refused the model's output of shape \(64, 1\)"
    ):
        export_int8(net, pairs, tmp_path / "n.onnx", latency_repeats=0, metric=MeanSquaredError())
    assert not (tmp_path / "n.onnx").exists()


class _FixedBatch(nn.Module):
    """A forward that reads the batch size as a Python int (``len(x)``): traced, it is a constant."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(16, 4)

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x.view(len(x), 2, 8).flatten(1))


def test_an_export_that_fixes_the_batch_size_says_so_and_how_to_write_it(tmp_path: Path) -> None:
    """The reason torch gives (a dynamic batch specialised to a constant) reaches the error, with the usual fix.

    Only the first line of torch's message came through: "Constraints violated (batch)!", with no reason.
    """
    data = [(torch.randn(16, 16), torch.randint(0, 4, (16,))) for _ in range(2)]
    with pytest.raises(RuntimeError, match=r"specialized it to be a constant \(16\).*use `x\.view\(-1, \.\.\.\)`"):
        export_int8(_FixedBatch(), data, tmp_path / "m.onnx", latency_repeats=0)
    assert list(tmp_path.iterdir()) == []
