"""A BERT-style encoder exported from dict batches, one input and two, through ORT's pre-processing fallback."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_trainer
from torch import nn
from torch.utils.data import DataLoader, Dataset
from typing_extensions import override

from lightning_speedkit.int8 import Int8Export, export_int8

VOCAB, MAX_LEN = 48, 64


class SelfAttention(nn.Module):
    """Multi-head self-attention with an additive mask bias, as Hugging Face's BERT computes it."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.query, self.key, self.value, self.out = (nn.Linear(dim, dim) for _ in range(4))

    def _split(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(x.shape[0], x.shape[1], self.heads, -1).transpose(1, 2)

    @override
    def forward(self, hidden: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        q, k, v = self._split(self.query(hidden)), self._split(self.key(hidden)), self._split(self.value(hidden))
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + bias
        context = (scores.softmax(-1) @ v).transpose(1, 2).reshape(hidden.shape)
        return self.out(context)  # type: ignore[no-any-return]


class Layer(nn.Module):
    """Post-norm encoder layer: attention, then a GELU feed-forward, each with a residual and LayerNorm."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.attention, self.norm1, self.norm2 = SelfAttention(dim, heads), nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.ff = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    @override
    def forward(self, hidden: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        hidden = self.norm1(hidden + self.attention(hidden, bias))
        return self.norm2(hidden + self.ff(hidden))  # type: ignore[no-any-return]


class BertStyle(nn.Module):
    """A small BERT: token, position and token-type embeddings, two attention layers, a classifier on [CLS].

    Positions and token types are sliced from buffers, as in Hugging Face's BERT.
    """

    def __init__(self, dim: int = 32, heads: int = 4, classes: int = 3) -> None:
        super().__init__()
        self.word, self.position, self.token_type = (
            nn.Embedding(VOCAB, dim),
            nn.Embedding(MAX_LEN, dim),
            nn.Embedding(2, dim),
        )
        self.register_buffer("position_ids", torch.arange(MAX_LEN)[None], persistent=False)
        self.register_buffer("token_type_ids", torch.zeros(1, MAX_LEN, dtype=torch.long), persistent=False)
        self.norm = nn.LayerNorm(dim)
        self.layers = nn.ModuleList([Layer(dim, heads) for _ in range(2)])
        self.classifier = nn.Linear(dim, classes)

    def encode(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        length = input_ids.shape[1]
        positions, types = self.position_ids[:, :length], self.token_type_ids[:, :length]  # Min(64, length) to ORT
        hidden = self.norm(self.word(input_ids) + self.position(positions) + self.token_type(types))
        if attention_mask is None:
            bias = torch.zeros(1, 1, 1, length)
        else:
            bias = (1.0 - attention_mask[:, None, None, :].to(hidden.dtype)) * torch.finfo(hidden.dtype).min
        for layer in self.layers:
            hidden = layer(hidden, bias)
        return self.classifier(hidden[:, 0])  # type: ignore[no-any-return]


class OneInput(BertStyle):
    """``forward(input_ids)``: no padding mask."""

    @override
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.encode(input_ids, None)


class TwoInputs(BertStyle):
    """``forward(input_ids, attention_mask)``: padded positions masked out."""

    @override
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.encode(input_ids, attention_mask)


def token_rows(samples: int, length: int, seed: int, padded: bool) -> list[dict[str, torch.Tensor]]:
    """Rows ``{input_ids, attention_mask, labels, idx}``: the label is which of tokens 1-3 is most common (unpadded)."""
    g = torch.Generator().manual_seed(seed)
    lengths = (
        torch.randint(length // 2, length + 1, (samples,), generator=g) if padded else torch.full((samples,), length)
    )
    mask = (torch.arange(length)[None] < lengths[:, None]).long()
    ids = torch.randint(1, 8, (samples, length), generator=g) * mask
    ids[:, 0] = 9  # a [CLS] token
    counts = torch.stack([((ids == t) & (mask > 0)).sum(1) for t in (1, 2, 3)], dim=1)
    labels = counts.argmax(1)
    return [
        {"input_ids": ids[i], "attention_mask": mask[i], "labels": labels[i], "idx": torch.tensor(i)}
        for i in range(samples)
    ]


class Rows(Dataset[dict[str, torch.Tensor]]):
    """A list of dict rows; the default collate stacks them into dict batches."""

    def __init__(self, rows: list[dict[str, torch.Tensor]]) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    @override
    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return self.rows[index]


def trained(model: BertStyle, padded: bool) -> BertStyle:
    """``model`` after 32 Adam steps on the token task, sequences of 24 (enough to be well above chance)."""
    torch.manual_seed(0)
    loader = DataLoader(Rows(token_rows(256, 24, 0, padded)), batch_size=32, shuffle=True)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(4):
        for batch in loader:
            inputs = (
                [batch["input_ids"], batch["attention_mask"]] if isinstance(model, TwoInputs) else [batch["input_ids"]]
            )
            loss = F.cross_entropy(model(*inputs), batch["labels"])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return model.eval()


@pytest.fixture(scope="module", params=["one input", pytest.param("two inputs", marks=pytest.mark.slow)])
def bert_export(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The encoder exported from dict batches (no ``inputs_from_batch``), from a directory ORT must not litter."""
    two = request.param == "two inputs"
    torch.manual_seed(0)
    model = trained(TwoInputs() if two else OneInput(), padded=two)
    loader = DataLoader(Rows(token_rows(128, 16, 1, padded=two)), batch_size=32)
    root = tmp_path_factory.mktemp("bert")
    cwd = root / "cwd"
    cwd.mkdir()
    # plain INT8 of masked attention fails (the mask's -3.4e38 takes the scores' range): accuracy-aware mode keeps
    # the mask's Add and the Softmax in FP32 (~70 trial quantizations, hence slow)
    budget: dict[str, Any] = {"min_agreement": 0.95, "verify_batches": 2} if two else {}
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(cwd)
        report = export_int8(model, loader, root / "bert.onnx", latency_repeats=0, calibration_batches=2, **budget)
    return {"model": model, "report": report, "two": two, "cwd": cwd}


def test_a_bert_style_encoder_exports_from_dict_batches(bert_export: dict[str, Any]) -> None:
    """Dict batch keys that are forward's parameters become the inputs; ``labels`` is the target, ``idx`` ignored."""
    report = bert_export["report"]
    names = ["input_ids", "attention_mask"] if bert_export["two"] else ["input_ids"]
    assert report["input_names"] == names
    assert report["dynamic_axes"] == {name: [0, 1] for name in names}
    assert report["verification"]["metric"] == "top1_accuracy"  # the labels were found and compared
    assert report["verification"]["metric_fp32"] > 0.6
    assert report["passed"] is True
    if bert_export["two"]:
        kept = {layer["op"] for layer in report["accuracy_aware"]["fp32_layers"]}
        assert {"Add", "Softmax"} <= kept


def test_ort_symbolic_shape_failure_falls_back_and_says_so(bert_export: dict[str, Any]) -> None:
    """Position ids sliced from a buffer stop ORT's symbolic shape inference: the export falls back and reports it."""
    prepared = bert_export["report"]["preprocess"]
    assert prepared["symbolic_shape_inference"] == "skipped"
    assert "Incomplete symbolic shape inference" in prepared["fallback_reason"]
    assert list(bert_export["cwd"].iterdir()) == []  # ORT's dump of the half-inferred model was removed


@pytest.mark.parametrize("length", [9, 23])
def test_the_int8_encoder_runs_in_onnx_runtime_at_other_sequence_lengths(
    bert_export: dict[str, Any], length: int
) -> None:
    """FP32 ONNX matches eager and INT8 tracks it at sequence lengths that calibration never saw."""
    report, model = bert_export["report"], bert_export["model"]
    rows = token_rows(64, length, 7, padded=bert_export["two"])
    inputs = {name: torch.stack([r[name] for r in rows]) for name in report["input_names"]}
    feed = {name: t.numpy() for name, t in inputs.items()}
    with torch.no_grad():
        expected = model(**inputs).numpy()
    fp32 = ort.InferenceSession(report["fp32_path"], providers=["CPUExecutionProvider"]).run(None, feed)[0]
    int8 = ort.InferenceSession(report["int8_path"], providers=["CPUExecutionProvider"]).run(None, feed)[0]
    np.testing.assert_allclose(fp32, expected, atol=1e-4, rtol=1e-4)
    assert int8.shape == (64, 3)
    assert (int8.argmax(1) == expected.argmax(1)).mean() >= 0.9


def test_a_plain_graph_keeps_symbolic_shape_inference(tmp_path: Path) -> None:
    """Where ORT's symbolic shape inference finishes, it is used and the report says so."""
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    report = export_int8(net, [torch.randn(8, 8)], tmp_path / "m.onnx", latency_repeats=0, verify=False)
    assert report["preprocess"] == {"symbolic_shape_inference": "done", "fallback_reason": None, "untied": []}


class HfStyle(nn.Module):
    """A forward that takes ``labels=None`` too, like a Hugging Face model's."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(VOCAB, 8), nn.Linear(8, 3)

    @override
    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        return self.head(self.embed(input_ids).mean(1))  # type: ignore[no-any-return]


def test_an_optional_labels_parameter_stays_the_target(tmp_path: Path) -> None:
    """``labels`` is the target even when forward takes ``labels=None``: the ONNX model does not ask for labels."""
    loader = DataLoader(Rows(token_rows(64, 12, 2, padded=False)), batch_size=16)
    report = export_int8(HfStyle(), loader, tmp_path / "m.onnx", latency_repeats=0)
    assert report["input_names"] == ["input_ids"]
    assert report["verification"]["metric"] == "top1_accuracy"


def test_a_dict_batch_with_no_parameter_key_names_keys_and_parameters(tmp_path: Path) -> None:
    """A dict batch none of whose keys is a forward parameter is refused, naming both; nothing is written."""
    batches = [{"ids": torch.zeros(4, 12, dtype=torch.long), "labels": torch.zeros(4, dtype=torch.long)}]
    match = r"`calibration_data` must give dict batches whose keys are forward's parameters \(input_ids\) of OneInput"
    with pytest.raises(ValueError, match=match + r", got a dict with keys \(ids, labels\)"):
        export_int8(OneInput(), batches, tmp_path / "m.onnx", latency_repeats=0)
    assert list(tmp_path.iterdir()) == []


class TextModule(L.LightningModule):
    """The two-input encoder fed dict batches ``{input_ids, attention_mask, labels, idx}``."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = TwoInputs()

    @override
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.encoder(input_ids, attention_mask)  # type: ignore[no-any-return]

    @override
    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return F.cross_entropy(self(batch["input_ids"], batch["attention_mask"]), batch["labels"])

    @override
    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", F.cross_entropy(self(batch["input_ids"], batch["attention_mask"]), batch["labels"]))

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=3e-3)

    @override
    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(Rows(token_rows(64, 16, 0, padded=True)), batch_size=16)

    @override
    def val_dataloader(self) -> DataLoader[Any]:
        return DataLoader(Rows(token_rows(32, 16, 1, padded=True)), batch_size=16)


def test_the_callback_exports_dict_batches_without_inputs_from_batch(tmp_path: Path) -> None:
    """Int8Export maps the validation dict batches to forward's parameters by name, with no user function."""
    L.seed_everything(0, verbose=False)
    export = Int8Export(tmp_path / "int8", calibration_batches=2, latency_repeats=0, max_metric_drop=None)
    tiny_trainer(tmp_path, max_epochs=1, callbacks=[export], num_sanity_val_steps=0).fit(TextModule())
    report = export.report()
    assert report["exported"] is True
    assert report["input_names"] == ["input_ids", "attention_mask"]
    assert report["verification"]["samples"] == 32
    assert report["verification"]["metric"] == "top1_accuracy"
