"""Structured pruning vs Lightning's ModelPruning vs no pruning, same demo ResNet, data and epochs, in one run.

For each variant: parameters (and non-zero parameters), MACs (torch-pruning's counter), median CPU latency at batch
1 and 64, and validation accuracy at the end. Ratios are against the unpruned baseline of the same run.

    python benchmarks/pruning.py            # ~2000 images, width 16, 8 epochs (minutes on 2 CPU cores)
    python benchmarks/pruning.py --quick    # seconds: a smoke run for the tests
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelPruning

from lightning_speedkit.demo import DemoClassifier, DemoDataModule
from lightning_speedkit.pruning import StructuredPruning, count_macs_params, cpu_latency_ms
from lightning_speedkit.report import write_json_atomic
from lightning_speedkit.warmup import WarmupScheduler

DEFAULT_OUT = Path(__file__).parent / "results" / "pruning.json"


def _settings(quick: bool) -> dict[str, Any]:
    if quick:
        return {
            "num_images": 120,
            "width": 8,
            "epochs": 3,
            "prune_epoch": 1,
            "batch_size": 16,
            "repeats": 3,
            "round_to": 2,
        }
    return {
        "num_images": 2000,
        "width": 16,
        "epochs": 8,
        "prune_epoch": 4,
        "batch_size": 32,
        "repeats": 30,
        "round_to": 8,
    }


def _variant(name: str, s: dict[str, Any], round_to: int | None) -> list[Callback]:
    if name == "structured":
        return [
            StructuredPruning(
                target_speedup=2.0,
                start_epoch=s["prune_epoch"],
                finetune_epochs=s["epochs"] - s["prune_epoch"] - 1,
                round_to=round_to,
                monitor="val_acc",
                latency_batch_sizes=(),
            )
        ]
    if name == "modelpruning":
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


def _measure(models: dict[str, DemoClassifier], repeats: int) -> dict[str, dict[str, float]]:
    """Size and MACs of each model, and its median CPU latency over interleaved rounds.

    Interleaving makes load from other processes on a shared machine hit every variant alike.
    """
    models = {name: copy.deepcopy(m).cpu().eval() for name, m in models.items()}
    rows: dict[str, dict[str, float]] = {}
    for name, model in models.items():
        macs, params = count_macs_params(model, model.example_input_array)
        nonzero = sum(int(p.count_nonzero()) for p in model.parameters())
        rows[name] = {"params": float(params), "nonzero_params": float(nonzero), "macs": macs}
    for batch, rounds in ((1, repeats), (64, max(3, repeats // 3))):
        samples: dict[str, list[float]] = {name: [] for name in models}
        for _ in range(rounds):
            for name, model in models.items():
                samples[name].append(cpu_latency_ms(model, model.example_input_array, batch, repeats=3))
        for name in models:
            rows[name][f"latency_ms_b{batch}"] = statistics.median(samples[name])
    return rows


def run(
    quick: bool = False, out: str | Path = DEFAULT_OUT, root: str | Path | None = None, round_to: int = 8
) -> dict[str, Any]:
    """Train the three variants, measure them, print the table and write the JSON to ``out``."""
    s = _settings(quick)
    round_to = s["round_to"] if round_to is None else round_to
    models: dict[str, DemoClassifier] = {}
    extra: dict[str, dict[str, float]] = {}
    for name in ("baseline", "structured", "modelpruning"):
        L.seed_everything(0, verbose=False)
        model = DemoClassifier(width=s["width"])  # the default LR: 2e-3 stalls this net without warmup
        data = DemoDataModule(num_images=s["num_images"], batch_size=s["batch_size"], root=root)
        trainer = L.Trainer(
            accelerator="cpu",
            devices=1,
            max_epochs=s["epochs"],
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            # The same LR schedule for every variant: a short warmup at the start; StructuredPruning re-warms
            # through it after its step (fresh optimizer moments at full LR otherwise knock the pruned net back).
            callbacks=[WarmupScheduler(warmup=0.05, decay="constant"), *_variant(name, s, round_to)],
        )
        start = time.perf_counter()
        trainer.fit(model, data)
        models[name] = model
        extra[name] = {"val_acc": float(trainer.callback_metrics["val_acc"]), "fit_s": time.perf_counter() - start}
    rows = _measure(models, s["repeats"])
    for name, row in rows.items():
        row.update(extra[name])
    base = rows["baseline"]
    for row in rows.values():
        row["macs_ratio"] = base["macs"] / row["macs"]
        row["params_ratio"] = base["params"] / row["params"]
        row["latency_speedup_b1"] = base["latency_ms_b1"] / row["latency_ms_b1"]
        row["latency_speedup_b64"] = base["latency_ms_b64"] / row["latency_ms_b64"]
        row["val_acc_delta_points"] = 100.0 * (row["val_acc"] - base["val_acc"])
    result = {"settings": {**s, "round_to": round_to, "torch_threads": torch.get_num_threads()}, "rows": rows}
    print(format_table(result))
    write_json_atomic(result, out)
    return result


def format_table(result: dict[str, Any]) -> str:
    """The rows as a fixed-width text table."""
    head = f"{'variant':<13}{'params':>10}{'nonzero':>10}{'MACs':>12}{'MACs x':>8}{'b1 ms':>8}{'b1 x':>7}"
    head += f"{'b64 ms':>9}{'b64 x':>7}{'val_acc':>9}{'d pts':>7}"
    lines = [head]
    for name, r in result["rows"].items():
        lines.append(
            f"{name:<13}{r['params']:>10,.0f}{r['nonzero_params']:>10,.0f}{r['macs']:>12,.0f}{r['macs_ratio']:>8.2f}"
            f"{r['latency_ms_b1']:>8.2f}{r['latency_speedup_b1']:>7.2f}{r['latency_ms_b64']:>9.1f}"
            f"{r['latency_speedup_b64']:>7.2f}{r['val_acc']:>9.3f}{r['val_acc_delta_points']:>7.1f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tiny run for smoke tests")
    parser.add_argument("--out", default=str(DEFAULT_OUT), help="where to write the JSON results")
    parser.add_argument("--root", default=None, help="cache directory for the demo images")
    parser.add_argument("--round-to", type=int, default=None, help="StructuredPruning round_to (default 8; 2 quick)")
    args = parser.parse_args(argv)
    return run(quick=args.quick, out=args.out, root=args.root, round_to=args.round_to)


if __name__ == "__main__":
    main()
