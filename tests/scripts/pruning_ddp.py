"""Two-process CPU DDP run of StructuredPruning; every rank writes its history and weight checksum to a JSON file.

Run as ``python tests/scripts/pruning_ddp.py OUT_DIR`` (Lightning's ``ddp`` launcher starts the second process).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from conftest import TinyClassifier, end_process_group

from lightning_speedkit.pruning import StructuredPruning, pruning_history


class Record(Callback):
    """Writes this rank's pruning history, parameter shapes and a weight checksum at the end of training."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Write ``rank{N}.json``."""
        optimizer_params = {id(p) for g in trainer.optimizers[0].param_groups for p in g["params"]}
        record = {
            "history": [list(r) for r in pruning_history(pl_module)],
            "shapes": {n: list(p.shape) for n, p in pl_module.named_parameters()},
            "weights": [float(v) for v in torch.cat([p.detach().flatten() for p in pl_module.parameters()])],
            "optimizer_has_all": optimizer_params == {id(p) for p in pl_module.parameters()},
            "ddp_wraps_module": trainer.strategy.model.module is pl_module,  # type: ignore[union-attr]
        }
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


def main(out: Path) -> None:
    L.seed_everything(0, verbose=False)
    model = TinyClassifier()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_epochs=3,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        callbacks=[StructuredPruning(amount=0.5, start_epoch=1, finetune_epochs=1, round_to=None), Record(out)],
    )
    trainer.fit(model)
    end_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
