"""Faults across the pack: OOM mid-run, unwritable or full export targets, broken checkpoints, and secrets."""

from __future__ import annotations

import ast
import os
import pickle
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import lightning as L
import pytest
import torch
from conftest import TinyClassifier, refusing_files, tiny_trainer
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import nn
from typing_extensions import override

from lightning_speedkit import BatchSizeFinder, Int8Export, StructuredPruning, export_int8, load_pruned_checkpoint
from lightning_speedkit.oom import MemoryLimit

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
from combined_ddp import OrderedTiny, combined_callbacks, find

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lightning_speedkit"


def listing(directory: Path) -> dict[str, bytes]:
    """Every file under ``directory`` (hidden ones too) with its bytes."""
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def mlp_and_data() -> tuple[nn.Module, list[torch.Tensor]]:
    """An MLP with ~130 KB of FP32 weights and two calibration batches."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 4)), [torch.randn(8, 64) for _ in range(2)]


# ---------------------------------------------------------------- out of memory in the middle of training


class OomFromEpoch(Callback):
    """Attaches a `MemoryLimit` below the found batch size at the start of ``epoch``: the next step runs out."""

    def __init__(self, epoch: int, limit: int) -> None:
        self.epoch, self.limit = epoch, limit

    @override
    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.current_epoch == self.epoch:
            MemoryLimit(self.limit).attach(pl_module)


def test_out_of_memory_after_the_search_is_not_swallowed(tmp_path: Path) -> None:
    """An OOM in training after the finder's search (here after pruning, epoch 2) ends the fit with that OOM."""
    L.seed_everything(0, verbose=False)
    trainer = tiny_trainer(tmp_path, max_epochs=4, callbacks=[*combined_callbacks(None), OomFromEpoch(2, limit=8)])
    with pytest.raises(torch.OutOfMemoryError, match=r"batch of 16 with room for 8 \(MemoryLimit"):
        trainer.fit(OrderedTiny())
    assert find(trainer, BatchSizeFinder).report()["batch_size"] == 16  # the search itself succeeded
    assert find(trainer, StructuredPruning).report()["steps"]  # pruning had run
    assert trainer.global_step == 16  # failed at the first step of epoch 2, not retried
    assert not any(trainer.optimizers[0]._optimizer_step_pre_hooks.values())  # warmup detached on the exception


# ---------------------------------------------------------------- exports that cannot be written


def _read_only(directory: Path) -> Path:
    """``directory`` made read-only, or a skip when this user can write there anyway (root ignores permissions)."""
    directory.chmod(0o555)
    try:
        (directory / ".probe").touch()
    except PermissionError:
        return directory
    (directory / ".probe").unlink()
    directory.chmod(0o755)
    pytest.skip("running as root: chmod does not stop writes (the 'parent is a file' case covers this path)")


@pytest.mark.parametrize("target", ["read-only directory", "parent is a regular file"])
def test_export_into_an_unwritable_place_fails_clearly_and_writes_nothing(tmp_path: Path, target: str) -> None:
    """`export_int8` into a read-only directory, or under a file, raises an OSError naming the path; nothing is left."""
    net, data = mlp_and_data()
    if target == "read-only directory":
        (tmp_path / "ro").mkdir()
        directory = _read_only(tmp_path / "ro")
    else:
        (tmp_path / "ro").write_text("a file, not a directory")
        directory = tmp_path / "ro"
    before = listing(tmp_path)
    try:
        with pytest.raises(OSError, match=re.escape(str(tmp_path / "ro"))):
            export_int8(net, data, directory / "int8" / "model.onnx", latency_repeats=0)
    finally:
        if (tmp_path / "ro").is_dir():
            (tmp_path / "ro").chmod(0o755)
    assert listing(tmp_path) == before


def _kernel_file_system() -> Path:
    """``/proc``, where no process may create a file, root included (permission bits do not say so); else a skip."""
    return refusing_files(Path("/proc"), why="/proc takes new files here")


def test_export_under_a_place_no_file_can_be_made_fails_naming_path_before_exporting() -> None:
    """`export_int8` under /proc (not writable even for root): a ValueError naming `path`, not a staging directory."""
    net, data = mlp_and_data()
    path = _kernel_file_system() / "speedkit-exports" / "model.onnx"
    match = re.escape(f"`path` must be a path in a writable directory, got {str(path)!r}: /proc is not writable (")
    with pytest.raises(ValueError, match=match):
        export_int8(net, data, path, latency_repeats=0)


@pytest.mark.skipif(sys.platform != "linux", reason="needs RLIMIT_FSIZE and SIGXFSZ (Linux)")
def test_export_onto_a_full_disk_fails_clearly_and_keeps_the_previous_export(tmp_path: Path) -> None:
    """A write that fails for space (a real EFBIG from RLIMIT_FSIZE) says so, and the previous export is untouched."""
    (tmp_path / "model.onnx").write_bytes(b"previous export")
    (tmp_path / "model.json").write_bytes(b"{}")
    before = listing(tmp_path)
    script = textwrap.dedent(
        f"""
        import resource, signal, sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_reliability_faults import mlp_and_data
        from lightning_speedkit import export_int8
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead of killing
        net, data = mlp_and_data()
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, resource.RLIM_INFINITY))
        try:
            export_int8(net, data, {str(tmp_path / "model.onnx")!r}, overwrite=True, latency_repeats=0)
        except OSError as error:
            print("OSError:", error)
            sys.exit(3)
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 3, done.stderr[-2000:]
    assert "INT8 export: cannot write the ONNX model (File too large)" in done.stdout
    assert listing(tmp_path) == before  # no staging directory, no partial file, the old export kept


@pytest.mark.parametrize("place", ["under a file", "under /proc"])
def test_callback_with_an_unwritable_dirpath_fails_before_training(
    tmp_path: Path, tiny_model: TinyClassifier, place: str
) -> None:
    """`Int8Export` checks its directory in ``setup``: the fit fails at step 0 naming `dirpath`, not after training.

    Under /proc no file can be made, root included, though the permission bits let root write: the check creates one.
    """
    if place == "under a file":
        (tmp_path / "file").write_text("not a directory")
        dirpath, problem = tmp_path / "file" / "int8", "file/int8.* is not a directory"
    else:
        dirpath, problem = _kernel_file_system() / "speedkit-int8", "/proc is not writable"
    trainer = tiny_trainer(tmp_path, callbacks=[Int8Export(dirpath)])
    match = rf"`dirpath` must be a writable directory, got .*{problem}"
    with pytest.raises(ValueError, match=match):
        trainer.fit(tiny_model)
    assert trainer.global_step == 0


# ---------------------------------------------------------------- corrupted or truncated checkpoints


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A pruned run's last checkpoint, and copies of it truncated to half and overwritten with garbage."""
    root = tmp_path_factory.mktemp("checkpoints")
    pruning = StructuredPruning(amount=0.5, start_epoch=1, finetune_epochs=0, round_to=None, latency_batch_sizes=())
    L.seed_everything(0, verbose=False)
    callbacks = [pruning, ModelCheckpoint(dirpath=root, filename="good")]
    tiny_trainer(root, max_epochs=2, enable_checkpointing=True, callbacks=callbacks).fit(TinyClassifier())
    good = root / "good.ckpt"
    data = good.read_bytes()
    (root / "truncated.ckpt").write_bytes(data[: len(data) // 2])
    (root / "garbage.ckpt").write_bytes(b"\x80\x04not a checkpoint" * 64)
    return {"good": good, "truncated": root / "truncated.ckpt", "garbage": root / "garbage.ckpt"}


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
@pytest.mark.parametrize("kind", ["truncated", "garbage"])
def test_load_pruned_checkpoint_names_a_broken_file(checkpoints: dict[str, Path], kind: str) -> None:
    """A truncated or corrupted file gives a ValueError naming `checkpoint_path` and the file; a good one loads."""
    with pytest.raises(ValueError, match=rf"`checkpoint_path` must be a readable Lightning checkpoint, got '.*{kind}"):
        load_pruned_checkpoint(TinyClassifier(), checkpoints[kind])
    assert load_pruned_checkpoint(TinyClassifier(), checkpoints["good"]).net[0].out_features == 16


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
@pytest.mark.parametrize("kind", ["truncated", "garbage"])
def test_fit_from_a_broken_checkpoint_fails_before_any_step(
    tmp_path: Path, checkpoints: dict[str, Path], kind: str
) -> None:
    """``fit(ckpt_path=...)`` of a broken file raises (weights_only: nothing executed) before training starts."""
    pruning = StructuredPruning(amount=0.5, start_epoch=1, finetune_epochs=0, round_to=None, latency_batch_sizes=())
    trainer = tiny_trainer(tmp_path, max_epochs=3, callbacks=[pruning])
    model = TinyClassifier()
    with pytest.raises((OSError, RuntimeError, ValueError, pickle.UnpicklingError)):
        trainer.fit(model, ckpt_path=str(checkpoints[kind]), weights_only=True)
    assert trainer.global_step == 0
    assert model.net[0].out_features == 32  # not half-restored into a pruned shape


# ---------------------------------------------------------------- security


def _load_calls() -> list[tuple[str, str, ast.Call]]:
    """Every ``torch.load``, ``np.load`` and ``pickle.load(s)`` call in the package: (file:line, owner, call)."""
    calls: list[tuple[str, str, ast.Call]] = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Call):
                func = node.func
                name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
                owner = getattr(func.value, "id", "") if isinstance(func, ast.Attribute) else ""
                if (owner, name) in (("torch", "load"), ("np", "load"), ("numpy", "load"), ("pickle", "load"),
                                     ("pickle", "loads")):  # fmt: skip
                    calls.append((f"{path.relative_to(ROOT)}:{node.lineno}", owner, node))
    return calls


def test_every_artifact_load_refuses_pickled_code() -> None:
    """Each ``torch.load`` in the package passes ``weights_only=True``; ``np.load`` never allows pickles; no pickle."""
    calls = _load_calls()
    assert any(owner == "torch" for _, owner, _ in calls)  # the scan finds what it looks for
    for where, owner, call in calls:
        keywords = {k.arg: k.value for k in call.keywords}
        assert owner != "pickle", f"{where}: pickle.load executes code from the file"
        if owner == "torch":
            flag = keywords.get("weights_only")
            assert isinstance(flag, ast.Constant), f"{where}: torch.load without a literal weights_only"
            assert flag.value is True, f"{where}: torch.load without weights_only=True"
        else:
            flag = keywords.get("allow_pickle")
            assert flag is None or (isinstance(flag, ast.Constant) and flag.value is False), f"{where}: allow_pickle"
    source = "\n".join(p.read_text() for p in PACKAGE.rglob("*.py"))
    assert "weights_only=False" not in source


_API_KEY_RUN = """
import logging, sys
sys.path.insert(0, {scripts!r})
import lightning as L
import wandb
import lightning_speedkit as speedkit
from combined_ddp import OrderedTiny
from lightning_speedkit import StructuredPruning
logging.basicConfig(level=logging.DEBUG)
L.seed_everything(0, verbose=False)
trainer = speedkit.preset(
    batch_size={{"max_val": 16}}, prune=0.5, default_root_dir={root!r}, max_epochs=2, enable_progress_bar=False,
    enable_checkpointing=True,
    callbacks=[StructuredPruning(amount=0.5, start_epoch=1, finetune_epochs=0, round_to=None, latency_batch_sizes=())],
)
print("LOGGER", type(trainer.logger).__name__, trainer.speedkit["logger"])
try:
    trainer.fit(OrderedTiny())
finally:
    wandb.finish()
    wandb.teardown()  # wait for wandb's service to write out the offline run before the files are read
print("CHOICES", repr(trainer.speedkit))
print("METRICS", repr(trainer.callback_metrics))
"""


@pytest.mark.slow
def test_wandb_api_key_never_reaches_reports_or_logs(tmp_path: Path) -> None:
    """With ``WANDB_API_KEY`` set, a preset run on its default W&B logger leaks it to no file, report, log or output.

    The logger is W&B, offline (``WANDB_MODE``), the path that reads the key; every directory wandb writes to is under
    ``tmp_path``, so the scan covers the offline run (its record and debug logs) and wandb's own logs. The run is a
    fresh process: wandb keeps its mode per process, and the other tests run it disabled.
    """
    pytest.importorskip("wandb")
    secret = "speedkit-test-secret-0123456789abcdef"
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(WANDB_API_KEY=secret, WANDB_MODE="offline")
    for variable in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        env[variable] = str(tmp_path / variable.lower())  # everything wandb writes lands in tmp_path
    run_dir = tmp_path / "run"
    code = _API_KEY_RUN.format(scripts=str(Path(__file__).resolve().parent / "scripts"), root=str(run_dir))
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, check=True, capture_output=True, text=True, timeout=600
    )
    assert "LOGGER SpeedkitWandbLogger SpeedkitWandbLogger" in done.stdout  # preset's W&B logger (a run of its own)
    written = listing(tmp_path)
    assert any(name.endswith("speedkit_summary.json") for name in written)
    assert any(name.endswith(".ckpt") for name in written)
    records = [data for name, data in written.items() if "offline-run-" in name and name.endswith(".wandb")]
    assert len(records) == 1, sorted(written)  # the offline run's record, holding the metrics and the run summary
    assert b"speedkit/BatchSizeFinder/batch_size" in records[0]
    assert any("offline-run-" in name and name.endswith("debug.log") for name in written)  # wandb's own logs
    assert [name for name, data in written.items() if secret.encode() in data] == []
    assert "DEBUG" in done.stderr  # the debug log was captured, and it is clean too
    assert secret not in done.stdout + done.stderr
