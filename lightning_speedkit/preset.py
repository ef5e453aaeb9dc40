"""``speedkit.preset()``: a Trainer with the precision, strategy, callbacks and logger speedkit would choose here."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import CSVLogger, Logger
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities import rank_zero_info

from lightning_speedkit.compile import Compile
from lightning_speedkit.dataloader import DataLoaderTuner
from lightning_speedkit.doctor import recommend
from lightning_speedkit.guard import TrainingGuard
from lightning_speedkit.hardware import CpuInfo, GpuInfo, cpu_info, gpu_infos
from lightning_speedkit.loggers import RunSummary
from lightning_speedkit.lr_finder import LRFinder
from lightning_speedkit.memory_format import ChannelsLast
from lightning_speedkit.monitor import UtilizationMonitor
from lightning_speedkit.precision import PrecisionTuner
from lightning_speedkit.pruning import StructuredPruning
from lightning_speedkit.warmup import WarmupScheduler

log = logging.getLogger(__name__)

__all__ = ["PresetChoices", "choose", "default_callbacks", "preset"]

_PRECISIONS = ("auto", "32-true", "16-mixed", "bf16-mixed", "64-true", "bf16-true", "16-true", "transformer-engine")


class PresetChoices(dict[str, Any]):
    """What `preset` chose and why, as a plain dict that serialises as it is.

    Keys: ``accelerator``, ``devices``, ``num_nodes``, ``precision``, ``tune_precision`` (whether `PrecisionTuner`
    measures the precision at fit start; it then writes its choice and reason here), ``strategy``, ``channels_last``,
    ``num_workers``, ``logger``, ``callbacks`` and ``reasons`` (a one-line reason per choice).
    """

    def summary(self) -> str:
        """One short, human-readable line per choice."""
        reasons = self["reasons"]
        lines = ["speedkit.preset:"]
        for key in ("accelerator", "devices", "precision", "strategy", "channels_last", "logger", "callbacks"):
            value = self[key]
            shown = ", ".join(value) if isinstance(value, list) else value
            lines.append(f"  {key:<11} {shown!s:<28} {reasons.get(key, '')}".rstrip())
        return "\n".join(lines)


def choose(
    cpu: CpuInfo,
    gpus: Sequence[GpuInfo],
    devices: int | str = "auto",
    num_nodes: int = 1,
    precision: str = "auto",
    strategy: str = "auto",
    channels_last: bool | str = "auto",
) -> PresetChoices:
    """Decide accelerator, devices, the starting precision, strategy and layout from hardware facts (no Trainer built).

    What hardware facts cannot decide is left to a measurement at fit start. ``precision="auto"`` starts from
    ``"32-true"`` on CPU (``"16-mixed"`` on CUDA) and sets ``tune_precision``, so `PrecisionTuner` times the other
    autocast precisions the hardware supports on real steps and keeps the fastest. ``channels_last="auto"`` adds
    `~lightning_speedkit.ChannelsLast`, which times both layouts and keeps NHWC only when it wins (it helps the demo
    ResNet on CPU and slows `~lightning_speedkit.demo.FlatHeadNet`: ``benchmarks/results/channels_last.json``).

    Raises:
        ValueError: If ``devices`` asks for more GPUs (or, on CPU, processes than cores) than exist, or an
            argument is malformed.

    Example:
        >>> cpu = CpuInfo(8, 8, "test CPU", ("avx2",), "AVX2")
        >>> c = choose(cpu, [GpuInfo(i, "NVIDIA A100", (8, 0), 40 * 2**30) for i in range(4)], devices=4)
        >>> c["accelerator"], c["devices"], c["precision"], c["strategy"], c["channels_last"], c["tune_precision"]
        ('gpu', 4, '16-mixed', 'ddp', True, True)
        >>> choose(cpu, [])["precision"], choose(cpu, [], precision="32-true")["tune_precision"]
        ('32-true', False)
    """
    if not (isinstance(num_nodes, int) and num_nodes >= 1):
        raise ValueError(f"`num_nodes` must be a positive int, got {num_nodes!r}.")
    if precision not in _PRECISIONS:
        raise ValueError(f"`precision` must be one of {', '.join(_PRECISIONS)}, got {precision!r}.")
    if not (channels_last == "auto" or isinstance(channels_last, bool)):
        raise ValueError(f"`channels_last` must be 'auto', True or False, got {channels_last!r}.")
    accelerator = "gpu" if gpus else "cpu"
    available = len(gpus) if gpus else cpu.available_cores
    unit = "GPU(s)" if gpus else "CPU core(s) (one process each)"
    if devices == "auto":
        count = len(gpus) if gpus else 1
    elif isinstance(devices, int) and not isinstance(devices, bool) and devices >= 1:
        count = devices
    else:
        raise ValueError(f"`devices` must be a positive int or 'auto', got {devices!r}.")
    if count > available:
        raise ValueError(f"`devices`={count} asks for more than this machine has: {available} {unit}.")
    advice = recommend(cpu, list(gpus[:count]))
    reasons: dict[str, str] = {"accelerator": "CUDA GPU found" if gpus else "no CUDA GPU: CPU"}
    reasons["devices"] = f"{count} of {available} {unit}" + (f" x {num_nodes} nodes" if num_nodes > 1 else "")
    tune_precision = precision == "auto"
    if tune_precision:
        precision = str(advice["precision"]["value"])
        reasons["precision"] = advice["precision"]["reason"]
    else:
        reasons["precision"] = "as asked"
    world = count * num_nodes
    if strategy == "auto" and world > 1:
        strategy = "ddp"
        reasons["strategy"] = f"{world} processes: DDP ({'nccl' if gpus else 'gloo'}), gradient_as_bucket_view"
    else:
        reasons["strategy"] = "single process" if world == 1 else "as asked"
    if channels_last != "auto":
        reasons["channels_last"] = "as asked"
    else:
        channels_last = True
        reasons["channels_last"] = "conv nets only; both layouts timed at fit start, NHWC kept if >= 3% faster"
    return PresetChoices(
        accelerator=accelerator,
        devices=count,
        num_nodes=num_nodes,
        precision=precision,
        tune_precision=tune_precision,
        strategy=strategy,
        channels_last=channels_last,
        num_workers=advice["num_workers"]["value"],
        reasons=reasons,
    )


def default_callbacks(
    batch_size: str | dict[str, Any] | None = None,
    prune: float | dict[str, Any] | StructuredPruning | None = None,
    export: str | os.PathLike[str] | dict[str, Any] | Callback | None = None,
    callbacks: Sequence[Callback] | None = None,
    warmup: bool | dict[str, Any] = True,
    monitor: bool | dict[str, Any] = True,
    tune_data: bool | dict[str, Any] = True,
    channels_last: bool | dict[str, Any] = True,
    precision: bool | dict[str, Any] = False,
    lr_finder: bool | dict[str, Any] = False,
    compile: bool | dict[str, Any] = False,
    guard: bool | dict[str, Any] = True,
) -> list[Callback]:
    """Speedkit's callbacks in the order they must act, with the user's own merged in.

    Order: ChannelsLast -> PrecisionTuner -> DataLoaderTuner -> BatchSizeFinder -> LRFinder -> Compile ->
    WarmupScheduler -> TrainingGuard -> UtilizationMonitor -> StructuredPruning -> Int8Export. The compute levers
    are decided first, so the loader is tuned against the step the run will really take (workers compete with it for
    cores); the LR is found for the batch size the run will use. A callback in ``callbacks`` of the same type as one
    of ours *replaces* ours in that slot (never a duplicate); the user's other callbacks follow ours.

    Args:
        batch_size: ``"auto"`` (or a dict of `BatchSizeFinder` arguments) to search the batch size; None to keep it.
        prune: A channel ``amount`` in (0, 1), a dict of `StructuredPruning` arguments, or an instance.
        export: A directory for the INT8 model, a dict of `Int8Export` arguments, or an instance.
        callbacks: The user's callbacks.
        warmup: ``False`` to leave the LR alone, or a dict of `WarmupScheduler` arguments.
        monitor: ``False`` for no `UtilizationMonitor`, or a dict of its arguments.
        tune_data: ``False`` for no `DataLoaderTuner`, or a dict of its arguments.
        channels_last: ``False`` for no `ChannelsLast` (it acts only on models with convolutions), or a dict of its
            arguments.
        precision: ``True`` (or a dict of its arguments) for a `PrecisionTuner`; preset sets it when ``precision``
            is left to it.
        lr_finder: ``True`` (or a dict of its arguments) for an `LRFinder`; preset sets it with ``lr="auto"``.
        compile: ``True`` (or a dict of its arguments) for a `Compile`; preset sets it with ``compile="auto"``.
        guard: ``False`` for no `TrainingGuard`, or a dict of its arguments.

    Example:
        >>> [type(c).__name__ for c in default_callbacks()]
        ['ChannelsLast', 'DataLoaderTuner', 'WarmupScheduler', 'TrainingGuard', 'UtilizationMonitor']
        >>> mine = WarmupScheduler(warmup=10)
        >>> default_callbacks(callbacks=[mine])[2] is mine
        True
    """
    options = (
        ("warmup", warmup),
        ("monitor", monitor),
        ("tune_data", tune_data),
        ("channels_last", channels_last),
        ("precision", precision),
        ("lr_finder", lr_finder),
        ("compile", compile),
        ("guard", guard),
    )
    for name, value in options:
        if not isinstance(value, (bool, dict)):
            raise ValueError(f"`{name}` must be True, False or a dict of arguments, got {value!r}.")
    if any(not isinstance(c, Callback) for c in callbacks or ()):
        raise TypeError(f"`callbacks` must hold lightning Callbacks, got {list(callbacks or ())!r}.")
    ours: list[Callback] = []
    if channels_last is not False:
        ours.append(ChannelsLast(**_kwargs(channels_last)))
    if precision is not False:
        ours.append(PrecisionTuner(**_kwargs(precision)))
    if tune_data is not False:
        ours.append(DataLoaderTuner(**_kwargs(tune_data)))
    if batch_size is not None:
        from lightning_speedkit.batch_size import BatchSizeFinder

        if batch_size != "auto" and not isinstance(batch_size, dict):
            raise ValueError(
                f"`batch_size` must be None, 'auto' or a dict of BatchSizeFinder arguments, got {batch_size!r}."
            )
        ours.append(BatchSizeFinder(**_kwargs(batch_size if isinstance(batch_size, dict) else True)))
    if lr_finder is not False:
        ours.append(LRFinder(**_kwargs(lr_finder)))
    if compile is not False:
        ours.append(Compile(**_kwargs(compile)))
    if warmup is not False:
        ours.append(WarmupScheduler(**_kwargs(warmup)))
    if guard is not False:
        ours.append(TrainingGuard(**_kwargs(guard)))
    if monitor is not False:
        ours.append(UtilizationMonitor(**_kwargs(monitor)))
    if prune is not None:
        ours.append(_pruning(prune))
    if export is not None:
        ours.append(_export(export))
    user = list(callbacks or ())
    merged = []
    for callback in ours:
        replacement = next((c for c in user if isinstance(c, type(callback))), None)
        merged.append(replacement if replacement is not None else callback)
    return merged + [c for c in user if not any(c is m for m in merged)]


def preset(
    devices: int | str = "auto",
    num_nodes: int = 1,
    precision: str = "auto",
    strategy: str = "auto",
    logger: Logger | bool | str = "auto",
    batch_size: str | dict[str, Any] | None = None,
    prune: float | dict[str, Any] | StructuredPruning | None = None,
    export: str | os.PathLike[str] | dict[str, Any] | Callback | None = None,
    callbacks: Sequence[Callback] | None = None,
    channels_last: bool | str = "auto",
    lr: str | None = None,
    compile: bool | str | dict[str, Any] = False,
    guard: bool | dict[str, Any] = True,
    verbose: bool = True,
    **trainer_kwargs: Any,
) -> L.Trainer:
    """A ``lightning.Trainer`` tuned for this machine, with speedkit's callbacks.

    - Precision: with ``precision="auto"`` the Trainer starts in ``"16-mixed"`` on CUDA and ``"32-true"`` on CPU, and a
      `PrecisionTuner` times the other autocast precisions the hardware supports (``"bf16-mixed"`` on GPUs that have
      it and on CPUs with bf16 instructions) on real steps at fit start, keeping the fastest; an explicit
      ``precision`` is used as it is.
    - Strategy: ``devices * num_nodes > 1`` gives DDP (`DDPStrategy` with ``gradient_as_bucket_view=True``; gloo on
      CPU, NCCL on GPU). Multi-node runs take their ranks from Lightning's cluster environments: launch with
      ``torchrun --nnodes=N --nproc-per-node=G --rdzv-backend=c10d --rdzv-endpoint=HOST:PORT train.py`` or
      ``srun`` under SLURM, with ``preset(devices=G, num_nodes=N)`` in ``train.py``.
    - Callbacks: `default_callbacks` (a user callback of the same type replaces ours), then a
      `~lightning_speedkit.loggers.RunSummary` that writes every callback's report to ``speedkit_summary.json``
      (and the W&B run summary). `ChannelsLast` (``channels_last="auto"``) acts only on conv nets that it has
      checked run NHWC, and keeps NHWC only when real steps are faster; ``False`` switches it off.
    - LR: ``lr=None`` keeps the user's; ``lr="auto"`` adds an `LRFinder`, whose range test at fit start scales every
      LR to its suggestion (the warmup then ramps to it). A `TrainingGuard` keeps a last-good snapshot and rolls back
      at half the LR on a NaN or a loss spike; ``guard=False`` switches it off, and a dict configures it (its stall
      check, ``{"stall_steps": ...}``, is off by default: an early plateau is normal for many nets).
    - Compile: ``compile="auto"`` adds `Compile`, which times eager and compiled steps at fit start and keeps the
      compiled module only when the steps left repay the compile (+10%); ``True`` compiles without timing (eager if
      compiling fails); a dict passes `Compile` arguments; ``False`` (the default) never compiles.
    - Every probe is skipped when the run is too short for it to pay back (`lightning_speedkit.decisions`), so a short
      job is not made slower; each callback's ``report()`` says what it measured, skipped and why.
    - Logger: a W&B logger when wandb is installed (offline without an API key; ``speedkit/*`` metrics grouped on
      ``trainer/global_step``), else a CSV logger; ``logger=False`` for none, or pass your own.

    The choices and reasons are on ``trainer.speedkit`` (a `PresetChoices`) and printed once on rank zero.

    Raises:
        ValueError: If ``devices`` asks for more than the machine has, or an argument is malformed.

    Example:
        >>> trainer = preset(logger=False, verbose=False, max_epochs=1)
        >>> trainer.speedkit["precision"], type(trainer.strategy).__name__
        ('32-true', 'SingleDeviceStrategy')
    """
    if lr not in (None, "auto"):
        raise ValueError(f"`lr` must be None (keep yours) or 'auto' (an LRFinder range test), got {lr!r}.")
    compile_arg: bool | dict[str, Any]
    if compile == "auto":
        compile_arg = True
    elif compile is True:
        compile_arg = {"measure": False}
    elif compile is False or isinstance(compile, dict):
        compile_arg = compile
    else:
        raise ValueError(f"`compile` must be 'auto', True, False or a dict of Compile arguments, got {compile!r}.")
    if not isinstance(guard, (bool, dict)):
        raise ValueError(f"`guard` must be True, False or a dict of TrainingGuard arguments, got {guard!r}.")
    choices = choose(cpu_info(), gpu_infos(), devices, num_nodes, precision, strategy, channels_last)
    chosen_callbacks = default_callbacks(
        batch_size=batch_size,
        prune=prune,
        export=export,
        callbacks=callbacks,
        channels_last=choices["channels_last"],
        precision=choices["tune_precision"],
        lr_finder=lr == "auto",
        compile=compile_arg,
        guard=guard,
    )
    if not any(isinstance(c, RunSummary) for c in chosen_callbacks):
        chosen_callbacks.append(RunSummary())
    strategy_obj: Any = choices["strategy"]
    if choices["strategy"] == "ddp":
        strategy_obj = DDPStrategy(
            process_group_backend="nccl" if choices["accelerator"] == "gpu" else "gloo",
            gradient_as_bucket_view=True,
        )
    chosen_logger = _logger(logger, trainer_kwargs.get("default_root_dir"))
    choices["logger"] = type(chosen_logger).__name__ if isinstance(chosen_logger, Logger) else str(chosen_logger)
    choices["reasons"]["logger"] = _logger_reason(chosen_logger, asked=logger)
    choices["callbacks"] = [type(c).__name__ for c in chosen_callbacks]
    choices["reasons"]["callbacks"] = "speedkit's, in acting order; yours replace ours of the same type"
    trainer = L.Trainer(
        accelerator=choices["accelerator"],
        devices=choices["devices"],
        num_nodes=choices["num_nodes"],
        precision=choices["precision"],
        strategy=strategy_obj,
        logger=chosen_logger,
        callbacks=chosen_callbacks,
        **trainer_kwargs,
    )
    trainer.speedkit = choices  # type: ignore[attr-defined]
    if verbose:
        rank_zero_info(choices.summary())
    return trainer


def _kwargs(value: bool | dict[str, Any]) -> dict[str, Any]:
    return dict(value) if isinstance(value, dict) else {}


def _pruning(prune: float | dict[str, Any] | StructuredPruning) -> StructuredPruning:
    if isinstance(prune, StructuredPruning):
        return prune
    if isinstance(prune, dict):
        return StructuredPruning(**prune)
    if isinstance(prune, float) and 0.0 < prune < 1.0:
        return StructuredPruning(amount=prune)
    raise ValueError(f"`prune` must be an amount in (0, 1), a dict or a StructuredPruning, got {prune!r}.")


def _export(export: str | os.PathLike[str] | dict[str, Any] | Callback) -> Callback:
    from lightning_speedkit.int8 import Int8Export

    if isinstance(export, Int8Export):
        return export
    if isinstance(export, dict):
        return Int8Export(**export)
    if isinstance(export, (str, os.PathLike)):
        return Int8Export(dirpath=Path(export))
    raise ValueError(f"`export` must be a directory, a dict or an Int8Export, got {export!r}.")


def _logger(logger: Logger | bool | str, root: Any) -> Logger | bool:
    if isinstance(logger, Logger) or logger is False:
        return logger
    if logger not in ("auto", True, "wandb", "csv"):
        raise ValueError(f"`logger` must be 'auto', 'wandb', 'csv', False or a Logger, got {logger!r}.")
    save_dir = str(root) if root is not None else os.getcwd()
    if logger in ("auto", True, "wandb"):
        try:
            from lightning_speedkit.loggers import speedkit_wandb_logger
        except ImportError:
            if logger == "wandb":
                raise
        else:
            return speedkit_wandb_logger(save_dir=save_dir)
    return CSVLogger(save_dir=save_dir, name="speedkit")


def _logger_reason(logger: Logger | bool, asked: Logger | bool | str) -> str:
    if logger is False:
        return "none, as asked"
    if asked == "csv":
        return "CSV, as asked: metrics.csv"
    name = type(logger).__name__
    if name == "WandbLogger":
        mode = "offline (no WANDB_API_KEY)" if getattr(logger, "_offline", False) else "online"
        return f"wandb installed: {mode}, speedkit/* grouped on trainer/global_step"
    if name == "CSVLogger":
        return "wandb not installed: metrics.csv"
    return "yours"
