"""Shared test fixtures: tiny models and data that train in well under a second on CPU."""

from __future__ import annotations

import gc
import importlib.util
import json
import multiprocessing
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any, TypeVar

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import Logger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from typing_extensions import override

from lightning_speedkit.hardware import cpu_info

os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("WANDB_SILENT", "true")


class TinyClassifier(L.LightningModule):
    """A two-layer MLP on 16 features and 4 classes; ``lr`` and ``batch_size`` are hyperparameters."""

    def __init__(self, lr: float = 0.1, batch_size: int = 8, num_samples: int = 64, optimizer: str = "sgd") -> None:
        super().__init__()
        self.save_hyperparameters()
        self.lr = lr
        self.batch_size = batch_size
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
        self.example_input_array = torch.zeros(2, 16)

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)  # type: ignore[no-any-return]

    @override
    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    @override
    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self(x), y))

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.hparams["optimizer"] == "adam":
            return torch.optim.Adam(self.parameters(), lr=self.lr)
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)

    def _data(self, seed: int) -> TensorDataset:
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(self.hparams["num_samples"], 16, generator=g)
        return TensorDataset(x, (x[:, :4].argmax(dim=1)))

    @override
    def train_dataloader(self) -> DataLoader[tuple[torch.Tensor, ...]]:
        return DataLoader(self._data(0), batch_size=self.batch_size, shuffle=True)

    @override
    def val_dataloader(self) -> DataLoader[tuple[torch.Tensor, ...]]:
        return DataLoader(self._data(1), batch_size=self.batch_size)


class FixedStep(torch.optim.Optimizer):
    """An LR-free optimizer: its param groups have no ``lr``; each step moves by 0.05 times the gradient."""

    def __init__(self, params: Any) -> None:
        super().__init__(params, {})

    @override
    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-0.05)
        return loss


class KeyLogger(Logger):
    """A logger that remembers which metric keys reached it (on whatever rank it was called)."""

    def __init__(self) -> None:
        super().__init__()
        self.keys: set[str] = set()

    @property
    @override
    def name(self) -> str:
        return "keys"

    @property
    @override
    def version(self) -> int:
        return 0

    @override
    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    @override
    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.keys.update(metrics)


class SpawnedRank(L.Callback):
    """Start and end a ``ddp_spawn`` rank of the tests as a ``strategy="ddp"`` rank would, so it cannot abort at exit.

    A spawned rank inherits the start method ``spawn`` and leaves through a full interpreter shutdown, and so do its
    loader workers. A C++ thread still working then (a worker's queue feeder pickling a batch under
    ``THPStorage_shareFd``; a gloo or autograd thread holding Python objects) is killed in ``PyThread_exit_thread``
    and ``std::terminate`` aborts the process, after the fit itself went well: seen in core dumps of CI and local
    runs, one run in three to six. A forked worker leaves by ``os._exit``; but forking the rank itself, which runs
    threads (gloo's, the loaders' queue feeders), hangs on this Python (3.11.7) when a thread holds the interpreter's
    HEAD_LOCK at the fork: the child waits for it forever in ``PyOS_AfterFork_Child`` (CPython gh-112275, fixed in
    3.11.8), seen twice in a row in ``test_ddp_ranks_agree`` under a full CI run. So the rank's loader workers are
    forked from a forkserver, a single-threaded process with torch and lightning already imported (they too leave by
    ``os._exit``), and at the end the rank waits for the other ranks and tears the gloo group down while Python is
    alive.
    """

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        multiprocessing.set_forkserver_preload(["torch", "lightning", "lightning_speedkit"])
        multiprocessing.set_start_method("forkserver", force=True)

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        end_process_group()


def end_process_group() -> None:
    """Wait for the other ranks and tear the gloo group down while Python is alive (a no-op in one process).

    A rank's gloo threads outliving the interpreter abort it at exit ("terminate called without an active
    exception"), after the fit itself went well: a ``ddp_spawn`` rank, or a script's rank under ``torchrun``.
    """
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()
        gc.collect()
        torch.distributed.destroy_process_group()


def short_job_reason(lever: str) -> str:
    """How a lever's reason starts on a job too short for any probe to pay back, on this CPU.

    PrecisionTuner has nothing to time where the CPU lacks bf16 instructions (`hardware.cpu_info`, the facts it reads
    itself, a forced ISA included); elsewhere, and for every other lever, the payback rule skips the probe.
    """
    if lever == "PrecisionTuner" and not cpu_info().bf16_instructions:
        return "no other autocast precision to try"
    return "skipped: the probe"


def refusing_files(*places: Path, why: str) -> Path:
    """The first of ``places`` where this process cannot create a file (each asked with a probe file); else a skip.

    Permission bits do not say it for root, so a read-only directory of ours is tried beside places no one may write
    to (``/proc``, ``/sys``); ``why`` is the skip's reason when every place took the probe.
    """
    for place in places:
        probe = place / ".speedkit-probe"
        try:
            probe.touch()
        except OSError:
            return place
        probe.unlink()
    pytest.skip(why)


class OutlierClassifier(TinyClassifier):
    """TinyClassifier whose first validation batch is 1000x larger: calibrated on it alone, INT8 loses accuracy."""

    @override
    def val_dataloader(self) -> DataLoader[tuple[torch.Tensor, ...]]:
        x, y = self._data(1).tensors
        x = x.clone()
        x[:8] *= 1000.0
        return DataLoader(TensorDataset(x, y), batch_size=8)


def outlier_mlp() -> tuple[nn.Module, list[tuple[torch.Tensor, torch.Tensor]]]:
    """An MLP whose first hidden layer has one channel ~1000x the others (same function as without it).

    MinMax calibration then spends the whole INT8 range of that activation on the one channel and rounds the
    others to nothing: INT8 agrees with FP32 on ~16% of the samples. Labels are FP32's argmax (accuracy 1.0).
    """
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)).eval()
    with torch.no_grad():
        net[0].weight[0] *= 1000.0
        net[0].bias[0] = 1000.0 * net[0].bias[0].abs() + 100.0
        net[2].weight[:, 0] /= 1000.0
        x = torch.randn(256, 8)
        y = net(x).argmax(1)
    return net, [(x[i : i + 64], y[i : i + 64]) for i in range(0, 256, 64)]


def tiny_trainer(tmp_path: Path, **kwargs: object) -> L.Trainer:
    """A quiet CPU Trainer for tests; keyword arguments override the defaults (``ddp_spawn`` adds `SpawnedRank`)."""
    defaults: dict[str, object] = {
        "default_root_dir": tmp_path,
        "accelerator": "cpu",
        "devices": 1,
        "max_epochs": 1,
        "logger": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "enable_checkpointing": False,
    }
    defaults.update(kwargs)
    strategy = defaults.get("strategy", "")
    if "spawn" in str(getattr(strategy, "_start_method", strategy)):
        defaults["callbacks"] = [*(defaults.get("callbacks") or []), SpawnedRank()]  # type: ignore[misc]
    return L.Trainer(**defaults)  # type: ignore[arg-type]


ROOT = Path(__file__).resolve().parents[1]

IN_EPOCH_LOOP = SimpleNamespace(
    epoch_loop=SimpleNamespace(batch_progress=SimpleNamespace(current=SimpleNamespace(ready=2)))
)
"""A stand-in Trainer's ``fit_loop`` for scripted counted trials: every step is a batch inside an epoch (not its first,
where the step clock starts afresh after validation)."""


def rank_records(directory: Path, prefix: str = "rank", world_size: int = 2) -> list[Any]:
    """The JSON each DDP rank wrote to ``directory/{prefix}{rank}.json``, in rank order (by `RankWriter`)."""
    return [json.loads((directory / f"{prefix}{rank}.json").read_text()) for rank in range(world_size)]


class RankWriter(L.Callback):
    """Writes ``record(trainer, pl_module)`` as JSON to ``out/{prefix}{rank}.json`` at train end, one file per rank.

    What a DDP test compares across ranks (or with another fit), read back with `rank_records`. ``record`` must be a
    module-level function: ``ddp_spawn`` pickles the callback into each process.
    """

    def __init__(self, out: Path, record: Callable[[L.Trainer, L.LightningModule], Any], prefix: str = "rank") -> None:
        self.out, self.record, self.prefix = out, record, prefix

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Write this rank's record."""
        record = self.record(trainer, pl_module)
        (self.out / f"{self.prefix}{trainer.global_rank}.json").write_text(json.dumps(record))


_C = TypeVar("_C", bound=L.Callback)


def callback_of(trainer: L.Trainer, kind: type[_C]) -> _C:
    """The Trainer's callback of type ``kind`` (the first one)."""
    return next(c for c in trainer.callbacks if isinstance(c, kind))  # type: ignore[attr-defined]


def run_ddp_script(name: str, out: Path) -> list[Any]:
    """Run ``tests/scripts/<name>.py OUT`` (Lightning's ``ddp`` launcher starts its second process); its ranks' JSON."""
    script = ROOT / "tests" / "scripts" / f"{name}.py"
    subprocess.run([sys.executable, str(script), str(out)], check=True, cwd=ROOT, timeout=600)
    return rank_records(out)


def load_benchmark(name: str) -> ModuleType:
    """Import ``benchmarks/<name>.py`` (a script, not a package) as the module ``benchmark_<name>``."""
    path = ROOT / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"benchmark_{name}", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses and pickling look the module up by name
    spec.loader.exec_module(module)
    return module


_DECISIONS = pytest.StashKey[str]()


def pytest_configure(config: pytest.Config) -> None:
    """The session's decisions directory, for session- and module-scoped fixtures too: never ~/.cache.

    Set here, in pytest's own process only: a spawned DDP rank that imports this module keeps its test's directory.
    """
    config.stash[_DECISIONS] = tempfile.mkdtemp(prefix="speedkit-test-decisions-")
    os.environ["SPEEDKIT_DECISIONS_DIR"] = config.stash[_DECISIONS]
    # torch reads ATEN_CPU_CAPABILITY once, at its first get_cpu_capability(): read it now, before a test clears the
    # variable (tests/test_hardware.py does, to read a cpuinfo file as is). Alone under the forced ISA, that file's
    # first such test fixed torch's dispatch at AVX-512 for the rest of the session, and a later test failed.
    torch.backends.cpu.get_cpu_capability()


def pytest_unconfigure(config: pytest.Config) -> None:
    if _DECISIONS in config.stash:
        shutil.rmtree(config.stash[_DECISIONS], ignore_errors=True)


@pytest.fixture(autouse=True)
def _own_decisions_dir(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test remembers lever decisions in a directory of its own: none leaks into ~/.cache or into another test.

    Subprocesses and spawned DDP ranks inherit it through the environment.
    """
    monkeypatch.setenv("SPEEDKIT_DECISIONS_DIR", str(tmp_path_factory.mktemp("decisions")))


@pytest.fixture
def tiny_model() -> TinyClassifier:
    """A fresh, seeded TinyClassifier."""
    L.seed_everything(0, verbose=False)
    return TinyClassifier()


@pytest.fixture
def one_thread() -> Iterator[None]:
    """One intra-op thread while steps are timed, as gpu_check's rehearsal runs; put back afterwards.

    On a shared 2-core machine two threads stall for whole time slices.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def demo_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A per-session cache directory for generated demo images (so tests never write to the user's cache)."""
    return tmp_path_factory.mktemp("demo_cache")
