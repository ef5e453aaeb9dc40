"""Models the benchmarks share: a timm-style Vision Transformer and a BERT-style two-input text encoder.

``pruning.py`` prunes both (heads, MLP units, embedding channels); ``int8.py`` exports the text encoder with its two
inputs (``input_ids``, ``attention_mask``). Both train on the demo's terms: `ViTClassifier` is the demo classifier with
a transformer instead of the ResNet, `TextClassifier` logs ``val_acc`` like it on a synthetic token task.
"""

from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from typing_extensions import override

from lightning_speedkit.demo import DemoClassifier

__all__ = [
    "Attention",
    "Block",
    "EncoderLayer",
    "SelfAttention",
    "TextClassifier",
    "TextEncoder",
    "ViTClassifier",
    "VisionTransformer",
    "text_data",
]

# ---------------------------------------------------------------------------------------------- a Vision Transformer


class Attention(nn.Module):
    """timm's ViT attention: one ``qkv`` Linear reshaped by ``num_heads`` and ``head_dim``."""

    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        attended = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, -1)
        return self.proj(attended)  # type: ignore[no-any-return]


class Block(nn.Module):
    """Pre-norm transformer block: attention and a GELU MLP (4x), each with a residual."""

    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.norm1, self.attn, self.norm2 = nn.LayerNorm(dim), Attention(dim, num_heads), nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))  # type: ignore[no-any-return]


class VisionTransformer(nn.Module):
    """Patch embedding (8x8), a class token, learned positions, ``depth`` blocks and a linear head."""

    def __init__(self, dim: int, depth: int, crop_size: int, num_heads: int = 4, patch: int = 8) -> None:
        super().__init__()
        self.patch_embed = nn.Conv2d(3, dim, patch, patch)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.randn(1, (crop_size // patch) ** 2 + 1, dim) * 0.02)
        self.blocks = nn.Sequential(*[Block(dim, num_heads) for _ in range(depth)])
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, 10)

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(len(x), -1, -1), x], dim=1) + self.pos_embed
        return self.head(self.norm(self.blocks(x))[:, 0])  # type: ignore[no-any-return]


class ViTClassifier(DemoClassifier):
    """The demo classifier (same data, loss, metric and AdamW) with a Vision Transformer instead of the ResNet."""

    def __init__(self, dim: int = 64, depth: int = 4, crop_size: int = 56) -> None:
        super().__init__(crop_size=crop_size)
        self.model = VisionTransformer(dim, depth, crop_size)


# ---------------------------------------------------------------------------------------------- a BERT-style encoder


class SelfAttention(nn.Module):
    """BERT's self-attention: ``query``/``key``/``value`` viewed by ``num_attention_heads``, a padding mask."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.num_attention_heads, self.attention_head_size = heads, hidden // heads
        self.all_head_size = hidden
        self.query, self.key, self.value = (nn.Linear(hidden, hidden) for _ in range(3))

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(*x.shape[:-1], self.num_attention_heads, self.attention_head_size).transpose(1, 2)

    @override
    def forward(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        q, k, v = self._heads(self.query(hidden)), self._heads(self.key(hidden)), self._heads(self.value(hidden))
        context = F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2)
        return context.reshape(*context.shape[:-2], self.all_head_size)


class EncoderLayer(nn.Module):
    """Post-norm BERT layer: self-attention + output Linear, then a GELU feed-forward (4x), each with LayerNorm."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.attention, self.attention_output = SelfAttention(hidden, heads), nn.Linear(hidden, hidden)
        self.intermediate, self.output = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)
        self.norm1, self.norm2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)

    @override
    def forward(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        hidden = self.norm1(hidden + self.attention_output(self.attention(hidden, mask)))
        return self.norm2(hidden + self.output(F.gelu(self.intermediate(hidden))))  # type: ignore[no-any-return]


class TextEncoder(nn.Module):
    """A small BERT: token and position embeddings, ``layers`` encoder layers, a tanh pooler and a classifier."""

    def __init__(self, vocab: int = 64, hidden: int = 64, layers: int = 2, heads: int = 4, max_len: int = 32) -> None:
        super().__init__()
        self.word, self.position = nn.Embedding(vocab, hidden), nn.Embedding(max_len, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.layers = nn.ModuleList([EncoderLayer(hidden, heads) for _ in range(layers)])
        self.pooler, self.classifier = nn.Linear(hidden, hidden), nn.Linear(hidden, 4)

    @override
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        hidden = self.norm(self.word(input_ids) + self.position(positions)[None])
        mask = (attention_mask[:, None, None, :] > 0).expand(-1, -1, input_ids.shape[1], -1)
        for layer in self.layers:
            hidden = layer(hidden, mask)
        return self.classifier(torch.tanh(self.pooler(hidden[:, 0])))  # type: ignore[no-any-return]


def text_data(samples: int, seed: int, length: int = 32) -> TensorDataset:
    """``(input_ids, attention_mask, label)`` of a synthetic task that needs attention over the whole sequence.

    The label is which of the tokens 1-4 occurs most often in the unpadded part (ties to the lowest); the tail after
    a random length is padding (token 0, mask 0); position 0 is a [CLS] token (5).
    """
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(length // 2, length + 1, (samples,), generator=g)
    mask = (torch.arange(length)[None] < lengths[:, None]).long()
    ids = torch.randint(1, 64, (samples, length), generator=g) * mask
    ids[:, 0] = 5
    counts = torch.stack([((ids == token) & (mask > 0)).sum(1) for token in range(1, 5)], dim=1)
    return TensorDataset(ids, mask, counts.argmax(1))


class TextClassifier(L.LightningModule):
    """The encoder on `text_data`, AdamW, logging ``val_acc`` like the demo classifier."""

    def __init__(self, samples: int = 2000, batch_size: int = 32, lr: float = 1e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = TextEncoder()
        ids, mask, _ = text_data(1, seed=99)[:]
        self.example_input_array = (ids, mask)

    @override
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, attention_mask)  # type: ignore[no-any-return]

    @override
    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return F.cross_entropy(self(batch[0], batch[1]), batch[2])

    @override
    def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        logits = self(batch[0], batch[1])
        self.log("val_loss", F.cross_entropy(logits, batch[2]))
        self.log("val_acc", (logits.argmax(1) == batch[2]).float().mean())

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams["lr"], weight_decay=1e-4)

    @override
    def train_dataloader(self) -> DataLoader[tuple[torch.Tensor, ...]]:
        return DataLoader(text_data(self.hparams["samples"], 0), batch_size=self.hparams["batch_size"], shuffle=True)

    @override
    def val_dataloader(self) -> DataLoader[tuple[torch.Tensor, ...]]:
        return DataLoader(text_data(max(64, self.hparams["samples"] // 4), 1), batch_size=self.hparams["batch_size"])
