"""Tests of ``speedkit.preset`` and ``default_callbacks``."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from conftest import ROOT, TinyClassifier, callback_of, load_benchmark, short_job_reason
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.plugins import MixedPrecision
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy

import lightning_speedkit as speedkit
from lightning_speedkit.callback_table import SLOTS, default_callbacks
from lightning_speedkit.hardware import CpuInfo, GpuInfo
from lightning_speedkit.loggers import RunSummary, wandb_is_offline
from lightning_speedkit.preset import choose, preset

CPU2 = CpuInfo(2, 2, "test CPU", ("avx2", "avx512f", "avx512_bf16"), "AVX512")
CPU_AMX = CpuInfo(8, 8, "test CPU", ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16"), "AVX512")
A100 = GpuInfo(0, "NVIDIA A100", (8, 0), 40 * 2**30)
P100 = GpuInfo(0, "Tesla P100", (6, 0), 16 * 2**30)


@pytest.mark.parametrize(
    ("cpu", "gpus", "devices", "expected"),
    [
        (CPU2, [], "auto", ("cpu", 1, "32-true", "auto")),
        (CPU2, [], 2, ("cpu", 2, "32-true", "ddp")),
        (CPU_AMX, [], 1, ("cpu", 1, "32-true", "auto")),
        (CPU2, [A100], "auto", ("gpu", 1, "16-mixed", "auto")),
        (CPU2, [A100] * 4, 4, ("gpu", 4, "16-mixed", "ddp")),
        (CPU2, [P100], 1, ("gpu", 1, "32-true", "auto")),
    ],
)
def test_choices_follow_the_hardware(
    cpu: CpuInfo, gpus: list[GpuInfo], devices: int | str, expected: tuple[Any, ...]
) -> None:
    """Accelerator, devices, precision and strategy come from the hardware, each with a reason."""
    chosen = choose(cpu, gpus, devices=devices)
    assert (chosen["accelerator"], chosen["devices"], chosen["precision"], chosen["strategy"]) == expected
    assert all(chosen["reasons"][key] for key in ("accelerator", "devices", "precision", "strategy"))


def test_cpu_precision_is_a_starting_point_that_is_measured() -> None:
    """precision="auto" starts from fp32 on a CPU with bf16 instructions and asks PrecisionTuner to measure bf16."""
    chosen = choose(CPU2, [])
    assert chosen["tune_precision"] is True
    assert "PrecisionTuner times 'bf16-mixed'" in chosen["reasons"]["precision"]
    assert choose(CPU2, [], precision="bf16-mixed")["tune_precision"] is False


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"devices": 3}, r"`devices`=3 asks for more than this machine has: 2"),
        ({"devices": 0}, "`devices`"),
        ({"devices": "many"}, "`devices`"),
        ({"num_nodes": 0}, "`num_nodes`"),
        ({"precision": "fp8"}, "`precision`"),
    ],
)
def test_bad_choices_are_refused(kwargs: dict[str, Any], match: str) -> None:
    """Too many devices, or a malformed argument, is an error naming the argument."""
    with pytest.raises(ValueError, match=match):
        choose(CPU2, [], **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "layout", "tuner"),
    [
        ({}, True, True),  # ChannelsLast times both layouts at fit start; PrecisionTuner times the precisions
        ({"precision": "32-true"}, True, False),  # an asked precision is kept: no tuner
        ({"channels_last": False}, False, True),
        ({"channels_last": {"margin": 0.1}, "tune_precision": False}, True, False),
    ],
)
def test_the_levers_in_the_trainer_follow_the_arguments(kwargs: dict[str, Any], layout: bool, tuner: bool) -> None:
    """``trainer.speedkit`` says which levers measure at fit start, read from the callbacks preset built."""
    trainer = preset(logger=False, verbose=False, **kwargs)
    names = [type(c).__name__ for c in trainer.callbacks]
    assert trainer.speedkit["channels_last"] is layout is ("ChannelsLast" in names)
    assert trainer.speedkit["tune_precision"] is tuner is ("PrecisionTuner" in names)


WOULD = "as asked (speedkit would choose {})"


@pytest.mark.parametrize(
    ("gpus", "kwargs", "overridden", "reasons"),
    [
        ([A100], {"accelerator": "cpu"}, {"accelerator": "cpu"}, {"accelerator": WOULD.format("'gpu'")}),
        (
            [],
            {"accelerator": "cpu", "devices": 2},
            {"accelerator": "cpu", "devices": 2},
            {"accelerator": "as asked", "devices": WOULD.format(1)},
        ),
        ([A100] * 4, {"devices": [0, 2]}, {"devices": [0, 2]}, {"devices": WOULD.format(4)}),
        (
            [A100],
            {"precision": "bf16-mixed", "strategy": "ddp_spawn"},
            {"precision": "bf16-mixed", "strategy": "ddp_spawn"},
            {"precision": WOULD.format("'16-mixed'"), "strategy": WOULD.format("'auto'")},
        ),
        ([], {"precision": 32}, {"precision": "32-true"}, {"precision": "as asked"}),
        ([], {}, {}, {"accelerator": "no CUDA GPU: CPU"}),
    ],
)
def test_choose_records_what_the_user_overrode(
    gpus: list[GpuInfo], kwargs: dict[str, Any], overridden: dict[str, Any], reasons: dict[str, str]
) -> None:
    """A user's argument is used as given, listed in ``overridden``, and its reason says "as asked" (and ours)."""
    chosen = choose(CPU2, gpus, **kwargs)
    assert chosen["overridden"] == overridden
    for key, value in overridden.items():
        assert chosen[key] == value
    for key, reason in reasons.items():
        assert chosen["reasons"][key] == reason
    assert chosen["tune_precision"] is ("precision" not in overridden)


def test_accelerator_cpu_on_a_gpu_machine_decides_for_the_cpu() -> None:
    """``accelerator="cpu"`` with GPUs present: CPU processes, the CPU's precision rule and gloo DDP."""
    chosen = choose(CPU2, [A100] * 4, devices=2, accelerator="cpu")
    decided = (chosen["accelerator"], chosen["devices"], chosen["precision"], chosen["strategy"])
    assert decided == ("cpu", 2, "32-true", "ddp")
    assert "gloo" in chosen["reasons"]["strategy"]
    assert "PrecisionTuner times 'bf16-mixed'" in chosen["reasons"]["precision"]


def test_more_gpus_than_exist_is_an_error() -> None:
    """Asking for 4 GPUs on a 1-GPU machine names what exists."""
    with pytest.raises(ValueError, match="1 GPU"):
        choose(CPU2, [A100], devices=4)


def test_default_callbacks_order_and_optional_parts(tmp_path: Path) -> None:
    """Ours come in acting order; the batch-size finder, pruning and export only when asked for."""
    everything = {"batch_size": True, "prune": 0.5, "export": tmp_path, "lr": True, "compile": True}
    names = [type(c).__name__ for c in default_callbacks(**everything)]
    assert names == [
        "PrecisionTuner",
        "ChannelsLast",
        "FusedOptimizer",
        "BatchSizeFinder",
        "DataLoaderTuner",
        "LRFinder",
        "Compile",
        "WarmupScheduler",
        "TrainingGuard",
        "UtilizationMonitor",
        "StructuredPruning",
        "Int8Export",
    ]
    off = dict.fromkeys(("warmup", "monitor", "tune_data", "channels_last", "tune_precision", "guard"), False)
    off["fused_optimizer"] = False
    assert [type(c).__name__ for c in default_callbacks(**off)] == []


@pytest.mark.parametrize("argument", [slot.argument for slot in SLOTS])
def test_every_slot_takes_false_true_a_dict_or_an_instance(argument: str, tmp_path: Path) -> None:
    """One argument form for every slot: False leaves it out, True and a dict build it, an instance is used as is."""
    slot = next(s for s in SLOTS if s.argument == argument)
    cls = slot.load()
    arguments: dict[str, Any] = {"prune": {"amount": 0.5}, "export": {"dirpath": tmp_path}}.get(argument, {})
    assert all(not isinstance(c, cls) for c in default_callbacks(**{argument: False}))
    if not arguments:
        assert sum(isinstance(c, cls) for c in default_callbacks(**{argument: True})) == 1
    built = [c for c in default_callbacks(**{argument: arguments}) if isinstance(c, cls)]
    assert len(built) == 1
    mine = cls(**arguments)
    assert [c for c in default_callbacks(**{argument: mine}) if isinstance(c, cls)] == [mine]
    with pytest.raises(ValueError, match=rf"`{argument}` must be False \(leave it out\), True .* got b'yes'"):
        default_callbacks(**{argument: b"yes"})  # bytes: not even the export's directory


def test_user_callback_replaces_ours_of_the_same_type() -> None:
    """A user's WarmupScheduler takes our slot: exactly one, and it is theirs; other user callbacks follow ours."""
    mine = speedkit.WarmupScheduler(warmup=3)
    other = RunSummary()
    chosen = default_callbacks(callbacks=[other, mine])
    assert [c for c in chosen if isinstance(c, speedkit.WarmupScheduler)] == [mine]
    assert chosen[-1] is other


def test_one_callback_is_taken_as_the_trainer_takes_it() -> None:
    """``callbacks=<one Callback>``, which ``Trainer(callbacks=...)`` accepts, is taken as a list of it, not refused.

    Anything else but a Callback or a list of them is refused, naming ``callbacks``.
    """
    mine = speedkit.WarmupScheduler(warmup=3)
    assert [c for c in default_callbacks(callbacks=mine) if isinstance(c, speedkit.WarmupScheduler)] == [mine]
    assert mine in preset(callbacks=mine, logger=False, verbose=False).callbacks
    with pytest.raises(ValueError, match=r"`callbacks` must be a Callback or a list of them, got 3"):
        default_callbacks(callbacks=3)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"prune": 2.0}, "`prune`"),
        ({"batch_size": 64}, "`batch_size`"),
        ({"export": 3}, "`export`"),
        ({"lrs": True}, "`lrs` is not a speedkit callback slot"),
    ],
)
def test_default_callbacks_refuse_bad_input(kwargs: dict[str, Any], match: str) -> None:
    """Malformed optional parts are refused with the argument's name."""
    with pytest.raises(ValueError, match=match):
        default_callbacks(**kwargs)


def test_preset_on_this_cpu(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """On this CPU-only machine: one process, fp32, our callbacks, and a printed summary on ``trainer.speedkit``."""
    trainer = preset(logger="csv", default_root_dir=tmp_path, max_epochs=1)
    assert isinstance(trainer.strategy, SingleDeviceStrategy)
    assert trainer.precision == "32-true"
    assert trainer.speedkit["precision"] == "32-true"
    assert isinstance(trainer.logger, CSVLogger)
    names = [type(c).__name__ for c in trainer.callbacks]
    expected = {"DataLoaderTuner", "ChannelsLast", "PrecisionTuner", "WarmupScheduler", "UtilizationMonitor"}
    assert expected | {"RunSummary"} <= set(names)
    assert "precision" in trainer.speedkit.summary()
    assert trainer.speedkit["channels_last"] is True
    assert trainer.speedkit.decisions() == {}  # nothing measured before fit


class _Gan(TinyClassifier):
    """Manual optimization with two optimizers, as a GAN steps them, and no loss returned."""

    def __init__(self) -> None:
        super().__init__(lr=1e-3, num_samples=128, batch_size=16)
        self.automatic_optimization = False
        self.critic = torch.nn.Linear(4, 1)

    def training_step(self, batch: Any, batch_idx: int) -> None:
        net, critic = self.optimizers()  # type: ignore[misc]
        net.zero_grad()
        self.manual_backward(super().training_step(batch, batch_idx))
        net.step()
        critic.zero_grad()
        self.manual_backward(self.critic(self(batch[0]).detach()).pow(2).mean())
        critic.step()

    def configure_optimizers(self) -> Any:
        return [torch.optim.Adam(self.net.parameters(), lr=self.lr), torch.optim.Adam(self.critic.parameters(), 1e-3)]


@pytest.mark.parametrize("lr", [False, "auto"])
def test_preset_fits_a_manual_optimization_module_that_returns_no_loss(tmp_path: Path, lr: Any) -> None:
    """Preset defaults (and lr="auto") fit a GAN-style module to its end: no lever needs a returned loss to run."""
    trainer = preset(logger=False, verbose=False, default_root_dir=tmp_path, max_epochs=3, lr=lr,
                     enable_checkpointing=False, enable_progress_bar=False)  # fmt: skip
    with pytest.warns(UserWarning, match="no scalar loss"):
        trainer.fit(_Gan())
    assert trainer.current_epoch == 3
    assert [g["lr"] for o in trainer.optimizers for g in o.param_groups] == [1e-3, 1e-3]


def test_preset_two_cpu_devices_gives_ddp(tmp_path: Path) -> None:
    """``devices=2`` on CPU builds a gloo DDP strategy over two processes."""
    trainer = preset(devices=2, logger=False, default_root_dir=tmp_path, verbose=False)
    assert isinstance(trainer.strategy, DDPStrategy)
    assert trainer.strategy._process_group_backend == "gloo"
    assert trainer.num_devices == 2
    assert trainer.speedkit["strategy"] == "ddp"


def test_preset_accelerator_cpu_passes_through(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``accelerator="cpu"`` (once a TypeError: Trainer got it twice) reaches the Trainer, recorded as the user's."""
    trainer = preset(accelerator="cpu", logger=False, default_root_dir=tmp_path)
    assert isinstance(trainer.accelerator, CPUAccelerator)
    assert trainer.speedkit["overridden"] == {"accelerator": "cpu", "logger": False}
    assert trainer.speedkit["reasons"]["accelerator"].startswith("as asked")
    assert trainer.speedkit["reasons"]["logger"] == "none, as asked"
    summary = trainer.speedkit.summary()
    assert "as asked    accelerator='cpu', logger=False" in summary


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the answer on a machine without CUDA")
@pytest.mark.parametrize("accelerator", ["gpu", "cuda"])
def test_preset_gpu_without_cuda_is_a_clear_error(tmp_path: Path, accelerator: str) -> None:
    """``accelerator="gpu"`` where torch sees no CUDA device names the argument and the value, before any Trainer."""
    with pytest.raises(ValueError, match=rf"`accelerator`='{accelerator}' asks for a CUDA GPU, but torch sees none"):
        preset(accelerator=accelerator, logger=False, default_root_dir=tmp_path)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"accelerator": "mps"}, r"`accelerator` must be one of 'auto', 'cpu', 'gpu', 'cuda'.*got 'mps'"),
        ({"devices": [0, 1]}, r"`devices` must be 'auto' or a positive int, got \[0, 1\]"),
        ({"precision": "fp8"}, r"`precision` must be one of .*got 'fp8'"),
        ({"precision": "32-true", "plugins": [MixedPrecision("bf16-mixed", "cpu")]},
         r"`precision`='32-true' and a MixedPrecision in `plugins`"),
        ({"warmup": "yes"}, r"`warmup` must be False \(leave it out\), True \(its defaults\), .* got 'yes'"),
        ({"monitor": 3}, r"`monitor`"),
        ({"tune_data": None}, r"`tune_data`"),
    ],
)  # fmt: skip
def test_preset_refuses_what_it_cannot_pass_on(tmp_path: Path, kwargs: dict[str, Any], match: str) -> None:
    """An accelerator speedkit does not decide for, malformed devices or precision, or a precision given twice."""
    with pytest.raises(ValueError, match=match):
        preset(logger=False, verbose=False, default_root_dir=tmp_path, **kwargs)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="two CPU processes need two cores")
def test_preset_passes_devices_strategy_and_precision_as_asked(tmp_path: Path) -> None:
    """The user's devices, strategy and precision reach the Trainer unchanged; no PrecisionTuner second-guesses them."""
    trainer = preset(
        accelerator="cpu", devices=2, strategy="ddp_spawn", precision="bf16-mixed", logger=False, verbose=False,
        default_root_dir=tmp_path,
    )  # fmt: skip
    assert isinstance(trainer.strategy, DDPStrategy)
    assert trainer.strategy._start_method == "spawn"
    assert trainer.num_devices == 2
    assert trainer.precision == "bf16-mixed"
    assert "PrecisionTuner" not in [type(c).__name__ for c in trainer.callbacks]
    expected = {"accelerator": "cpu", "devices": 2, "precision": "bf16-mixed", "strategy": "ddp_spawn", "logger": False}
    assert trainer.speedkit["overridden"] == expected
    for key in expected:
        assert "as asked" in trainer.speedkit["reasons"][key], key


def test_preset_takes_a_precision_plugin_and_a_strategy_object(tmp_path: Path) -> None:
    """A precision plugin in ``plugins`` decides the precision (no tuner); a Strategy object is used as it is."""
    strategy = SingleDeviceStrategy(device=torch.device("cpu"))
    plugin = MixedPrecision("bf16-mixed", "cpu")
    kwargs: dict[str, Any] = {"logger": False, "verbose": False, "default_root_dir": tmp_path}
    trainer = preset(accelerator="cpu", strategy=strategy, plugins=[plugin], **kwargs)
    assert trainer.strategy is strategy
    assert trainer.precision_plugin is plugin
    assert "PrecisionTuner" not in [type(c).__name__ for c in trainer.callbacks]
    overridden = trainer.speedkit["overridden"]
    assert (overridden["strategy"], overridden["precision"]) == ("SingleDeviceStrategy", "bf16-mixed")
    assert trainer.speedkit["reasons"]["precision"] == "as asked, by the MixedPrecision in `plugins`"


def test_preset_forwards_every_default_callbacks_option(tmp_path: Path) -> None:
    """``warmup``, ``monitor`` and ``tune_data`` reach `default_callbacks`: False drops the callback, a dict sets it."""

    def names(trainer: Any) -> list[str]:
        return [type(c).__name__ for c in trainer.callbacks]

    off = preset(warmup=False, monitor=False, tune_data=False, logger=False, verbose=False, default_root_dir=tmp_path)
    assert not {"WarmupScheduler", "UtilizationMonitor", "DataLoaderTuner"} & set(names(off))
    assert "TrainingGuard" in names(off)
    tuned = preset(
        warmup={"warmup": 5}, monitor={"window": 7}, tune_data={"probe_steps": 3}, logger=False, verbose=False,
        default_root_dir=tmp_path,
    )  # fmt: skip
    assert callback_of(tuned, speedkit.WarmupScheduler).warmup == 5
    assert callback_of(tuned, speedkit.UtilizationMonitor).window == 7
    assert callback_of(tuned, speedkit.DataLoaderTuner).probe_steps == 3


def test_preset_decides_the_cool_down_by_a_trial_unless_told_otherwise(tmp_path: Path) -> None:
    """The warmup of `preset` decides its cool-down by a trial (its slot option); a dict or an instance may not."""
    common: dict[str, Any] = {"logger": False, "verbose": False, "default_root_dir": tmp_path}
    assert callback_of(preset(**common), speedkit.WarmupScheduler).cooldown_check == "trial"
    assert callback_of(preset(warmup={"warmup": 5}, **common), speedkit.WarmupScheduler).cooldown_check == "trial"
    asked = preset(warmup={"cooldown_check": False}, **common)
    assert callback_of(asked, speedkit.WarmupScheduler).cooldown_check is False
    mine = speedkit.WarmupScheduler()
    assert callback_of(preset(warmup=mine, **common), speedkit.WarmupScheduler).cooldown_check is False


def test_preset_adds_no_decay_to_a_users_own_scheduler(tmp_path: Path) -> None:
    """The warmup of `preset` asks for ``decay="auto"``: no cool-down on top of the user's own LR scheduler.

    A module with its own scheduler runs that schedule alone; one without keeps warmup-stable-decay; a dict may ask for
    the decay on top anyway (and is warned that the two multiply).
    """

    class Scheduled(TinyClassifier):
        def configure_optimizers(self) -> Any:
            optimizer = torch.optim.SGD(self.parameters(), lr=self.lr)
            return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.9)}

    common: dict[str, Any] = {"logger": False, "verbose": False, "default_root_dir": tmp_path, "max_epochs": 2}
    common |= {"enable_checkpointing": False, "enable_progress_bar": False, "limit_val_batches": 0}
    used = {}
    for name, model, warmup in [("scheduled", Scheduled(), True), ("plain", TinyClassifier(), True)]:
        trainer = preset(warmup=warmup, **common)
        trainer.fit(model)
        used[name] = callback_of(trainer, speedkit.WarmupScheduler).report()["decay_used"]
    assert used == {"scheduled": "constant", "plain": "wsd"}
    trainer = preset(warmup={"decay": "wsd"}, **common)
    with pytest.warns(UserWarning, match="the wsd decay multiplies on top of your scheduler"):
        trainer.fit(Scheduled())
    assert callback_of(trainer, speedkit.WarmupScheduler).report()["decay_used"] == "wsd"


def test_preset_on_a_loader_without_a_length_keeps_the_users_lr_to_the_end(tmp_path: Path) -> None:
    """An ``IterableDataset`` bounded by ``max_epochs``: Lightning estimates the budget as ``max_steps``, -1.

    Read as a budget, -1 made preset's schedule one step long: every step after the first trained at LR 0, and every
    lever saw 0 steps left. The length is unknown, not 0: the LR stays the user's on every step (no cool-down, said
    so), the steps left read as unbounded, and an explicit ``decay="wsd"`` is refused, naming ``total_steps``.
    """

    class Stream(torch.utils.data.IterableDataset[Any]):
        def __iter__(self) -> Any:
            return iter(TinyClassifier()._data(0))

    class Streamed(TinyClassifier):
        def train_dataloader(self) -> Any:
            return torch.utils.data.DataLoader(Stream(), batch_size=8)

    class Lrs(L.Callback):
        def __init__(self) -> None:
            self.lrs: list[float] = []
            self.left: list[float] = []

        def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            self.left.append(speedkit.trials.steps_left(trainer))

        def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
            self.lrs.append(optimizer.param_groups[0]["lr"])

    common: dict[str, Any] = {"logger": False, "verbose": False, "default_root_dir": tmp_path, "max_epochs": 2}
    common |= {"enable_checkpointing": False, "enable_progress_bar": False, "limit_val_batches": 0}
    lrs = Lrs()
    trainer = preset(callbacks=[lrs], **common)
    trainer.fit(Streamed())
    assert trainer.global_step == 16
    assert lrs.lrs == [0.1] * 16
    assert lrs.left == [math.inf]
    report = callback_of(trainer, speedkit.WarmupScheduler).report()
    assert (report["decay_used"], report["resolved"]["total_steps"]) == ("constant", None)
    trainer = preset(warmup={"decay": "wsd"}, **common)
    with pytest.raises(ValueError, match=r"`total_steps` is needed for decay='wsd'.*cannot tell the fit's length"):
        trainer.fit(Streamed())


_CPU_DDP_RUN = """
import json, sys
import torch
sys.path.insert(0, {tests!r})
from conftest import TinyClassifier
import lightning as L
from lightning_speedkit import preset


class Record(L.Callback):  # in each rank's process: a forked rank runs only the fit
    def on_train_end(self, trainer, pl_module):
        strategy = trainer.strategy
        record = dict(speedkit=dict(trainer.speedkit), decisions=trainer.speedkit.decisions(),
                      world_size=trainer.world_size, step=trainer.global_step,
                      strategy=type(strategy).__name__, backend=strategy._process_group_backend,
                      start=strategy._start_method,
                      weights=[float(v) for v in torch.cat([p.detach().flatten() for p in pl_module.parameters()])])
        with open({root!r} + f"/rank{{trainer.global_rank}}.json", "w") as out:
            json.dump(record, out)


L.seed_everything(0, verbose=False)
trainer = preset(devices=2, accelerator="cpu", logger=False, default_root_dir={root!r}, max_epochs=2,
                 enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, verbose=False,
                 callbacks=[Record()])
trainer.fit(TinyClassifier())
if torch.distributed.is_initialized():
    torch.distributed.destroy_process_group()
summary = next(c for c in trainer.callbacks if type(c).__name__ == "RunSummary").report()
with open({root!r} + "/main.json", "w") as out:  # the process that called fit: rank 0 itself unless forked
    json.dump(dict(decisions=trainer.speedkit.decisions(), summary=sorted(summary)), out)
"""


@pytest.mark.slow
@pytest.mark.ddp
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="two CPU processes need two cores")
@pytest.mark.parametrize("interactive", [False, True], ids=["script", "interactive"])
def test_preset_two_cpu_processes_fit_under_ddp(tmp_path: Path, interactive: bool) -> None:
    """``preset(devices=2, accelerator="cpu")`` fits with 2 gloo DDP processes that end with the same weights.

    From a script, Lightning's launcher starts the second rank by running the command line again; in an interactive
    session (a notebook; here ``python -i``), which has none to run, the ranks are forked, as Lightning's
    ``"ddp_fork"``: ``DDPStrategy``'s default launcher raised "not compatible with an interactive environment" there.
    Either way the process that called fit ends with rank zero's decisions and run summary (forked, they came back
    from rank zero: the notebook's ``trainer.speedkit.decisions()`` was empty).
    """
    script = tmp_path / "cpu_ddp.py"
    script.write_text(_CPU_DDP_RUN.format(tests=str(ROOT / "tests"), root=str(tmp_path)))
    command = [sys.executable, *(["-i"] if interactive else []), str(script)]
    subprocess.run(command, cwd=tmp_path, check=True, timeout=600, stdin=subprocess.DEVNULL)
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    for rank in ranks:
        strategy = "ForkedDDPStrategy" if interactive else "DDPStrategy"  # a DDPStrategy either way
        assert (rank["world_size"], rank["strategy"], rank["backend"]) == (2, strategy, "gloo")
        assert rank["start"] == ("fork" if interactive else "popen")
        assert rank["step"] == 8  # 64 samples, batch 8, split over 2 ranks: 4 steps an epoch
        assert rank["speedkit"]["strategy"] == "ddp"
        assert rank["speedkit"]["overridden"] == {"accelerator": "cpu", "devices": 2, "logger": False}
        assert "2 processes (devices=2)" in rank["speedkit"]["reasons"]["strategy"]
        assert ("forked from this interactive session" in rank["speedkit"]["reasons"]["strategy"]) == interactive
    assert ranks[0]["weights"] == ranks[1]["weights"]
    main = json.loads((tmp_path / "main.json").read_text())
    assert main["decisions"] == ranks[0]["decisions"]
    assert {"ChannelsLast", "FusedOptimizer", "DataLoaderTuner"} <= set(main["decisions"])
    assert {"TrainingGuard", "WarmupScheduler", "FusedOptimizer"} <= set(main["summary"])


def test_preset_refuses_more_devices_than_cores(tmp_path: Path) -> None:
    """More CPU processes than cores is a clear error before any Trainer is built."""
    with pytest.raises(ValueError, match="`devices`"):
        preset(devices=64, logger=False, default_root_dir=tmp_path)


@pytest.mark.parametrize("asked", [True, "auto"])
def test_preset_batch_size_on_cpu_keeps_the_users_batch(tmp_path: Path, asked: Any) -> None:
    """``preset(batch_size=True)`` (or ``"auto"``) on a CPU keeps the user's batch and says why; a dict searches.

    Its memory search refused to run at setup there (a CPU never runs out of memory); then it searched for throughput
    alone, and a tiny model's batch grew to the whole data set, its LR x128, and its loss rose 17-fold.
    """
    trainer = preset(logger=False, verbose=False, default_root_dir=tmp_path, max_epochs=1, batch_size=asked,
                     enable_checkpointing=False, enable_progress_bar=False, limit_val_batches=0)  # fmt: skip
    model = TinyClassifier(num_samples=512, batch_size=8)
    trainer.fit(model)
    assert "BatchSizeFinder" not in trainer.speedkit["callbacks"]
    assert model.batch_size == 8
    assert "objective='throughput'" in trainer.speedkit["reasons"]["batch_size"]
    searched = preset(logger=False, verbose=False, batch_size={"objective": "throughput", "max_val": 64})
    assert callback_of(searched, speedkit.BatchSizeFinder).objective == "throughput"  # asked for: used as given


def test_wandb_is_offline_without_a_key() -> None:
    """Without an API key (or with ``WANDB_MODE=offline``) W&B runs offline."""
    assert wandb_is_offline({})
    assert wandb_is_offline({"WANDB_MODE": "offline", "WANDB_API_KEY": "x"})
    assert not wandb_is_offline({"WANDB_API_KEY": "x"})


def test_wandb_is_online_after_wandb_login(tmp_path: Path) -> None:
    """The key ``wandb login`` wrote to the netrc file for the W&B host runs W&B online without ``WANDB_API_KEY``.

    Read from ``NETRC`` or ``~/.netrc``; another host's key, ``WANDB_MODE=offline``, an entry without a key or an
    unparsable file: offline.
    """
    home = tmp_path / "home"
    home.mkdir()
    login = home / ".netrc"
    login.write_text("machine api.wandb.ai\n  login user\n  password " + "k" * 40 + "\n")
    login.chmod(0o600)
    assert not wandb_is_offline({"HOME": str(home)})
    assert not wandb_is_offline({"NETRC": str(login)})
    assert wandb_is_offline({"HOME": str(home), "WANDB_BASE_URL": "https://wandb.example.com"})
    assert wandb_is_offline({"HOME": str(home), "WANDB_MODE": "offline"})
    assert wandb_is_offline({"HOME": str(tmp_path)})  # no netrc there
    for text in ("machine api.wandb.ai login user\n", "machine api.wandb.ai password\n"):  # no key; unparsable
        (tmp_path / "other").write_text(text)
        assert wandb_is_offline({"NETRC": str(tmp_path / "other")})


_OFFLINE_RUN = """
import sys
sys.path.insert(0, {tests!r})
from conftest import TinyClassifier
from lightning_speedkit import preset
trainer = preset(default_root_dir={root!r}, max_epochs=1, log_every_n_steps=1, enable_progress_bar=False)
from lightning.pytorch.loggers import WandbLogger
assert isinstance(trainer.logger, WandbLogger), trainer.logger
trainer.fit(TinyClassifier())
"""


@pytest.mark.slow
def test_wandb_offline_run_receives_speedkit_keys(tmp_path: Path) -> None:
    """An offline W&B run (no API key) gets the ``speedkit/*`` metrics, and the summary JSON is written."""
    # A fresh process: wandb keeps its mode per process, and other tests run it disabled.
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(WANDB_MODE="offline", WANDB_SILENT="true")
    code = _OFFLINE_RUN.format(tests=str(Path(__file__).parent), root=str(tmp_path))
    subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, check=True, timeout=600)
    runs = list(tmp_path.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(runs) == 1
    keys = set(re.findall(rb"speedkit/[a-z_/0-9]+", runs[0].read_bytes()))
    assert {b"speedkit/lr/factor", b"speedkit/monitor/data_wait_fraction", b"speedkit/data/num_workers"} <= keys
    summary = json.loads(next(tmp_path.rglob("speedkit_summary.json")).read_text())
    assert {"UtilizationMonitor", "DataLoaderTuner"} <= set(summary)


def test_lr_true_adds_the_lr_finder_and_guard_false_removes_the_guard(tmp_path: Path) -> None:
    """``lr=True`` adds an LRFinder (the default keeps the user's LR); the guard is on unless ``guard=False``."""
    names = lambda trainer: [type(c).__name__ for c in trainer.callbacks]  # noqa: E731
    default = preset(logger=False, verbose=False, default_root_dir=tmp_path)
    assert "LRFinder" not in names(default)
    assert "TrainingGuard" in names(default)
    tuned = preset(logger=False, verbose=False, default_root_dir=tmp_path, lr=True, guard={"backoff": 0.25})
    assert "LRFinder" in names(tuned)
    assert "LRFinder" in names(preset(logger=False, verbose=False, default_root_dir=tmp_path, lr="auto"))
    guard = callback_of(tuned, speedkit.TrainingGuard)
    assert guard.backoff == 0.25
    assert "TrainingGuard" not in names(preset(logger=False, verbose=False, guard=False))


@pytest.mark.parametrize(
    ("kwargs", "match"), [({"lr": 1e-3}, "`lr`"), ({"lr": "AUTO"}, "`lr`"), ({"guard": "yes"}, "`guard`")]
)
def test_preset_refuses_a_bad_lr_or_guard(kwargs: dict[str, Any], match: str) -> None:
    """``lr`` and ``guard`` take False, True, a dict or an instance: anything else names the argument and the forms."""
    with pytest.raises(ValueError, match=match):
        preset(logger=False, verbose=False, **kwargs)


def test_a_short_job_under_preset_skips_every_probe_and_says_why(tmp_path: Path) -> None:
    """88 steps of a small CNN (benchmarks/short_job.py's job): no lever probes, and each report gives the reason."""
    job = load_benchmark("short_job")
    trainer = preset(logger=False, verbose=False, default_root_dir=tmp_path, max_epochs=2, enable_progress_bar=False)
    trainer.fit(job.SmallCNN(), job.SmallData())
    assert trainer.global_step == 88
    reports = {type(c).__name__: c.report() for c in trainer.callbacks if type(c).__name__ in LEVERS}
    assert set(reports) == set(LEVERS)
    for name, report in reports.items():
        assert report["probed"] is False, name
        assert report["reason"].startswith(short_job_reason(name)), (name, report["reason"])
    assert trainer.precision == "32-true"
    assert not reports["ChannelsLast"].get("converted")


LEVERS = ("ChannelsLast", "PrecisionTuner", "DataLoaderTuner")


def test_short_job_benchmark_quick_mode(tmp_path: Path) -> None:
    """``benchmarks/short_job.py --quick`` fits the job both ways and records each lever's skip reason."""
    benchmark = load_benchmark("short_job")
    result = benchmark.main(["--quick", "--out", str(tmp_path / "short_job.json")])
    assert json.loads((tmp_path / "short_job.json").read_text()) == result
    assert {row["run"] for row in result["rows"]} == {"plain", "preset"}
    assert all(not lever["probed"] for lever in result["levers"].values())


def test_the_summary_says_skipped_once(tmp_path: Path) -> None:
    """A decision whose reason already starts with its source ("skipped: resumed from ...") is not prefixed twice."""
    trainer = preset(logger=False, verbose=False, default_root_dir=tmp_path)
    lever = callback_of(trainer, speedkit.FusedOptimizer)
    lever._decision = speedkit.trials.Decision.skipped("default", "skipped: resumed from a checkpoint without one")
    other = callback_of(trainer, speedkit.ChannelsLast)
    other._decision = speedkit.trials.Decision.skipped("default", "no convolutions at setup")
    summary = trainer.speedkit.summary()
    assert "skipped: skipped" not in summary
    assert "skipped: resumed from a checkpoint without one" in summary
    assert "skipped: no convolutions at setup" in summary


def test_the_precision_reported_is_the_one_the_trainer_runs() -> None:
    """``precision="16-mixed"`` on a CPU: Lightning runs bf16-mixed, and ``trainer.speedkit`` says so, and why.

    The choices said 16-mixed, the asked value, while the Trainer ran bf16-mixed.
    """
    trainer = preset(precision="16-mixed", accelerator="cpu", logger=False, verbose=False)
    assert str(trainer.precision) == "bf16-mixed"
    assert trainer.speedkit["precision"] == "bf16-mixed"
    assert trainer.speedkit["reasons"]["precision"].endswith("; Lightning runs bf16-mixed for 16-mixed on cpu")
    assert trainer.speedkit["overridden"]["precision"] == "16-mixed"  # what the user asked for
