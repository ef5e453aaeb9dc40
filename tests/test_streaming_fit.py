"""Fits from a litdata directory, on real litdata in a temporary directory.

The loader tuner on a StreamingDataLoader, mid-epoch resume under ``preset()`` (one process, and two gloo ranks under
torchrun), and a 2-"node" torchrun launch on one host (c10d rendezvous).
"""

from __future__ import annotations

import math
import os
import socket
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

pytest.importorskip("litdata")

from conftest import rank_records

from lightning_speedkit import DataLoaderTuner
from lightning_speedkit.data.streaming import streaming_dataset
from lightning_speedkit.dataloader import settings_name
from lightning_speedkit.dataloader.rebuild import LoaderSettings, complete_settings

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from streaming_fit import NUM_SAMPLES, STOP_AT, Recorded, StreamingData, resume_run, write_numbered

SCRIPT = Path(__file__).parent / "scripts" / "streaming_fit.py"
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def numbered(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """64 numbered samples in litdata's format, written once for the module."""
    return write_numbered(tmp_path_factory.mktemp("streaming_fit") / "numbered")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _torchrun(launch: list[str], mode: str, data: Path, out: Path) -> subprocess.Popen[bytes]:
    """``torchrun LAUNCH tests/scripts/streaming_fit.py MODE DATA OUT``, its output in ``out/torchrunN.log``."""
    log = (out / f"torchrun{len(list(out.glob('torchrun*')))}.log").open("wb")
    command = [sys.executable, "-m", "torch.distributed.run", *launch, str(SCRIPT), mode, str(data), str(out)]
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(command, cwd=ROOT, env=environment, stdout=log, stderr=subprocess.STDOUT)


def _wait(processes: list[subprocess.Popen[bytes]], out: Path) -> None:
    codes = [p.wait(timeout=300) for p in processes]
    logs = "\n".join(p.read_text()[-3000:] for p in sorted(out.glob("torchrun*.log")))
    assert codes == [0] * len(codes), logs


class _Epochs(L.Callback):
    """The sample indices each epoch trained on (counted from the model's record at each epoch's start and end)."""

    def __init__(self) -> None:
        self.start = 0
        self.epochs: list[list[int]] = []

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.start = len(pl_module.seen)  # type: ignore[arg-type]

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.epochs.append(list(pl_module.seen[self.start :]))  # type: ignore[index]


@pytest.mark.slow
def test_tuner_times_workers_on_a_streaming_loader_and_rebuilds_it_as_one(tmp_path: Path) -> None:
    """With a slow per-sample read the tuner times workers and prefetch, rebuilds a StreamingDataLoader with the winner.

    It also says which litdata settings it left alone, and every epoch after the probe trains on every sample once.
    """
    from litdata import StreamingDataLoader

    data = write_numbered(tmp_path / "data", count=640, chunk_bytes="4KB")
    tuner = DataLoaderTuner(max_workers=2, remember=False)
    epochs = _Epochs()
    trainer = L.Trainer(
        accelerator="cpu",
        max_epochs=4,  # 4 epochs of 160 steps: the read's wait repays the candidates' trials and worker start-ups
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        callbacks=[tuner, epochs],
    )
    trainer.fit(Recorded(), StreamingData(data, delay=0.003))
    report = tuner.report()
    assert report["probed"], report["reason"]
    assert report["streaming"] is True
    assert [note.split(":")[0] for note in report["not_tuned"]] == ["chunk size", "max_cache_size", "max_pre_download"]
    tried = set(report["step_ms"])
    assert settings_name(report["baseline"]) in tried
    assert any("prefetch_factor=4" in name for name in tried)
    assert report["rebuilt"] is True  # 3 ms a sample read in the step's process: 2 workers win by far on 2 cores
    assert report["chosen"]["num_workers"] >= 1
    loader = trainer.train_dataloader
    assert isinstance(loader, StreamingDataLoader)
    assert (loader.num_workers, loader.batch_size) == (report["chosen"]["num_workers"], 4)
    for seen in epochs.epochs[1:]:  # epoch 0 also holds the probe's restored steps
        assert sorted(seen) == list(range(640))


class _HeldData(StreamingData):
    """``StreamingData`` whose loader is built once, in ``setup``: every call of the hook returns the same loader."""

    def setup(self, stage: str) -> None:
        self.loader = super().train_dataloader()

    def train_dataloader(self) -> Any:
        return self.loader


class _TrialAtStart(L.Callback):
    """Runs a restored trial of 3 steps at fit start: they iterate the run's own loader when the source holds it."""

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        from lightning_speedkit.trials import AsIs, TrialSession

        with TrialSession(trainer, steps=3) as session:
            session.run(AsIs())


@pytest.mark.parametrize("held", ["datamodule", "fit"])
def test_a_trial_leaves_a_held_streaming_loader_where_it_was(numbered: Path, tmp_path: Path, held: str) -> None:
    """Trials on the run's own StreamingDataLoader: the fit sees every sample of each epoch once, in the plain order.

    The loader keeps its epoch and the samples it yielded on itself: the trial moved them, and the fit began one
    shuffle epoch ahead, its first epoch 12 samples short (the tuner's probe lost 16 of 320 that way).
    """
    from litdata import StreamingDataLoader

    runs = []
    for callbacks in ([], [_TrialAtStart()]):
        model, epochs = Recorded(), _Epochs()
        data = _HeldData(numbered)
        trainer = L.Trainer(
            accelerator="cpu", max_epochs=2, logger=False, enable_progress_bar=False, enable_model_summary=False,
            enable_checkpointing=False, callbacks=[*callbacks, epochs], default_root_dir=tmp_path,
        )  # fmt: skip
        if held == "fit":
            dataset = streaming_dataset(numbered, shuffle=True, seed=7)
            trainer.fit(model, train_dataloaders=StreamingDataLoader(dataset, batch_size=4))
        else:
            trainer.fit(model, data)
        runs.append([seen[-64:] for seen in epochs.epochs])  # epoch 0 also holds the trial's 12 samples
    assert runs[1] == runs[0]
    assert all(sorted(seen) == list(range(64)) for seen in runs[1])


class _StopAt(L.Callback):
    """Stop the fit after ``step`` optimizer steps, as a preempted job would."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: L.Trainer, *args: object) -> None:
        if trainer.global_step >= self.step:
            trainer.should_stop = True


@pytest.mark.slow
def test_a_tuned_streaming_loader_resumes_mid_epoch_with_its_state(tmp_path: Path) -> None:
    """A fit whose tuner rebuilt the StreamingDataLoader, resumed mid-epoch, sees the epoch's samples exactly once."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    data = write_numbered(tmp_path / "data", count=640, chunk_bytes="4KB")
    stop = 160 + 80  # half-way through the second epoch (160 batches an epoch; the probe's steps are restored)
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=stop, save_top_k=-1)
    tuner, epochs, first = DataLoaderTuner(max_workers=2, remember=False), _Epochs(), Recorded()
    options = {"accelerator": "cpu", "logger": False, "enable_progress_bar": False, "enable_model_summary": False}
    slow = StreamingData(data, num_workers=0, delay=0.003)
    stopper = _StopAt(stop)  # a stop the run did not plan: its budget (3 epochs) lets the probe pay back
    L.Trainer(max_epochs=3, callbacks=[tuner, epochs, checkpoint, stopper], **options).fit(first, slow)
    assert tuner.report()["rebuilt"] is True, tuner.report()["reason"]
    workers = tuner.report()["chosen"]["num_workers"]
    resumed_tuner, second = DataLoaderTuner(max_workers=2, remember=False), Recorded()
    resumed = L.Trainer(max_epochs=2, callbacks=[resumed_tuner], enable_checkpointing=False, **options)  # to epoch end
    resumed.fit(second, slow, ckpt_path=checkpoint.best_model_path)
    assert resumed_tuner.report()["source"] == "resumed"
    assert resumed.train_dataloader.num_workers == workers >= 1
    before = first.seen[epochs.start :]  # the second epoch's first half, before the stop
    assert len(before) == 80 * 4
    assert Counter(before + second.seen) == Counter(range(640))


def test_mid_epoch_resume_under_preset_sees_every_sample_once(numbered: Path, tmp_path: Path) -> None:
    """A preset() fit from litdata, stopped mid-epoch and resumed from its checkpoint, sees every sample once."""
    record = resume_run(numbered, tmp_path, num_workers=2)
    assert len(record["before"]) == STOP_AT * 4
    assert Counter(record["before"] + record["after"]) == Counter(range(NUM_SAMPLES))


@pytest.mark.slow
@pytest.mark.ddp
def test_mid_epoch_resume_on_two_gloo_ranks_sees_every_sample_once(numbered: Path, tmp_path: Path) -> None:
    """Two gloo ranks under preset(), resumed mid-epoch: every sample once, each rank its own, identical weights."""
    run = _torchrun(["--nproc-per-node=2", f"--master-port={_free_port()}"], "resume", numbered, tmp_path)
    _wait([run], tmp_path)
    ranks = rank_records(tmp_path)
    assert [len(r["before"]) for r in ranks] == [STOP_AT * 4] * 2
    seen = [r["before"] + r["after"] for r in ranks]
    assert not set(seen[0]) & set(seen[1])
    assert Counter(seen[0] + seen[1]) == Counter(range(NUM_SAMPLES))
    assert ranks[0]["weights"] == ranks[1]["weights"]


@pytest.mark.slow
@pytest.mark.ddp
def test_two_node_torchrun_launch_reads_one_shard_per_rank(numbered: Path, tmp_path: Path) -> None:
    """Two torchrun "nodes" (c10d, one process each, preset(num_nodes=2)): each rank its own half, identical weights."""
    port = _free_port()
    args = ["--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}"]
    nodes = [_torchrun([*args, "--rdzv-id=speedkit-streaming"], "nodes", numbered, tmp_path) for _ in range(2)]
    _wait(nodes, tmp_path)
    ranks = rank_records(tmp_path)
    assert [r["world_size"] for r in ranks] == [2, 2]
    assert sorted(r["node_rank"] for r in ranks) == [0, 1]
    assert [len(r["after"]) for r in ranks] == [math.ceil(NUM_SAMPLES / 2)] * 2
    assert not set(ranks[0]["after"]) & set(ranks[1]["after"])
    assert sorted(ranks[0]["after"] + ranks[1]["after"]) == list(range(NUM_SAMPLES))
    assert ranks[0]["weights"] == ranks[1]["weights"]


class _StreamingVal(L.LightningDataModule):
    """Tensor rows to train on, and a litdata loader of the numbered samples to validate on."""

    def __init__(self, data: Path) -> None:
        super().__init__()
        self.data = data

    def train_dataloader(self) -> DataLoader[Any]:
        x = torch.randn(32, 8, generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(x, (x[:, 0] > 0).long(), torch.arange(32)), batch_size=4)

    def val_dataloader(self) -> Any:
        from litdata import StreamingDataLoader  # type: ignore[import-untyped]

        return StreamingDataLoader(streaming_dataset(self.data, shuffle=False), batch_size=4, num_workers=0)


class _ValSeen(Recorded):
    """The sample indices each validation saw."""

    def __init__(self) -> None:
        super().__init__()
        self.val_seen: list[list[int]] = []

    def on_validation_epoch_start(self) -> None:
        self.val_seen.append([])

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.val_seen[-1] += [int(i) for i in batch[2]]


class _RebuildAtFirstEpochEnd(L.Callback):
    """What `DataLoaderTuner` does at a counted epoch's end when it chose a setting: the held loaders rebuilt."""

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.current_epoch == 0:
            hooks = ("train_dataloader", "val_dataloader")
            LoaderSettings(trainer.datamodule, complete_settings(0), hooks).rebuild_in_place(trainer)


def test_a_streaming_val_loader_cut_short_starts_every_validation_over_after_a_rebuild(
    numbered: Path, tmp_path: Path
) -> None:
    """A litdata val loader the tuner rebuilds after a validation cut short (``limit_val_batches``) starts over.

    Rebuilt in place, it carried where the last pass stopped: every later validation resumed at sample 8 and scored
    other samples than the run without the tuner.
    """
    seen = []
    for callbacks in ([], [_RebuildAtFirstEpochEnd()]):
        model = _ValSeen()
        trainer = L.Trainer(
            accelerator="cpu", max_epochs=3, limit_val_batches=2, num_sanity_val_steps=0, logger=False,
            enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, callbacks=callbacks,
            default_root_dir=tmp_path,
        )  # fmt: skip
        trainer.fit(model, _StreamingVal(numbered))
        seen.append(model.val_seen)
    assert seen[0] == [list(range(8))] * 3
    assert seen[1] == seen[0]
