"""Resume and DDP for the whole pack together: every callback at once, stopped and resumed, or on two ranks."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from conftest import run_ddp_script, tiny_trainer
from lightning.pytorch.callbacks import ModelCheckpoint

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
from combined_ddp import MAX_EPOCHS, LrRecorder, OrderedTiny, combined_callbacks, decisions, find

from lightning_speedkit import Int8Export, UtilizationMonitor

STEPS_PER_EPOCH = 8  # 128 samples at the found batch size 16

pytestmark = [
    pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`, callbacks used to create the checkpoint"),
    pytest.mark.filterwarnings("ignore:Checkpoint directory .* exists and is not empty"),
    pytest.mark.filterwarnings("ignore:The dirpath has changed from"),
]


def _fit(root: Path, ckpt_path: str | None = None) -> dict[str, Any]:
    """The combined run (checkpoint at every epoch end), from scratch or resumed; its decisions and records."""
    L.seed_everything(0, verbose=False)
    model, recorder = OrderedTiny(), LrRecorder()
    checkpoints = ModelCheckpoint(dirpath=root / "ckpt", save_top_k=-1, filename="{epoch}")
    trainer = tiny_trainer(
        root,
        max_epochs=MAX_EPOCHS,
        enable_checkpointing=True,
        callbacks=[*combined_callbacks(root / "int8"), recorder, checkpoints],
    )
    trainer.fit(model, ckpt_path=ckpt_path, weights_only=True)
    result = decisions(trainer, model)
    result.update(
        lrs=recorder.lrs,
        global_step=trainer.global_step,
        monitor=find(trainer, UtilizationMonitor).report(),
        int8=find(trainer, Int8Export).report(),
        params={n: p.detach().clone() for n, p in model.named_parameters()},
    )
    return result


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """The combined run from start to end, with a checkpoint at every epoch end."""
    root = tmp_path_factory.mktemp("uninterrupted")
    return root, _fit(root)


def test_uninterrupted_combined_run_uses_every_callback(uninterrupted: tuple[Path, dict[str, Any]]) -> None:
    """All six callbacks act in one fit: size found, loaders tuned, warmup, pruning, monitor windows, INT8 export."""
    _, full = uninterrupted
    assert full["batch_size"] == 16
    assert full["trials"] == [(8, True), (16, True)]
    assert full["data"]["num_workers"] == 0
    assert full["shapes"]["net.0.weight"] == [16, 16]  # 32 hidden units pruned to 16
    assert [s["epoch"] for s in full["pruning_steps"]] == [1]
    assert full["schedule"] == (12, MAX_EPOCHS * STEPS_PER_EPOCH - STEPS_PER_EPOCH, STEPS_PER_EPOCH)  # re-warmed
    assert full["lrs"][STEPS_PER_EPOCH] == 0.0  # the re-warmup's first step
    assert full["monitor"]["batches"] == MAX_EPOCHS * STEPS_PER_EPOCH
    assert full["int8"]["verification"]["samples"] == 128
    assert Path(full["int8"]["int8_path"]).is_file()


@pytest.mark.parametrize(
    ("epoch", "where"),
    [(0, "mid-warmup"), (1, "right after the pruning step, mid-rewarm"), (2, "mid-fine-tune")],
)
def test_resumed_combined_run_equals_the_uninterrupted_one(
    tmp_path: Path, uninterrupted: tuple[Path, dict[str, Any]], epoch: int, where: str
) -> None:
    """Stopped at an epoch end and resumed: same LRs, batch size, data settings, architecture, weights and export."""
    full_root, full = uninterrupted
    resumed = _fit(tmp_path, str(full_root / "ckpt" / f"epoch={epoch}.ckpt"))
    first = (epoch + 1) * STEPS_PER_EPOCH
    assert sorted(resumed["lrs"]) == list(range(first, MAX_EPOCHS * STEPS_PER_EPOCH)), where
    assert resumed["lrs"] == pytest.approx({k: v for k, v in full["lrs"].items() if k >= first}, rel=1e-6), where
    for key in ("batch_size", "finder", "trials", "data", "history", "pruning_steps", "schedule", "shapes"):
        assert resumed[key] == full[key], (where, key)
    assert resumed["global_step"] == full["global_step"]
    for name, value in full["params"].items():
        torch.testing.assert_close(resumed["params"][name], value, rtol=1e-5, atol=1e-6, msg=f"{where}: {name}")
    assert resumed["monitor"]["batches"] == full["monitor"]["batches"]  # counters continue across the resume
    assert resumed["int8"]["verification"]["top1_agreement"] == full["int8"]["verification"]["top1_agreement"]
    assert resumed["int8"]["int8_bytes"] == full["int8"]["int8_bytes"]


@pytest.mark.slow
@pytest.mark.ddp
def test_combined_run_under_two_process_ddp(tmp_path: Path) -> None:
    """Under ``strategy="ddp"`` on 2 CPUs both ranks make the same decisions, and only rank 0 logs or speaks."""
    rank0, rank1 = run_ddp_script("combined_ddp", tmp_path)
    for key in ("batch_size", "finder", "trials", "data", "history", "pruning_steps", "schedule", "shapes", "lrs"):
        assert rank0[key] == rank1[key], key
    assert rank0["weights"] == pytest.approx(rank1["weights"], abs=1e-6)  # DDP keeps replicas in sync
    assert rank0["history"]
    assert rank0["finder"]["global_batch"] == 2 * rank0["batch_size"]
    assert rank0["int8_report"] == rank1["int8_report"]
    assert len(list((tmp_path / "int8").glob("*.onnx"))) == 2  # one export (int8 + fp32), by rank 0
    assert {"speedkit/batch_size", "speedkit/lr/factor", "speedkit/pruning/macs", "speedkit/data/num_workers",
            "speedkit/int8/size_ratio"} <= set(rank0["speedkit_keys"])  # fmt: skip
    assert any(k.startswith("speedkit/monitor/") for k in rank0["speedkit_keys"])
    assert rank1["speedkit_keys"] == []
    assert rank0["messages"]
    assert rank1["messages"] == []
