"""A tiny model trained from a litdata directory under ``preset()``: the parts the streaming tests share.

Imported by ``tests/test_streaming_fit.py`` for the single-process runs, and run as a script under ``torchrun`` for
the distributed ones (a script, not a pytest test, because a ``ddp`` rank must not re-run pytest)::

    torchrun ... tests/scripts/streaming_fit.py nodes DATA_DIR OUT_DIR    # 2 nodes x 1 process: one fit
    torchrun ... tests/scripts/streaming_fit.py resume DATA_DIR OUT_DIR   # stop mid-epoch, resume from the checkpoint

Every rank writes ``OUT_DIR/rank{N}.json``: the sample indices it trained on (by phase) and its final weights.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from conftest import end_process_group

from lightning_speedkit import preset
from lightning_speedkit.data.streaming import streaming_dataset, write_streaming

NUM_SAMPLES = 64
BATCH_SIZE = 4
STOP_AT = 3  # optimizer steps before the mid-epoch stop


class Numbered:
    """``NUM_SAMPLES`` samples ``(x, y, index)``: 8 seeded features, a label from their sign, the sample's index."""

    def __init__(self, count: int = NUM_SAMPLES) -> None:
        rng = np.random.default_rng(0)
        self.x = rng.standard_normal((count, 8)).astype(np.float32)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[np.ndarray[Any, Any], int, int]:
        return self.x[index], int(self.x[index, 0] > 0), index


def write_numbered(directory: Path, count: int = NUM_SAMPLES, chunk_bytes: str = "256B") -> Path:
    """The litdata dataset of `Numbered` (small chunks: several per rank)."""
    return write_streaming(Numbered(count), directory, chunk_bytes=chunk_bytes, start_method="fork")


class Slow:
    """A per-sample transform that sleeps ``delay`` seconds: a decode, or a read from far away."""

    def __init__(self, delay: float) -> None:
        self.delay = delay

    def __call__(self, sample: Any) -> Any:
        time.sleep(self.delay)
        return sample


class Recorded(L.LightningModule):
    """A linear classifier that records the sample indices of every training step it takes."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Linear(8, 2)
        self.seen: list[int] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, index = batch
        self.seen += [int(i) for i in index]
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class StreamingData(L.LightningDataModule):
    """A shuffled ``StreamingDataLoader`` over ``directory``."""

    def __init__(self, directory: Path, num_workers: int = 0, delay: float = 0.0) -> None:
        super().__init__()
        self.directory, self.num_workers, self.delay = directory, num_workers, delay

    def train_dataloader(self) -> Any:
        from litdata import StreamingDataLoader

        transform = Slow(self.delay) if self.delay else None
        dataset = streaming_dataset(self.directory, shuffle=True, seed=7, transform=transform)
        return StreamingDataLoader(dataset, batch_size=BATCH_SIZE, num_workers=self.num_workers)


def trainer(root: Path, **kwargs: Any) -> L.Trainer:
    """``preset()`` on CPU, quiet, saving no checkpoints unless a callback asks."""
    options: dict[str, Any] = {
        "accelerator": "cpu",
        "logger": False,
        "verbose": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "default_root_dir": root,
        "max_epochs": 1,
    }
    return preset(**{**options, **kwargs})


def resume_run(data: Path, out: Path, num_workers: int = 0, **kwargs: Any) -> dict[str, Any]:
    """Fit ``STOP_AT`` steps with a checkpoint, then resume the epoch from it in a new Trainer; what each part saw."""
    checkpoint = ModelCheckpoint(dirpath=out / "ckpt", every_n_train_steps=STOP_AT, save_top_k=-1)
    first = Recorded()
    trainer(out, max_steps=STOP_AT, callbacks=[checkpoint], enable_checkpointing=True, **kwargs).fit(
        first, StreamingData(data, num_workers)
    )
    path = checkpoint.best_model_path or str(next((out / "ckpt").glob("*.ckpt")))
    second = Recorded()
    resumed = trainer(out, **kwargs)
    resumed.fit(second, StreamingData(data, num_workers), ckpt_path=path)
    return {"before": first.seen, "after": second.seen, "weights": _weights(second), "rank": resumed.global_rank}


def nodes_run(data: Path, out: Path) -> dict[str, Any]:
    """One fit over 2 nodes of one process each (torchrun sets the ranks)."""
    model = Recorded()
    fit = trainer(out, devices=1, num_nodes=2)
    fit.fit(model, StreamingData(data))
    record = {"after": model.seen, "weights": _weights(model), "rank": fit.global_rank, "node_rank": fit.node_rank}
    return record | {"world_size": fit.world_size}


def _weights(model: torch.nn.Module) -> list[float]:
    return [float(v) for p in model.parameters() for v in p.detach().flatten()]


if __name__ == "__main__":
    mode, data_dir, out_dir = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", "0"))
    record = nodes_run(data_dir, out_dir) if mode == "nodes" else resume_run(data_dir, out_dir, devices=2)
    (out_dir / f"rank{rank}.json").write_text(json.dumps(record))
    end_process_group()
