"""``speedkit.preset()``: a Trainer with the precision, strategy, callbacks and logger speedkit would choose here."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import Logger
from lightning.pytorch.plugins import Precision
from lightning.pytorch.strategies import DDPStrategy, Strategy
from lightning.pytorch.utilities import rank_zero_info

from lightning_speedkit.checks import check_bool
from lightning_speedkit.compile import Compile
from lightning_speedkit.dataloader import DataLoaderTuner
from lightning_speedkit.guard import TrainingGuard
from lightning_speedkit.hardware import CpuInfo, GpuInfo, cpu_info, gpu_infos
from lightning_speedkit.loggers import RunSummary, choose_logger
from lightning_speedkit.lr_finder import LRFinder
from lightning_speedkit.machine import placement, recommend, unified_precision
from lightning_speedkit.memory_format import ChannelsLast
from lightning_speedkit.monitor import UtilizationMonitor
from lightning_speedkit.precision import PrecisionTuner
from lightning_speedkit.pruning import StructuredPruning
from lightning_speedkit.warmup import WarmupScheduler

log = logging.getLogger(__name__)

__all__ = ["PresetChoices", "choose", "default_callbacks", "preset"]


class PresetChoices(dict[str, Any]):
    """What `preset` chose and why, as a plain dict that serialises as it is.

    Keys: ``accelerator``, ``devices``, ``num_nodes``, ``precision``, ``tune_precision`` (whether `PrecisionTuner`
    measures the precision at fit start; it then writes its choice and reason here), ``strategy``, ``channels_last``,
    ``num_workers``, ``logger``, ``callbacks``, ``reasons`` (a one-line reason per choice; ``"as asked"`` where the
    user decided) and ``overridden`` (the user's value for each choice they made instead of speedkit, e.g.
    ``{"accelerator": "cpu", "devices": 2}``; an object is named by its type).
    """

    def summary(self) -> str:
        """One short, human-readable line per choice, and which ones the user's arguments decided."""
        reasons = self["reasons"]
        lines = ["speedkit.preset:"]
        for key in ("accelerator", "devices", "precision", "strategy", "channels_last", "logger", "callbacks"):
            value = self[key]
            shown = ", ".join(value) if isinstance(value, list) and key == "callbacks" else value
            lines.append(f"  {key:<11} {shown!s:<28} {reasons.get(key, '')}".rstrip())
        if self.get("overridden"):
            lines.append(f"  {'as asked':<11} {', '.join(f'{k}={v!r}' for k, v in self['overridden'].items())}")
        return "\n".join(lines)


def choose(
    cpu: CpuInfo,
    gpus: Sequence[GpuInfo],
    devices: Any = "auto",
    num_nodes: int = 1,
    precision: Any = "auto",
    strategy: Any = "auto",
    channels_last: bool | str = "auto",
    accelerator: str = "auto",
) -> PresetChoices:
    """Decide accelerator, devices, the starting precision, strategy and layout from hardware facts (no Trainer built).

    The hardware decisions are `lightning_speedkit.machine`'s; an argument other than ``"auto"`` is used as it is,
    recorded in ``overridden`` with the reason ``"as asked"`` (naming speedkit's choice where it differs). What the
    facts cannot decide is measured at fit start: ``precision="auto"`` sets ``tune_precision`` for `PrecisionTuner`;
    ``channels_last="auto"`` adds `~lightning_speedkit.ChannelsLast`, which keeps NHWC only when it is faster
    (``benchmarks/results/channels_last.json``).

    Raises:
        ValueError: If ``accelerator`` asks for a GPU torch does not see, ``devices`` asks for more GPUs (or, on
            CPU, processes than cores) than exist, or an argument is malformed.

    Example:
        >>> cpu = CpuInfo(8, 8, "test CPU", ("avx2",), "AVX2")
        >>> c = choose(cpu, [GpuInfo(i, "NVIDIA A100", (8, 0), 40 * 2**30) for i in range(4)], devices=4)
        >>> c["accelerator"], c["devices"], c["precision"], c["strategy"], c["channels_last"], c["tune_precision"]
        ('gpu', 4, '16-mixed', 'ddp', True, True)
        >>> c = choose(cpu, [], devices=2, precision="32-true")
        >>> c["strategy"], c["tune_precision"], c["overridden"], c["reasons"]["devices"]
        ('ddp', False, {'devices': 2, 'precision': '32-true'}, 'as asked (speedkit would choose 1)')
    """
    if not (channels_last == "auto" or isinstance(channels_last, bool)):
        raise ValueError(f"`channels_last` must be 'auto', True or False, got {channels_last!r}.")
    precision = unified_precision(precision)
    where = placement(cpu, gpus, accelerator, devices, num_nodes)
    advice = recommend(cpu, where.gpus, where.processes, num_nodes)
    layout = "conv nets only; both layouts timed at fit start, NHWC kept if >= 3% faster"
    reasons = {**where.reasons, **{key: advice[key]["reason"] for key in ("precision", "strategy")}}
    reasons["channels_last"] = layout
    choices = PresetChoices(
        accelerator=where.accelerator,
        devices=where.devices,
        num_nodes=num_nodes,
        precision=advice["precision"]["value"],
        tune_precision=precision == "auto",
        strategy=advice["strategy"]["value"],
        channels_last=True,
        num_workers=advice["num_workers"]["value"],
        reasons=reasons,
        overridden={},
    )
    ours = {**choices, "accelerator": placement(cpu, gpus, num_nodes=num_nodes).accelerator}
    ours["devices"] = placement(cpu, gpus, where.accelerator, num_nodes=num_nodes).devices
    asked = {"accelerator": accelerator, "devices": devices, "precision": precision, "strategy": strategy}
    for key, value in {**asked, "channels_last": channels_last}.items():
        if isinstance(value, str) and value == "auto":
            continue
        shown = list(value) if isinstance(value, (list, tuple)) else value
        shown = shown if isinstance(shown, (str, int, list)) else type(shown).__name__
        choices[key] = choices["overridden"][key] = shown
        note = "" if shown == ours[key] else f" (speedkit would choose {ours[key]!r})"
        choices["reasons"][key] = f"as asked{note}"
    return choices


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
    if callbacks is not None and (
        not isinstance(callbacks, (list, tuple)) or any(not isinstance(c, Callback) for c in callbacks)
    ):
        raise ValueError(f"`callbacks` must be a list of lightning Callbacks, got {callbacks!r}.")
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
    devices: int | str | Sequence[int] = "auto",
    num_nodes: int = 1,
    precision: str | int = "auto",
    strategy: str | Strategy = "auto",
    logger: Logger | bool | str = "auto",
    batch_size: str | dict[str, Any] | None = None,
    prune: float | dict[str, Any] | StructuredPruning | None = None,
    export: str | os.PathLike[str] | dict[str, Any] | Callback | None = None,
    callbacks: Sequence[Callback] | None = None,
    channels_last: bool | str = "auto",
    lr: str | None = None,
    compile: bool | str | dict[str, Any] = False,
    guard: bool | dict[str, Any] = True,
    warmup: bool | dict[str, Any] = True,
    monitor: bool | dict[str, Any] = True,
    tune_data: bool | dict[str, Any] = True,
    accelerator: str = "auto",
    verbose: bool = True,
    **trainer_kwargs: Any,
) -> L.Trainer:
    """A ``lightning.Trainer`` tuned for this machine, with speedkit's callbacks.

    Every Trainer argument passes through. Preset chooses ``accelerator``, ``devices``, ``precision``, ``strategy``
    (a name or a ``Strategy``) and ``logger``; a value other than ``"auto"`` is used as it is and listed in
    ``trainer.speedkit["overridden"]``, its reason ``"as asked"``. A precision plugin in ``plugins`` sets the precision.

    - Device: every CUDA GPU with ``accelerator="auto"``, else one CPU process; ``accelerator`` takes ``"cpu"``,
      ``"gpu"`` or ``"cuda"``. On CPU ``devices=N`` runs N processes (at most one per core).
    - Precision: ``precision="auto"`` starts in ``"16-mixed"`` on CUDA and ``"32-true"`` on CPU, and a `PrecisionTuner`
      times the other autocast precisions the hardware supports on real steps at fit start, keeping the fastest.
    - Strategy (`lightning_speedkit.machine.strategy_choice`): ``devices * num_nodes > 1`` gives DDP (`DDPStrategy`
      with ``gradient_as_bucket_view=True``; gloo on CPU, NCCL on GPU). Multi-node runs take their ranks from
      Lightning's cluster environments: launch with ``torchrun --nnodes=N --nproc-per-node=G --rdzv-backend=c10d
      --rdzv-endpoint=HOST:PORT train.py`` or ``srun`` under SLURM, with ``preset(devices=G, num_nodes=N)``.
    - Callbacks: `default_callbacks` (a user callback of the same type replaces ours), then a `RunSummary` that
      writes every callback's report to ``speedkit_summary.json`` (and the W&B run summary). ``warmup``, ``monitor``,
      ``tune_data`` and ``guard`` take ``False`` (no `WarmupScheduler`, `UtilizationMonitor`, `DataLoaderTuner`,
      `TrainingGuard`) or a dict of its arguments. `ChannelsLast` (``channels_last="auto"``) acts only on conv nets,
      and keeps NHWC only when real steps are faster.
    - LR: ``lr=None`` keeps the user's; ``lr="auto"`` adds an `LRFinder`, whose range test at fit start scales every
      LR to its suggestion (the warmup then ramps to it). A `TrainingGuard` keeps a last-good snapshot and rolls back
      at half the LR on a NaN or a loss spike (its stall check, ``{"stall_steps": ...}``, is off by default).
    - Compile: ``compile="auto"`` adds `Compile`, which times eager and compiled steps at fit start and keeps the
      compiled module only when the steps left repay the compile (+10%); ``True`` compiles without timing (eager if
      compiling fails); a dict passes `Compile` arguments; ``False`` (the default) never compiles.
    - Every probe is skipped when the run is too short for it to pay back (`lightning_speedkit.decisions`), so a short
      job is not made slower; each callback's ``report()`` says what it measured, skipped and why.
    - Logger: a W&B logger when wandb is installed (offline without an API key; ``speedkit/*`` metrics grouped on
      ``trainer/global_step``), else a CSV logger; ``logger=False`` for none, or pass your own.

    The choices and reasons are on ``trainer.speedkit`` (a `PresetChoices`) and printed once on rank zero.

    Raises:
        ValueError: If ``accelerator`` asks for a GPU torch does not see, ``devices`` asks for more than the machine
            has, ``precision`` is given with a precision plugin, or an argument is malformed.

    Example:
        >>> trainer = preset(logger=False, verbose=False, max_epochs=1)
        >>> trainer.speedkit["precision"], type(trainer.strategy).__name__
        ('32-true', 'SingleDeviceStrategy')
        >>> preset(accelerator="cpu", logger=False, verbose=False).speedkit["overridden"]
        {'accelerator': 'cpu', 'logger': False}
    """
    if lr not in (None, "auto"):
        raise ValueError(f"`lr` must be None (keep yours) or 'auto' (an LRFinder range test), got {lr!r}.")
    check_bool("verbose", verbose)
    if not (compile == "auto" or isinstance(compile, (bool, dict))):
        raise ValueError(f"`compile` must be 'auto', True, False or a dict of Compile arguments, got {compile!r}.")
    compile_arg: Any = True if compile == "auto" else {"measure": False} if compile is True else compile
    plugins = trainer_kwargs.get("plugins")
    plugins = plugins if isinstance(plugins, (list, tuple)) else [plugins]
    plugin = next((p for p in plugins if isinstance(p, Precision)), None)
    if plugin is not None and precision != "auto":
        raise ValueError(f"`precision`={precision!r} and a {type(plugin).__name__} in `plugins`: pass one of them.")
    asked_precision = plugin.precision if plugin is not None else precision
    choices = choose(cpu_info(), gpu_infos(), devices, num_nodes, asked_precision, strategy, channels_last, accelerator)
    if plugin is not None:
        choices["reasons"]["precision"] = f"as asked, by the {type(plugin).__name__} in `plugins`"
    chosen_callbacks = default_callbacks(
        batch_size=batch_size,
        prune=prune,
        export=export,
        callbacks=callbacks,
        warmup=warmup,
        monitor=monitor,
        tune_data=tune_data,
        channels_last=choices["channels_last"],
        precision=choices["tune_precision"],
        lr_finder=lr == "auto",
        compile=compile_arg,
        guard=guard,
    )
    if not any(isinstance(c, RunSummary) for c in chosen_callbacks):
        chosen_callbacks.append(RunSummary())
    strategy_obj: Any = strategy
    if strategy == "auto" and choices["strategy"] == "ddp":
        backend = "nccl" if choices["accelerator"] in ("gpu", "cuda") else "gloo"
        strategy_obj = DDPStrategy(process_group_backend=backend, gradient_as_bucket_view=True)
    chosen_logger, choices["reasons"]["logger"] = choose_logger(logger, trainer_kwargs.get("default_root_dir"))
    choices["logger"] = type(chosen_logger).__name__ if isinstance(chosen_logger, Logger) else str(chosen_logger)
    if not (logger == "auto" or logger is True):
        choices["overridden"]["logger"] = logger if isinstance(logger, (str, bool)) else choices["logger"]
    choices["callbacks"] = [type(c).__name__ for c in chosen_callbacks]
    choices["reasons"]["callbacks"] = "speedkit's, in acting order; yours replace ours of the same type"
    trainer = L.Trainer(
        accelerator=choices["accelerator"],
        devices=choices["devices"],
        num_nodes=choices["num_nodes"],
        precision=None if plugin is not None else choices["precision"],
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
        if not os.fspath(export):
            raise ValueError(f"`export` must be a directory for the INT8 model, not an empty path, got {export!r}.")
        return Int8Export(dirpath=Path(export))
    raise ValueError(f"`export` must be a directory, a dict or an Int8Export, got {export!r}.")
