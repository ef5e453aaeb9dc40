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
import functools
import os
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelPruning

from lightning_speedkit.demo import DemoClassifier, DemoDataModule
from lightning_speedkit.pruning import StructuredPruning, count_macs_params
from lightning_speedkit.timing import median_ms
from lightning_speedkit.warmup import WarmupScheduler

if str(Path(__file__).resolve().parent) not in sys.path:  # _harness and _models, also when loaded by path
    sys.path.append(str(Path(__file__).resolve().parent))

from _harness import Column, interleaved, print_and_write, quiet_trainer, table, timed_fit
from _models import TextClassifier, ViTClassifier

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


# ---------------------------------------------------------------------------------------------- the runs


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


def _fastest_ms(run: Callable[[], object], calls: int = 3) -> float:
    """The fastest of ``calls`` eval passes (``run``), in ms."""
    with torch.inference_mode():
        return min(median_ms(run, 1, warmup=0) for _ in range(calls))


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
        runs = {name: functools.partial(m, *_batch_of(m.example_input_array, batch)) for name, m in models.items()}
        for run in runs.values():
            _fastest_ms(run)  # warm-up: allocator, kernels
        samples = interleaved(runs, rounds, _fastest_ms)
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
    print_and_write(format_table(result), result, out)
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
        # The same LR schedule for every variant: a short warmup, then cosine decay; StructuredPruning restarts it
        # after its step, so the fine-tune gets its own warmup (fresh optimizer moments at full LR otherwise knock
        # the pruned net back) and decays to convergence like the baseline.
        callbacks = [WarmupScheduler(warmup=0.05, decay="cosine"), *_callbacks(how, s, round_to)]
        fit = timed_fit(quiet_trainer(devices=1, max_epochs=s["epochs"], callbacks=callbacks), model, data)
        models[name] = model
        pruning = next((c for c in callbacks if isinstance(c, StructuredPruning)), None)
        steps = pruning.report().get("steps", []) if pruning is not None else []
        extra[name] = {
            "model": family,
            "pruning": how or "none",
            "val_acc": fit.val_acc,
            "fit_s": fit.seconds,
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
    columns = [
        Column("variant", 16, "variant", align="<"),
        Column("params", 10, "params", ",.0f"),
        Column("nonzero", 10, "nonzero_params", ",.0f"),
        Column("MACs", 12, "macs", ",.0f"),
        Column("MACs x", 8, "macs_ratio", ".2f"),
        Column("b1 ms", 8, "latency_ms_b1", ".2f"),
        Column("b1 x", 7, "latency_speedup_b1", ".2f"),
        Column(f"b{m} x", 7, f"latency_speedup_b{m}", ".2f"),
        Column("b64 ms", 9, "latency_ms_b64", ".1f"),
        Column("b64 x", 7, "latency_speedup_b64", ".2f"),
        Column("val_acc", 9, "val_acc", ".3f"),
        Column("d pts", 7, "val_acc_delta_points", ".1f"),
    ]
    return table(columns, [{"variant": name, **row} for name, row in result["rows"].items()])


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
