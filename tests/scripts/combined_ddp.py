"""The whole pack in one run: the model, callbacks and recorders shared by the reliability tests.

Imported by ``tests/test_reliability_resume.py`` for the single-process resume runs, and run as a script for the
2-process ``strategy="ddp"`` run (Lightning's ``ddp`` launcher starts the second process, which is why this is a
script and not a pytest test)::

    python tests/scripts/combined_ddp.py OUT_DIR

Every rank writes ``OUT_DIR/rank{N}.json``: the decisions it made (batch size, data settings, pruning history,
warmup schedule), its parameter shapes and weights, the keys it logged and the speedkit messages it emitted.
"""

from __future__ import annotations

import json
import logging
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader
from typing_extensions import override

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from conftest import KeyLogger, TinyClassifier, end_process_group

from lightning_speedkit import (
    BatchSizeFinder,
    ChannelsLast,
    DataLoaderTuner,
    Int8Export,
    StructuredPruning,
    UtilizationMonitor,
    WarmupScheduler,
)
from lightning_speedkit.pruning import pruning_history

SPEEDKIT_NAMES = ("BatchSizeFinder", "DataLoaderTuner", "Int8Export", "StructuredPruning", "UtilizationMonitor",
                  "WarmupScheduler")  # fmt: skip
MAX_EPOCHS = 4  # epoch 0 dense, prune at the start of epoch 1, fine-tune epochs 1-3


class OrderedTiny(TinyClassifier):
    """TinyClassifier (128 samples) without shuffling: the batches of an epoch do not depend on the global RNG.

    Lightning does not checkpoint the global RNG, so a shuffled loader would see other batches after a resume.
    """

    def __init__(self) -> None:
        super().__init__(num_samples=128)

    @override
    def train_dataloader(self) -> DataLoader[tuple[torch.Tensor, ...]]:
        return DataLoader(self._data(0), batch_size=self.batch_size)


class LrRecorder(Callback):
    """Records ``(global_step, lr)`` of every optimizer step, as the step uses it (inside the warmup's multiplier)."""

    def __init__(self) -> None:
        self.lrs: dict[int, float] = {}

    @override
    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        self.lrs[trainer.global_step] = float(optimizer.param_groups[0]["lr"])


def combined_callbacks(export_dir: Path | None) -> list[Callback]:
    """Every speedkit callback, in preset's order; Int8Export only with ``export_dir``."""
    callbacks: list[Callback] = [
        DataLoaderTuner(candidates=[{"num_workers": 0}], probe_steps=2),
        ChannelsLast(),  # the MLP has no convolutions: it must stay out of the way
        BatchSizeFinder(max_val=16, steps_per_trial=1),
        WarmupScheduler(warmup=12, decay="cosine", min_lr_ratio=0.1),
        UtilizationMonitor(window=4, summary=False),
        StructuredPruning(
            amount=0.5, start_epoch=1, finetune_epochs=2, round_to=None, rewarm=12, latency_batch_sizes=()
        ),
    ]
    if export_dir is not None:
        callbacks.append(Int8Export(export_dir, calibration_batches=2, latency_repeats=0, max_metric_drop=None))
    return callbacks


def find(trainer: L.Trainer, kind: type[Callback]) -> Any:
    """The callback of type ``kind`` in ``trainer.callbacks``."""
    return next(c for c in trainer.callbacks if isinstance(c, kind))  # type: ignore[attr-defined]


def decisions(trainer: L.Trainer, module: L.LightningModule) -> dict[str, Any]:
    """What every rank must agree on: batch size, data settings, pruning, warmup schedule, shapes, weights."""
    decision = find(trainer, BatchSizeFinder).report()
    return {
        "batch_size": module.batch_size,
        "finder": {k: decision.get(k) for k in ("batch_size", "accumulate_grad_batches", "lr_scale", "global_batch")},
        "trials": [(t["size"], t["fits"]) for t in decision.get("trials", [])],
        "data": find(trainer, DataLoaderTuner).report().get("chosen"),
        "history": [list(r) for r in pruning_history(module)],
        "pruning_steps": find(trainer, StructuredPruning).report().get("steps"),
        "schedule": find(trainer, WarmupScheduler).schedule,
        "shapes": {n: list(p.shape) for n, p in module.named_parameters()},
        "weights": [float(v) for v in torch.cat([p.detach().flatten() for p in module.parameters()])],
    }


class _Messages(logging.Handler):
    """Collects log records and warnings that start with a speedkit class name."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    @override
    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if any(name in message for name in SPEEDKIT_NAMES):
            self.lines.append(message.strip().splitlines()[0])


def main(out: Path) -> None:
    """Fit the combined run under 2-process CPU DDP and write this rank's ``rank{N}.json``."""
    handler = _Messages()
    for name in ("", "lightning.pytorch", "lightning.fabric", "lightning_fabric", "lightning_utilities", "py.warnings"):
        logging.getLogger(name).addHandler(handler)
    logging.getLogger().setLevel(logging.INFO)
    logging.captureWarnings(True)  # rank_zero_warn goes through warnings: route it to the handler too
    warnings.simplefilter("always")
    L.seed_everything(0, verbose=False)
    model, keys = OrderedTiny(), KeyLogger()
    trainer = L.Trainer(
        default_root_dir=out,
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_epochs=MAX_EPOCHS,
        logger=keys,
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        callbacks=[*combined_callbacks(out / "int8"), LrRecorder()],
    )
    trainer.fit(model)
    record = decisions(trainer, model)
    record["lrs"] = sorted(find(trainer, LrRecorder).lrs.items())
    record["speedkit_keys"] = sorted(k for k in keys.keys if k.startswith("speedkit/"))
    record["messages"] = handler.lines
    record["int8_report"] = find(trainer, Int8Export).report()
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(record, default=str))
    end_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
