"""INT8 export of models with several inputs, and accuracy-aware INT8 (layers kept in FP32 to meet a budget)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F
from conftest import outlier_mlp, tiny_trainer
from torch import nn
from torch.utils.data import DataLoader, Dataset
from typing_extensions import override

from lightning_speedkit.int8 import Int8Export, Int8VerificationError, export_int8, named_inputs

# ---------------------------------------------------------------- a two-input text encoder


class TwoInputEncoder(nn.Module):
    """Token and position embeddings, one self-attention layer with a padding mask, a feed-forward and a head."""

    def __init__(self, vocab: int = 40, dim: int = 32, heads: int = 4, max_len: int = 24, classes: int = 3) -> None:
        super().__init__()
        self.heads = heads
        self.word, self.position = nn.Embedding(vocab, dim), nn.Embedding(max_len, dim)
        self.query, self.key, self.value = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.out, self.norm1 = nn.Linear(dim, dim), nn.LayerNorm(dim)
        self.ff = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        self.norm2, self.classifier = nn.LayerNorm(dim), nn.Linear(dim, classes)

    def _split(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(x.shape[0], x.shape[1], self.heads, -1).transpose(1, 2)

    @override
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        h = self.word(input_ids) + self.position(positions)[None]
        q, k, v = self._split(self.query(h)), self._split(self.key(h)), self._split(self.value(h))
        bias = (1.0 - attention_mask[:, None, None, :].float()) * -1e4
        scores = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5 + bias
        context = (scores.softmax(-1) @ v).transpose(1, 2).reshape(h.shape)
        h = self.norm1(h + self.out(context))
        h = self.norm2(h + self.ff(h))
        pooled = (h * attention_mask[..., None]).sum(1) / attention_mask.sum(1, keepdim=True).clamp(min=1)
        return self.classifier(pooled)  # type: ignore[no-any-return]


def text_batches(n_batches: int, batch: int = 8, length: int = 12, seed: int = 0) -> list[tuple[torch.Tensor, ...]]:
    """``(input_ids, attention_mask, labels)`` batches; padded tails are masked out, labels follow the tokens."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n_batches):
        ids = torch.randint(1, 40, (batch, length), generator=g)
        mask = torch.ones(batch, length, dtype=torch.long)
        mask[batch // 2 :, length - 4 :] = 0
        out.append((ids, mask, ids[:, 0] % 3))
    return out


def two_inputs(batch: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """The encoder's inputs of a ``(input_ids, attention_mask, labels)`` batch."""
    return batch[0], batch[1]


@pytest.fixture(scope="module")
def encoder_export(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The two-input encoder exported to INT8 from tuple batches, with ``inputs_from_batch``."""
    torch.manual_seed(0)
    model = TwoInputEncoder().eval()
    path = tmp_path_factory.mktemp("encoder") / "encoder.onnx"
    report = export_int8(model, text_batches(4), path, inputs_from_batch=two_inputs, latency_repeats=2)
    return {"model": model, "path": path, "report": report}


# ---------------------------------------------------------------- multi-input export


def test_two_input_encoder_exports_to_int8_and_verifies_in_onnx_runtime(encoder_export: dict[str, Any]) -> None:
    """Inputs are named after forward's parameters, batch and sequence are dynamic, and INT8 tracks FP32 in ORT."""
    report, model = encoder_export["report"], encoder_export["model"]
    assert report["input_names"] == ["input_ids", "attention_mask"]
    assert report["dynamic_axes"] == {"input_ids": [0, 1], "attention_mask": [0, 1]}
    assert report["verification"]["samples"] == 32
    assert report["verification"]["metric"] == "top1_accuracy"  # labels came from the batch's last item
    assert set(report["latency"]) == {"threads", "repeats", "batch_1", "batch_32"}
    session = ort.InferenceSession(str(encoder_export["path"]), providers=["CPUExecutionProvider"])
    assert [i.shape for i in session.get_inputs()] == [["batch", "sequence"], ["batch", "sequence"]]
    ids, mask, _ = text_batches(1, batch=5, length=17, seed=7)[0]  # another batch size and sequence length
    int8 = session.run(None, {"input_ids": ids.numpy(), "attention_mask": mask.numpy()})[0]
    with torch.no_grad():
        expected = model(ids, mask).numpy()
    assert int8.shape == (5, 3)
    assert np.abs(int8 - expected).max() < 0.1 * np.abs(expected).max() + 0.05


@pytest.mark.parametrize(
    "example",
    [
        pytest.param(lambda ids, mask: (ids, mask), id="tuple"),
        pytest.param(lambda ids, mask: {"attention_mask": mask, "input_ids": ids}, id="dict"),
    ],
)
def test_tuple_and_dict_examples_name_the_inputs_alike(tmp_path: Path, example: Any) -> None:
    """A positional tuple or a dict by name (in any order) gives the same ONNX inputs, in forward's order."""
    torch.manual_seed(0)
    ids, mask, _ = text_batches(1)[0]
    report = export_int8(
        TwoInputEncoder(),
        text_batches(2),
        tmp_path / "m.onnx",
        example_input=example(ids, mask),
        inputs_from_batch=lambda batch: {"input_ids": batch[0], "attention_mask": batch[1]},
        latency_repeats=0,
    )
    assert report["input_names"] == ["input_ids", "attention_mask"]


def test_named_inputs_fill_from_the_signature() -> None:
    """A single tensor names forward's first parameter; defaults need not be given."""

    class WithDefault(nn.Module):
        @override
        def forward(self, pixels: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
            return pixels * scale

    assert list(named_inputs(WithDefault(), torch.zeros(2, 3))) == ["pixels"]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"inputs_from_batch": lambda b: b[0]}, r"`inputs_from_batch` must match forward\(input_ids, attention_mask\)"),
        ({"inputs_from_batch": lambda b: b}, r"`inputs_from_batch` .* it takes 2 inputs, got a tuple of 3"),
        ({"inputs_from_batch": lambda b: (b[0], b[1].numpy())}, r"input 'attention_mask' must be a tensor"),
        ({"example_input": {"ids": torch.zeros(2, 4, dtype=torch.long)}}, r"`example_input` .* no parameter 'ids'"),
        ({"example_input": (torch.zeros(2, 4, dtype=torch.long),)}, r"`example_input` .* 'attention_mask' is missing"),
        ({"inputs_from_batch": 3}, r"`inputs_from_batch` must be a function of the batch or None, got 3"),
    ],
)
def test_inputs_that_do_not_fit_forward_are_refused_before_writing(
    tmp_path: Path, kwargs: dict[str, Any], match: str
) -> None:
    """Wrong number, type or names of inputs raise ValueError naming the argument; nothing is written."""
    kwargs.setdefault("inputs_from_batch", two_inputs)
    with pytest.raises(ValueError, match=match):
        export_int8(TwoInputEncoder(), text_batches(2), tmp_path / "m.onnx", latency_repeats=0, **kwargs)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        (lambda b: (b[0],), r"`inputs_from_batch` must match forward.* 'attention_mask' is missing, got a tuple of 1"),
        (lambda b: (b[0], b[1].int()), r"`inputs_from_batch` must give the inputs \(input_ids: int64, attention_mask"),
    ],
)
def test_a_later_batch_with_other_inputs_is_refused(tmp_path: Path, bad: Any, match: str) -> None:
    """Every batch is checked against the first: a missing input or another dtype names `inputs_from_batch`."""
    calls: list[int] = []

    def inputs(batch: tuple[torch.Tensor, ...]) -> Any:
        calls.append(1)
        return two_inputs(batch) if len(calls) == 1 else bad(batch)

    with pytest.raises(ValueError, match=match):
        export_int8(TwoInputEncoder(), text_batches(3), tmp_path / "m.onnx", inputs_from_batch=inputs)
    assert list(tmp_path.iterdir()) == []


class TextClassifier(L.LightningModule):
    """The encoder in a LightningModule fed dict batches ``{"input_ids", "attention_mask", "labels"}``."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = TwoInputEncoder()

    @override
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.encoder(input_ids, attention_mask)  # type: ignore[no-any-return]

    @override
    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return F.cross_entropy(self(batch["input_ids"], batch["attention_mask"]), batch["labels"])

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def _loader(self, seed: int) -> DataLoader[Any]:
        rows = [
            {"input_ids": ids[i], "attention_mask": mask[i], "labels": y[i]}
            for ids, mask, y in text_batches(2, seed=seed)
            for i in range(len(y))
        ]
        return DataLoader(_Rows(rows), batch_size=8)

    @override
    def train_dataloader(self) -> DataLoader[Any]:
        return self._loader(0)

    @override
    def val_dataloader(self) -> DataLoader[Any]:
        return self._loader(1)


class _Rows(Dataset[Any]):
    def __init__(self, rows: list[dict[str, torch.Tensor]]) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    @override
    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return self.rows[index]


def test_callback_exports_a_model_fed_dict_batches(tmp_path: Path) -> None:
    """Int8Export with ``inputs_from_batch`` calibrates and verifies on dict batches, their ``labels`` the target."""
    L.seed_everything(0, verbose=False)
    export = Int8Export(
        tmp_path / "int8",
        calibration_batches=2,
        latency_repeats=0,
        max_metric_drop=None,
        inputs_from_batch=lambda batch: {k: batch[k] for k in ("input_ids", "attention_mask")},
    )
    tiny_trainer(tmp_path, max_epochs=1, callbacks=[export], num_sanity_val_steps=0).fit(TextClassifier())
    report = export.report()
    assert report["exported"] is True
    assert report["input_names"] == ["input_ids", "attention_mask"]
    assert report["verification"]["samples"] == 16
    assert report["verification"]["metric"] == "top1_accuracy"
    assert json.loads(Path(report["report_path"]).read_text())["input_names"] == report["input_names"]


# ---------------------------------------------------------------- accuracy-aware INT8


@pytest.mark.parametrize("budget", [{"max_metric_drop": 0.01}, {"min_agreement": 0.98}])
def test_accuracy_aware_mode_ends_within_the_budget_and_reports_fp32_layers(
    tmp_path: Path, budget: dict[str, float]
) -> None:
    """The all-INT8 model misses the budget; keeping the sensitive layers in FP32 meets it, at a reported cost."""
    net, data = outlier_mlp()
    # 8-bit weights, as on the CPU this was written for: which layers the greedy search keeps depends on the format
    kwargs = {"max_fp32_layers": 3, "latency_repeats": 2, "reduce_range": False}
    report = export_int8(net, data, tmp_path / "mlp.onnx", **kwargs, **budget)
    aware = report["accuracy_aware"]
    assert aware["all_int8"]["top1_agreement"] < 0.5  # the first INT8 model missed the budget by far
    assert report["passed"] is True
    assert aware["met"] is True
    assert report["verification"]["top1_agreement"] >= 0.98
    assert 1 <= len(aware["fp32_layers"]) <= 3
    assert {layer["layer"] for layer in aware["fp32_layers"]} >= {"2"}  # the Linear that reads the outlier channel
    assert aware["cost"]["int8_bytes"] > 0  # FP32 weights take more room
    assert aware["cost"]["latency_ms_b1"] is not None
    assert json.loads((tmp_path / "mlp.json").read_text())["accuracy_aware"]["fp32_layers"] == aware["fp32_layers"]


def test_accuracy_aware_mode_stops_at_the_limit_and_raises_if_asked(tmp_path: Path) -> None:
    """With room for one FP32 layer the budget cannot be met: the limit stops it and ``raise`` writes nothing."""
    net, data = outlier_mlp()
    with pytest.raises(
        Int8VerificationError, match=r"even with \d layer\(s\) kept in FP32 \(max_fp32_layers=1\)"
    ) as info:
        export_int8(net, data, tmp_path / "mlp.onnx", min_agreement=0.98, max_fp32_layers=1, on_metric_drop="raise")
    assert list(tmp_path.iterdir()) == []
    aware = info.value.report["accuracy_aware"]
    assert aware["met"] is False
    assert len(aware["fp32_layers"]) <= 1


def test_accuracy_aware_mode_is_off_with_no_fp32_layers_allowed(tmp_path: Path) -> None:
    """``max_fp32_layers=0`` keeps the old behaviour: one INT8 model, a warning that it misses the budget."""
    net, data = outlier_mlp()
    with pytest.warns(UserWarning, match=r"top-1 agreement with FP32 is 0\.\d+, less than min_agreement=0\.98"):
        report = export_int8(net, data, tmp_path / "mlp.onnx", min_agreement=0.98, max_fp32_layers=0)
    assert report["accuracy_aware"] is None
    assert report["passed"] is False


# ---------------------------------------------------------------- a weight tied between two layers


class TiedLanguageModel(nn.Module):
    """An embedding and the output projection share one weight, as in most language models."""

    def __init__(self, vocab: int = 20, dim: int = 16) -> None:
        super().__init__()
        self.embed, self.mix, self.decode = nn.Embedding(vocab, dim), nn.Linear(dim, dim), nn.Linear(dim, vocab, False)
        self.decode.weight = self.embed.weight

    @override
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.decode(torch.relu(self.mix(self.embed(ids).mean(1))))


@pytest.mark.parametrize("verify", [True, False])
def test_a_tied_weight_is_quantized_per_reader_and_the_int8_model_runs(tmp_path: Path, verify: bool) -> None:
    """A weight an Embedding and a Linear share gets a copy per reader before quantization, and the model runs.

    ONNX Runtime's quantizer gave the Linear's per-channel scale to the Gather's output: with ``verify`` the export
    failed inside ONNX Runtime, without it an INT8 model that cannot run was written.
    """
    torch.manual_seed(0)
    data = [(torch.randint(0, 20, (32, 6)), torch.randint(0, 20, (32,))) for _ in range(3)]
    report = export_int8(TiedLanguageModel(), data, tmp_path / "tied.onnx", latency_repeats=0, verify=verify)
    assert report["preprocess"]["untied"] == ["decode.weight"]
    session = ort.InferenceSession(report["int8_path"], providers=["CPUExecutionProvider"])
    assert session.run(None, {"ids": data[0][0].numpy()})[0].shape == (32, 20)
    if verify:
        assert report["verification"]["top1_agreement"] > 0.9


def test_an_int8_model_onnx_runtime_cannot_run_is_refused_by_name(tmp_path: Path) -> None:
    """`runs_once` turns ONNX Runtime's failure to run a quantized model into one error: nothing was written."""
    from lightning_speedkit.int8.steps import runs_once

    report = export_int8(nn.Linear(4, 2), [torch.randn(8, 4)], tmp_path / "m.onnx", latency_repeats=0)
    session = ort.InferenceSession(report["int8_path"], providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    with pytest.raises(RuntimeError, match=r"cannot run the INT8 model it quantized .*nothing was written"):
        runs_once(session, {name: np.zeros((8, 5), np.float32)})  # a width the model has not


class _TwoFeatureInputs(nn.Module):
    """Two (batch, features) inputs of different widths."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.head = nn.Linear(8, 16), nn.Linear(4, 16), nn.Linear(16, 3)

    @override
    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.a(x) + self.b(z)))


def test_fixed_feature_widths_are_written_as_sizes_not_a_shared_sequence_axis(tmp_path: Path) -> None:
    """An MLP input's features are static: the ONNX inputs read ``[batch, 8]`` and ``[batch, 4]``, batch dynamic.

    Both widths were one symbol ``sequence``, which ONNX reads as "equal", and the report called them dynamic.
    """
    import onnx

    torch.manual_seed(0)
    data = [{"x": torch.randn(32, 8), "z": torch.randn(32, 4), "labels": torch.randint(0, 3, (32,))} for _ in range(2)]
    report = export_int8(_TwoFeatureInputs(), data, tmp_path / "m.onnx", latency_repeats=0)
    assert report["dynamic_axes"] == {"x": [0], "z": [0]}
    for path in (report["fp32_path"], report["int8_path"]):
        inputs = onnx.load(path).graph.input
        dims = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in inputs}
        assert dims == {"x": ["batch", 8], "z": ["batch", 4]}
