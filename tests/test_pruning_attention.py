"""Attention-aware pruning (timm-style ViT, BERT-style encoder, nn.MultiheadAttention) and the latency target."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, StackDataset
from typing_extensions import override

from lightning_speedkit.batch import forward_example
from lightning_speedkit.pruning import (
    StructuredPruning,
    apply_pruning_history,
    count_macs_params,
    find_attention,
    load_pruned_checkpoint,
    output_layer_names,
    plan_pruning,
    pruning_history,
    search_latency_ratio,
    unsupported_layer_names,
)
from lightning_speedkit.pruning import search as search_module

# ---------------------------------------------------------------- models written as the zoos write them


class TimmAttention(nn.Module):
    """timm's ViT ``Attention``: one ``qkv`` Linear, reshaped by ``num_heads`` and ``head_dim``."""

    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.scale = self.head_dim**-0.5
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        qkv = self.qkv(x).reshape(b, n, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        attn = ((q * self.scale) @ k.transpose(-2, -1)).softmax(dim=-1)
        return self.proj((attn @ v).transpose(1, 2).reshape(b, n, -1))  # type: ignore[no-any-return]


class TimmBlock(nn.Module):
    """A pre-norm ViT block: attention and a GELU MLP, each with a residual."""

    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(dim), TimmAttention(dim, num_heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))  # type: ignore[no-any-return]


class TinyViT(nn.Module):
    """Patch embedding, a class token, learned positions, ViT blocks and a linear head."""

    def __init__(self, dim: int = 32, depth: int = 2, num_heads: int = 4, image: int = 16, patch: int = 4) -> None:
        super().__init__()
        self.patch_embed = nn.Conv2d(3, dim, patch, patch)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.randn(1, (image // patch) ** 2 + 1, dim) * 0.02)
        self.blocks = nn.Sequential(*[TimmBlock(dim, num_heads) for _ in range(depth)])
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, 4)

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(len(x), -1, -1), x], dim=1) + self.pos_embed
        return self.head(self.norm(self.blocks(x))[:, 0])  # type: ignore[no-any-return]


class BertSelfAttention(nn.Module):
    """Hugging Face's BERT self-attention: ``query``/``key``/``value`` viewed by ``num_attention_heads``."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.num_attention_heads = heads
        self.attention_head_size = hidden // heads
        self.all_head_size = heads * self.attention_head_size
        self.query = nn.Linear(hidden, self.all_head_size)
        self.key = nn.Linear(hidden, self.all_head_size)
        self.value = nn.Linear(hidden, self.all_head_size)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(*x.shape[:-1], self.num_attention_heads, self.attention_head_size).permute(0, 2, 1, 3)

    @override
    def forward(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        q, k, v = self._heads(self.query(hidden)), self._heads(self.key(hidden)), self._heads(self.value(hidden))
        scores = q @ k.transpose(-1, -2) / self.attention_head_size**0.5 + mask
        context = (scores.softmax(dim=-1) @ v).permute(0, 2, 1, 3).contiguous()
        return context.view(*context.shape[:-2], self.all_head_size)


class BertLayer(nn.Module):
    """Post-norm BERT layer: self-attention, output projection, intermediate GELU and output, each with LayerNorm."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.attention, self.attention_output = BertSelfAttention(hidden, heads), nn.Linear(hidden, hidden)
        self.intermediate, self.output = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)
        self.norm1, self.norm2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)

    @override
    def forward(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        hidden = self.norm1(hidden + self.attention_output(self.attention(hidden, mask)))
        return self.norm2(hidden + self.output(F.gelu(self.intermediate(hidden))))  # type: ignore[no-any-return]


class TinyBert(nn.Module):
    """Token and position embeddings, BERT layers, a tanh pooler and a classifier; two inputs."""

    def __init__(self, vocab: int = 50, hidden: int = 32, layers: int = 2, heads: int = 4, max_len: int = 16) -> None:
        super().__init__()
        self.word, self.position = nn.Embedding(vocab, hidden), nn.Embedding(max_len, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.layers = nn.ModuleList([BertLayer(hidden, heads) for _ in range(layers)])
        self.pooler, self.classifier = nn.Linear(hidden, hidden), nn.Linear(hidden, 4)

    @override
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        hidden = self.norm(self.word(input_ids) + self.position(positions)[None])
        mask = (1.0 - attention_mask[:, None, None, :].float()) * -10000.0
        for layer in self.layers:
            hidden = layer(hidden, mask)
        return self.classifier(torch.tanh(self.pooler(hidden[:, 0])))  # type: ignore[no-any-return]


class TorchEncoder(nn.Module):
    """A token projection, ``nn.TransformerEncoderLayer`` (``nn.MultiheadAttention`` inside) and a head."""

    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.embed = nn.Linear(8, dim)
        self.encoder = nn.TransformerEncoderLayer(dim, heads, 2 * dim, dropout=0.0, batch_first=True)
        self.head = nn.Linear(dim, 4)

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(x)).mean(dim=1))  # type: ignore[no-any-return]


def _examples(kind: str, n: int, seed: int = 0) -> tuple[Any, torch.Tensor]:
    """``n`` inputs for the ``kind`` of model (tensor, or dict for BERT) and labels the model can learn."""
    g = torch.Generator().manual_seed(seed)
    if kind == "vit":
        x = torch.randn(n, 3, 16, 16, generator=g)
        return x, (x[:, :, :8].mean((1, 2, 3)) > x[:, :, 8:].mean((1, 2, 3))).long() * 2 + (x[:, 0].mean((1, 2)) > 0)
    if kind == "bert":
        ids = torch.randint(1, 50, (n, 16), generator=g)
        mask = torch.ones(n, 16, dtype=torch.long)
        mask[n // 2 :, 12:] = 0
        return {"input_ids": ids, "attention_mask": mask}, ids[:, 1] % 4
    x = torch.randn(n, 6, 8, generator=g)
    return x, x[:, :, :4].mean(1).argmax(1)


MODELS: dict[str, Callable[[], nn.Module]] = {"vit": TinyViT, "bert": TinyBert, "mha": TorchEncoder}


def _dataset(kind: str, n: int, seed: int) -> StackDataset[Any]:
    x, y = _examples(kind, n, seed)
    return StackDataset(StackDataset(**x) if isinstance(x, dict) else x, y)


class Classifier(L.LightningModule):
    """One of `MODELS` trained with AdamW on its synthetic task, batches in a fixed order (resume-comparable)."""

    def __init__(self, kind: str = "vit") -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        self.net = MODELS[kind]()
        example, _ = _examples(kind, 2, seed=9)
        self.example_input_array = (example,) if isinstance(example, dict) else example

    @override
    def forward(self, x: Any) -> torch.Tensor:
        return forward_example(self.net, x)  # type: ignore[no-any-return]

    def _loss(self, batch: Any) -> torch.Tensor:
        return F.cross_entropy(self(batch[0]), batch[1])

    @override
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self._loss(batch)

    @override
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch))

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=3e-3)

    @override
    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(_dataset(self.hparams["kind"], 32, 0), batch_size=8)

    @override
    def val_dataloader(self) -> DataLoader[Any]:
        return DataLoader(_dataset(self.hparams["kind"], 16, 1), batch_size=8)


def _input(kind: str) -> Any:
    return _examples(kind, 4, seed=3)[0]


# ---------------------------------------------------------------- the surgery


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        ("vit", [("blocks.0.attn", "fused", 4, 8), ("blocks.1.attn", "fused", 4, 8)]),
        ("bert", [("layers.0.attention", "split", 4, 8), ("layers.1.attention", "split", 4, 8)]),
        ("mha", [("encoder.self_attn", "multihead", 4, 8)]),
    ],
)
def test_attention_layers_are_found(kind: str, expected: list[tuple[str, str, int, int]]) -> None:
    """The three kinds of attention are recognised with their head count and head width."""
    assert [(a.name, a.kind, a.heads, a.head_dim) for a in find_attention(MODELS[kind]())] == expected


@pytest.mark.parametrize(("kind", "heads_after"), [("vit", 3), ("bert", 3), ("mha", 4)])
def test_pruned_copy_runs_with_fewer_heads_and_replays_exactly(kind: str, heads_after: int) -> None:
    """At ratio 0.3: >= 1.5x fewer MACs, head counts updated, classifier whole, a fresh replay gives equal outputs."""
    torch.manual_seed(0)
    model, x = MODELS[kind](), _input(kind)
    macs = count_macs_params(model, x)[0]
    outputs = output_layer_names(model, x)
    assert outputs == (["classifier"] if kind == "bert" else ["head"])
    apply_pruning_history(model, x, plan_pruning(model, x, 0.3, outputs))
    assert macs / count_macs_params(model, x)[0] >= 1.5
    assert [a.heads for a in find_attention(model)] == [heads_after] * len(find_attention(model))
    head = model.get_submodule(outputs[0])
    assert isinstance(head, nn.Linear)
    assert head.out_features == 4
    fresh = MODELS[kind]()
    apply_pruning_history(fresh, x, pruning_history(model))
    fresh.load_state_dict(model.state_dict())
    torch.testing.assert_close(forward_example(fresh.eval(), x), forward_example(model.eval(), x), rtol=0, atol=0)
    if kind == "mha":
        attention = model.get_submodule("encoder.self_attn")
        assert isinstance(attention, nn.MultiheadAttention)
        assert attention.embed_dim % attention.num_heads == 0
        assert attention.embed_dim < 32


def test_multihead_attention_with_other_key_dims_is_left_whole() -> None:
    """A cross-attention ``nn.MultiheadAttention`` (kdim/vdim) is not shrunk: it is reported unsupported."""
    model = nn.Sequential(nn.Linear(4, 8), nn.MultiheadAttention(8, 2, kdim=4, vdim=4))
    assert (unsupported_layer_names(model), find_attention(model)) == (["1"], [])


# ---------------------------------------------------------------- in a fit: prune, fine-tune, resume, reload


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["vit", "bert", "mha"])
def test_fit_prunes_attention_resumes_and_reloads(tmp_path: Path, kind: str) -> None:
    """target_speedup=1.5 on each model: fine-tuned, a resume matches the full run, a fresh module reloads it."""

    def run(root: Path, ckpt_path: str | None = None) -> tuple[Classifier, StructuredPruning]:
        L.seed_everything(0, verbose=False)
        model = Classifier(kind)
        pruning = StructuredPruning(target_speedup=1.5, start_epoch=1, finetune_epochs=1, latency_batch_sizes=())
        checkpoints = ModelCheckpoint(dirpath=root, save_top_k=-1, filename="{epoch}")
        trainer = tiny_trainer(root, max_epochs=3, callbacks=[pruning, checkpoints], enable_checkpointing=True)
        trainer.fit(model, ckpt_path=ckpt_path, weights_only=True)
        return model, pruning

    full, pruning = run(tmp_path / "full")
    report = pruning.report()
    assert report["finished"]
    assert report["macs_before"] / report["macs_after"] >= 1.5
    assert report["steps"][0]["speedup"] >= 1.5
    assert report["metric_after"] is not None

    resumed, _ = run(tmp_path / "resumed", str(tmp_path / "full" / "epoch=1.ckpt"))
    assert pruning_history(resumed) == pruning_history(full)
    for (name, a), (_, b) in zip(full.named_parameters(), resumed.named_parameters(), strict=True):
        torch.testing.assert_close(a, b, msg=name)

    fresh = load_pruned_checkpoint(Classifier(kind), tmp_path / "full" / "epoch=2.ckpt")
    x = _input(kind)
    torch.testing.assert_close(fresh(x), full.eval()(x))
    assert [a.heads for a in find_attention(fresh)] == [a.heads for a in find_attention(full)]


# ---------------------------------------------------------------- the latency target


_REFERENCE_MACS: dict[tuple[int, int], float] = {}


def _by_macs(example: Any) -> Callable[[nn.Module, nn.Module], float]:
    """A deterministic stand-in for timing: the MACs ratio of the two models (the reference's counted once)."""

    def measure(reference: nn.Module, candidate: nn.Module) -> float:
        key = (id(reference), sum(p.numel() for p in reference.parameters()))
        if key not in _REFERENCE_MACS:
            _REFERENCE_MACS[key] = count_macs_params(reference, example)[0]
        return _REFERENCE_MACS[key] / count_macs_params(candidate, example)[0]

    return measure


def test_latency_search_finds_the_smallest_ratio_that_is_fast_enough() -> None:
    """With a monotone measure the search returns a ratio that reaches the target, and a smaller one does not."""
    torch.manual_seed(0)
    model, x = TinyViT(), _input("vit")
    ratio, plan, speedup, trials = search_latency_ratio(model, x, 2.0, ["head"], round_to=None, measure=_by_macs(x))
    assert speedup >= 2.0
    assert plan
    slower = [t for t in trials if t[0] < ratio]
    assert slower
    assert all(t[2] < 2.0 for t in slower)


def test_latency_target_is_timed_and_recorded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """target_latency prunes until the (here MACs-proportional) measured speedup reaches it; the step records it."""
    calls: list[str] = []

    def fake_speedup(reference: nn.Module, candidate: nn.Module, example: Any, device: Any = "cpu") -> float:
        calls.append(str(device))
        return _by_macs(example)(reference, candidate)

    monkeypatch.setattr(search_module, "latency_speedup", fake_speedup)
    model = Classifier("vit")
    pruning = StructuredPruning(
        target_latency=1.7, start_epoch=1, latency_device="cpu", latency_batch_sizes=(), round_to=None
    )
    tiny_trainer(tmp_path, max_epochs=3, callbacks=[pruning]).fit(model)
    steps = pruning.report()["steps"]
    assert steps[0]["speedup"] >= 1.7
    assert set(calls) == {"cpu"}
    assert pruning.report()["macs_before"] / pruning.report()["macs_after"] >= 1.7


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"target_latency": 40.0}, r"`target_latency` must be reachable, got 40.0: .* reaches only \d+\.\d\dx faster"),
        ({"target_speedup": 500.0}, r"`target_speedup` must be reachable, got 500.0: .* \d+\.\d\dx fewer MACs"),
    ],
)
def test_unreachable_target_fails_before_training(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kwargs: dict[str, Any], match: str
) -> None:
    """A target no ratio reaches fails at the first batch, naming what was reached; the model is left untouched."""
    monkeypatch.setattr(search_module, "latency_speedup", lambda a, b, x, device="cpu": _by_macs(x)(a, b))
    model = Classifier("vit")
    before = copy.deepcopy(model.state_dict())
    pruning = StructuredPruning(start_epoch=2, latency_batch_sizes=(), **kwargs)
    trainer = tiny_trainer(tmp_path, max_epochs=4, callbacks=[pruning], enable_checkpointing=True)
    with pytest.raises(ValueError, match=match):
        trainer.fit(model)
    assert trainer.global_step == 0
    assert pruning_history(model) == []
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not list(tmp_path.rglob("*.ckpt"))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"target_latency": 1.0}, "`target_latency` must be a finite number > 1, got 1.0"),
        ({"target_latency": 0.5}, "`target_latency`"),
        ({"target_latency": float("inf")}, "`target_latency`"),
        ({"amount": 0.5, "target_latency": 2.0}, "Exactly one of `amount`, `target_speedup` and `target_latency`"),
        ({"target_latency": 2.0, "latency_device": "gpu"}, "`latency_device` must be one of 'auto', 'cpu'"),
    ],
)
def test_bad_latency_arguments_raise(kwargs: dict[str, Any], match: str) -> None:
    """A latency target of 1 or below, two targets or an unknown device raise ValueError naming the argument."""
    with pytest.raises(ValueError, match=match):
        StructuredPruning(**kwargs)
