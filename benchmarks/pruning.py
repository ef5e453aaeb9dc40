"""Structured pruning vs Lightning's ModelPruning vs no pruning, on a ResNet, a ViT and a BERT-style encoder, one run.

Rows, each against the unpruned baseline of the same model, data and epochs in the same run:

- ``resnet``: the demo ResNet unpruned, with ``StructuredPruning(target_speedup=2.0)`` (a MACs target), with
  ``StructuredPruning(target_latency=1.7, latency_device="cpu")`` (a measured latency target, searched by timing
  pruned copies at the example input's batch of 1) and with Lightning's ``ModelPruning`` (masks). Width 32: at
  width 16 this net is bound by per-operator overhead at batch 1 (1.7x took 3.8x fewer MACs there).
- ``vit``: a timm-style Vision Transformer (one ``qkv`` Linear per block) on the demo images, unpruned and pruned to
  2x fewer MACs (whole heads, MLP units and embedding channels).
- ``text``: a BERT-style two-input encoder (``input_ids``, ``attention_mask``) on a synthetic token task, unpruned
  and pruned to 2x fewer MACs.

For each: parameters (and non-zero parameters), MACs (torch-pruning's counter), CPU latency at batch 1, 32 and 64
(interleaved rounds; speedups paired with the baseline within each round, see `_measure`), and validation accuracy
at the end. One torch thread (``--threads``): on a shared 2-core machine two-thread timings of the same two models
at batch 32 swung between 0.7x and 2.3x with other processes' load; one-thread ones at batch 1 held within 5%.

    python benchmarks/pruning.py            # ~2000 images, 16 epochs per variant (minutes on 2 CPU cores)
    python benchmarks/pruning.py --quick    # seconds: a smoke run for the tests
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback, ModelPruning
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from typing_extensions import override

from lightning_speedkit.demo import DemoClassifier, DemoDataModule
from lightning_speedkit.pruning import StructuredPruning, count_macs_params
from lightning_speedkit.report import write_json_atomic
from lightning_speedkit.timing import median_ms
from lightning_speedkit.warmup import WarmupScheduler

DEFAULT_OUT = Path(__file__).parent / "results" / "pruning.json"

# variant -> (model family, how it is pruned); the first variant of a family is its baseline
VARIANTS = {"baseline": ("resnet", None), "structured": ("resnet", "macs"), "latency": ("resnet", "latency")}
VARIANTS |= {"modelpruning": ("resnet", "masks"), "vit_baseline": ("vit", None), "vit_structured": ("vit", "macs")}
VARIANTS |= {"text_baseline": ("text", None), "text_structured": ("text", "macs")}


FULL = {"num_images": 2000, "width": 32, "epochs": 16, "prune_epoch": 6, "batch_size": 32, "repeats": 30, "round_to": 8}
FULL |= {"vit_dim": 64, "vit_depth": 4, "text_samples": 2000, "latency_target": 1.7, "latency_batch": 32, "threads": 1}
QUICK = {**FULL, "num_images": 120, "width": 8, "epochs": 3, "prune_epoch": 1, "batch_size": 16, "repeats": 3}
QUICK |= {"round_to": 2, "vit_dim": 32, "vit_depth": 1, "text_samples": 64, "latency_target": 1.2, "latency_batch": 8}


def _settings(quick: bool) -> dict[str, Any]:
    return dict(QUICK if quick else FULL)


# ---------------------------------------------------------------- the transformer workloads


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
        return self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, -1))  # type: ignore[no-any-return]


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


# ---------------------------------------------------------------- the runs


def _callbacks(how: str | None, s: dict[str, Any], round_to: int) -> list[Callback]:
    schedule = {"start_epoch": s["prune_epoch"], "finetune_epochs": s["epochs"] - s["prune_epoch"] - 1}
    schedule |= {"round_to": round_to, "monitor": "val_acc", "latency_batch_sizes": ()}
    if how == "macs":
        return [StructuredPruning(target_speedup=2.0, **schedule)]
    if how == "latency":  # timed on the CPU at the example input's batch of 1, with this process's threads
        return [StructuredPruning(target_latency=s["latency_target"], latency_device="cpu", **schedule)]
    if how == "masks":
        return [
            ModelPruning(
                "l1_unstructured",
                amount=0.5,
                apply_pruning=lambda epoch: epoch == s["prune_epoch"],
                use_lottery_ticket_hypothesis=False,
                make_pruning_permanent=True,
                verbose=0,
            )
        ]
    return []


def _model(family: str, s: dict[str, Any]) -> L.LightningModule:
    if family in ("vit", "text"):
        return ViTClassifier(s["vit_dim"], s["vit_depth"]) if family == "vit" else TextClassifier(s["text_samples"])
    return DemoClassifier(width=s["width"])  # the default LR: 2e-3 stalls this net without warmup


def _fastest_ms(model: nn.Module, x: tuple[torch.Tensor, ...], calls: int = 3) -> float:
    """The fastest of ``calls`` eval passes of ``model`` on ``x``, in ms."""
    with torch.inference_mode():
        return min(median_ms(lambda: model(*x), 1, warmup=0) for _ in range(calls))


def _batch_of(example: Any, batch: int) -> tuple[torch.Tensor, ...]:
    """The example's first sample repeated to ``batch``, as positional inputs."""
    parts = example if isinstance(example, tuple) else (example,)
    return tuple(t[:1].expand(batch, *t.shape[1:]).contiguous() for t in parts)


def _measure(models: dict[str, L.LightningModule], repeats: int, middle: int) -> dict[str, dict[str, float]]:
    """Size and MACs of each model, and its CPU latency over interleaved rounds.

    Each round times every model (the fastest of 3 passes); ``latency_ms_b{B}`` is a model's median over the
    rounds and ``latency_speedup_b{B}`` the median over rounds of baseline / model in the same round (the
    baseline is the family's first variant). Pairing within a round makes load from other processes, and the
    machine's drifting speed, hit both sides of a ratio alike, the way `latency_speedup` times a search.
    """
    models = {name: copy.deepcopy(m).cpu().eval() for name, m in models.items()}
    rows: dict[str, dict[str, float]] = {}
    for name, model in models.items():
        macs, params = count_macs_params(model, model.example_input_array)
        nonzero = sum(int(p.count_nonzero()) for p in model.parameters())
        rows[name] = {"params": float(params), "nonzero_params": float(nonzero), "macs": macs}
    bases = {name: next(n for n, (f, _) in VARIANTS.items() if f == VARIANTS[name][0]) for name in models}
    for batch, rounds in ((1, repeats), (middle, max(3, repeats // 2)), (64, max(3, repeats // 3))):
        inputs = {name: _batch_of(model.example_input_array, batch) for name, model in models.items()}
        for name, model in models.items():
            _fastest_ms(model, inputs[name])  # warm-up: allocator, kernels
        samples: dict[str, list[float]] = {name: [] for name in models}
        for _ in range(rounds):
            for name, model in models.items():
                samples[name].append(_fastest_ms(model, inputs[name]))
        for name in models:
            rows[name][f"latency_ms_b{batch}"] = statistics.median(samples[name])
            paired = [b / v for b, v in zip(samples[bases[name]], samples[name], strict=True)]
            rows[name][f"latency_speedup_b{batch}"] = statistics.median(paired)
    return rows


def run(
    quick: bool = False,
    out: str | Path = DEFAULT_OUT,
    root: str | Path | None = None,
    round_to: int | None = None,
    threads: int | None = None,
) -> dict[str, Any]:
    """Train every variant, measure them, print the table and write the JSON to ``out``."""
    s = _settings(quick)
    round_to = s["round_to"] if round_to is None else round_to
    s["threads"] = s["threads"] if threads is None else threads
    previous, load_before = torch.get_num_threads(), os.getloadavg()
    torch.set_num_threads(s["threads"])
    try:
        result = _run(s, round_to, root)
    finally:
        torch.set_num_threads(previous)
    result["settings"]["load_average"] = {"before": load_before, "after": os.getloadavg()}
    print(format_table(result))
    write_json_atomic(result, out)
    return result


def _run(s: dict[str, Any], round_to: int, root: str | Path | None) -> dict[str, Any]:
    models: dict[str, L.LightningModule] = {}
    extra: dict[str, dict[str, Any]] = {}
    for name, (family, how) in VARIANTS.items():
        L.seed_everything(0, verbose=False)
        model = _model(family, s)
        data = (
            None
            if family == "text"
            else DemoDataModule(num_images=s["num_images"], batch_size=s["batch_size"], root=root)
        )
        trainer = L.Trainer(
            accelerator="cpu",
            devices=1,
            max_epochs=s["epochs"],
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            # The same LR schedule for every variant: a short warmup, then cosine decay; StructuredPruning restarts
            # it after its step, so the fine-tune gets its own warmup (fresh optimizer moments at full LR otherwise
            # knock the pruned net back) and decays to convergence like the baseline.
            callbacks=[WarmupScheduler(warmup=0.05, decay="cosine"), *_callbacks(how, s, round_to)],
        )
        start = time.perf_counter()
        trainer.fit(model, datamodule=data)
        models[name] = model
        pruning = next((c for c in trainer.callbacks if isinstance(c, StructuredPruning)), None)  # type: ignore[attr-defined]
        steps = pruning.report().get("steps", []) if pruning is not None else []
        extra[name] = {
            "model": family,
            "pruning": how or "none",
            "val_acc": float(trainer.callback_metrics["val_acc"]),
            "fit_s": time.perf_counter() - start,
            "search_speedup": steps[-1].get("speedup") if steps else None,
            "ratio": steps[-1]["ratio"] if steps else None,
        }
    rows = _measure(models, s["repeats"], s["latency_batch"])
    for name, row in rows.items():
        row.update(extra[name])
        base = rows[next(n for n, (family, _) in VARIANTS.items() if family == row["model"])]
        row["macs_ratio"] = base["macs"] / row["macs"]
        row["params_ratio"] = base["params"] / row["params"]
        row["val_acc_delta_points"] = 100.0 * (row["val_acc"] - base["val_acc"])
    return {"settings": {**s, "round_to": round_to, "torch_threads": torch.get_num_threads()}, "rows": rows}


def format_table(result: dict[str, Any]) -> str:
    """The rows as a fixed-width text table (latency speedups at each measured batch)."""
    m = result["settings"]["latency_batch"]
    head = f"{'variant':<16}{'params':>10}{'nonzero':>10}{'MACs':>12}{'MACs x':>8}{'b1 ms':>8}{'b1 x':>7}"
    head += f"{f'b{m} x':>7}{'b64 ms':>9}{'b64 x':>7}{'val_acc':>9}{'d pts':>7}"
    lines = [head]
    for name, r in result["rows"].items():
        lines.append(
            f"{name:<16}{r['params']:>10,.0f}{r['nonzero_params']:>10,.0f}{r['macs']:>12,.0f}{r['macs_ratio']:>8.2f}"
            f"{r['latency_ms_b1']:>8.2f}{r['latency_speedup_b1']:>7.2f}{r[f'latency_speedup_b{m}']:>7.2f}"
            f"{r['latency_ms_b64']:>9.1f}{r['latency_speedup_b64']:>7.2f}{r['val_acc']:>9.3f}"
            f"{r['val_acc_delta_points']:>7.1f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tiny run for smoke tests")
    parser.add_argument("--out", default=str(DEFAULT_OUT), help="where to write the JSON results")
    parser.add_argument("--root", default=None, help="cache directory for the demo images")
    parser.add_argument("--round-to", type=int, default=None, help="StructuredPruning round_to (default 8; 2 quick)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads for training and timing (default 1)")
    args = parser.parse_args(argv)
    return run(quick=args.quick, out=args.out, root=args.root, round_to=args.round_to, threads=args.threads)


if __name__ == "__main__":
    main()
