"""``speedkit.preset()``: a Trainer with the precision, strategy, callbacks and logger speedkit would choose here."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import Logger
from lightning.pytorch.plugins import Precision
from lightning.pytorch.strategies import DDPStrategy, Strategy
from lightning.pytorch.utilities import rank_zero_info

from lightning_speedkit.callback_table import SLOTS, default_callbacks
from lightning_speedkit.checks import check_bool
from lightning_speedkit.forked import ForkedDDPStrategy
from lightning_speedkit.hardware import CpuInfo, GpuInfo, cpu_info, gpu_infos
from lightning_speedkit.loggers import RunSummary, choose_logger
from lightning_speedkit.recommend import interactive_session, placement, recommend, unified_precision
from lightning_speedkit.trials import Lever

log = logging.getLogger(__name__)

__all__ = ["PresetChoices", "choose", "preset"]


class PresetChoices(dict[str, Any]):
    """What `preset` chose and why, as a plain dict that serialises as it is.

    Keys: ``accelerator``, ``devices``, ``num_nodes``, ``precision`` (the one the Trainer starts in),
    ``tune_precision`` (whether `PrecisionTuner` measures the precision at fit start), ``strategy``,
    ``channels_last`` (whether `ChannelsLast` measures the layout), ``num_workers``, ``logger``, ``callbacks``,
    ``reasons`` (a one-line reason per choice; ``"as asked"`` where the user decided) and ``overridden`` (the user's
    value for each choice they made instead of speedkit, e.g. ``{"accelerator": "cpu", "devices": 2}``; an object is
    named by its type). What the levers measure at fit start is not written here: `decisions` reads it from them.
    """

    _levers: list[Lever]

    def attach(self, callbacks: Sequence[Callback]) -> None:
        """Remember the Trainer's levers (read by `decisions`) and record which callbacks there are."""
        self._levers = [c for c in callbacks if isinstance(c, Lever)]
        names = [type(c).__name__ for c in callbacks]
        self["tune_precision"] = self["tune_precision"] and "PrecisionTuner" in names
        self["channels_last"] = "ChannelsLast" in names

    def decisions(self) -> dict[str, dict[str, Any]]:
        """Each lever's decision so far, by class name: ``decision``, ``reason`` and ``source`` (empty before fit)."""
        return {
            type(lever).__name__: {k: lever.decision.as_dict()[k] for k in ("decision", "reason", "source")}
            for lever in getattr(self, "_levers", [])
            if lever.decision is not None
        }

    def summary(self) -> str:
        """One short, human-readable line per choice, which ones the user's arguments decided, and what was measured."""
        reasons = self["reasons"]
        lines = ["speedkit.preset:"]
        for key in ("accelerator", "devices", "precision", "strategy", "logger", "callbacks"):
            value = self[key]
            shown = ", ".join(value) if isinstance(value, list) and key == "callbacks" else value
            lines.append(f"  {key:<11} {shown!s:<28} {reasons.get(key, '')}".rstrip())
        if self.get("overridden"):
            lines.append(f"  {'as asked':<11} {', '.join(f'{k}={v!r}' for k, v in self['overridden'].items())}")
        for name, decision in self.decisions().items():
            source, reason = decision["source"], decision["reason"]
            shown = reason if reason.startswith(f"{source}:") else f"{source}: {reason}"  # not "skipped: skipped: ..."
            lines.append(f"  {name:<11} {decision['decision']!s:<28} {shown}")
        return "\n".join(lines)


def choose(
    cpu: CpuInfo,
    gpus: Sequence[GpuInfo],
    devices: Any = "auto",
    num_nodes: int = 1,
    precision: Any = "auto",
    strategy: Any = "auto",
    accelerator: str = "auto",
) -> PresetChoices:
    """Decide accelerator, devices, the starting precision and the strategy from hardware facts (no Trainer built).

    The hardware decisions are `lightning_speedkit.recommend`'s; an argument other than ``"auto"`` is used as it is,
    recorded in ``overridden`` with the reason ``"as asked"`` (naming speedkit's choice where it differs). What the
    facts cannot decide is measured at fit start: ``precision="auto"`` sets ``tune_precision`` for `PrecisionTuner`.

    Raises:
        ValueError: If ``accelerator`` asks for a GPU torch does not see, ``devices`` asks for more GPUs (or, on
            CPU, processes than cores) than exist, or an argument is malformed.

    Example:
        >>> cpu = CpuInfo(8, 8, "test CPU", ("avx2",), "AVX2")
        >>> c = choose(cpu, [GpuInfo(i, "NVIDIA A100", (8, 0), 40 * 2**30) for i in range(4)], devices=4)
        >>> c["accelerator"], c["devices"], c["precision"], c["strategy"], c["tune_precision"]
        ('gpu', 4, '16-mixed', 'ddp', True)
        >>> c = choose(cpu, [], devices=2, precision="32-true")
        >>> c["strategy"], c["tune_precision"], c["overridden"], c["reasons"]["devices"]
        ('ddp', False, {'devices': 2, 'precision': '32-true'}, 'as asked (speedkit would choose 1)')
    """
    precision = unified_precision(precision)
    where = placement(cpu, gpus, accelerator, devices, num_nodes)
    advice = recommend(cpu, where.gpus, where.processes, num_nodes)
    reasons = {**where.reasons, **{key: advice[key]["reason"] for key in ("precision", "strategy")}}
    choices = PresetChoices(
        accelerator=where.accelerator,
        devices=where.devices,
        num_nodes=num_nodes,
        precision=advice["precision"]["value"],
        tune_precision=precision == "auto",
        strategy=advice["strategy"]["value"],
        channels_last=False,
        num_workers=advice["num_workers"]["value"],
        reasons=reasons,
        overridden={},
    )
    ours = {**choices, "accelerator": placement(cpu, gpus, num_nodes=num_nodes).accelerator}
    ours["devices"] = placement(cpu, gpus, where.accelerator, num_nodes=num_nodes).devices
    asked = {"accelerator": accelerator, "devices": devices, "precision": precision, "strategy": strategy}
    for key, value in asked.items():
        if isinstance(value, str) and value == "auto":
            continue
        shown = list(value) if isinstance(value, (list, tuple)) else value
        shown = shown if isinstance(shown, (str, int, list)) else type(shown).__name__
        choices[key] = choices["overridden"][key] = shown
        note = "" if shown == ours[key] else f" (speedkit would choose {ours[key]!r})"
        choices["reasons"][key] = f"as asked{note}"
    return choices


def preset(
    devices: int | str | Sequence[int] = "auto",
    num_nodes: int = 1,
    precision: str | int = "auto",
    strategy: str | Strategy = "auto",
    logger: Logger | Sequence[Logger] | bool | str = "auto",
    callbacks: Callback | Sequence[Callback] | None = None,
    accelerator: str = "auto",
    verbose: bool = True,
    remember: bool = True,
    channels_last: Any = True,
    tune_precision: Any = True,
    fused_optimizer: Any = True,
    tune_data: Any = True,
    batch_size: Any = False,
    lr: Any = False,
    compile: Any = False,
    warmup: Any = True,
    guard: Any = True,
    average: Any = False,
    monitor: Any = True,
    prune: Any = None,
    export: Any = None,
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
    - Strategy (`lightning_speedkit.recommend.strategy_choice`): ``devices * num_nodes > 1`` gives DDP (`DDPStrategy`
      with ``gradient_as_bucket_view=True``; gloo on CPU, NCCL on GPU; in an interactive session, a notebook, its
      processes are forked, as Lightning's ``"ddp_fork"``: there is no script to run again). Multi-node runs take
      their ranks from Lightning's cluster environments: launch with ``torchrun --nnodes=N --nproc-per-node=G
      --rdzv-backend=c10d --rdzv-endpoint=HOST:PORT train.py`` or ``srun`` under SLURM, with
      ``preset(devices=G, num_nodes=N)``.
    - Callbacks: `lightning_speedkit.callback_table.default_callbacks`, from the one table of speedkit's callbacks in
      acting order (a user callback of the same type replaces ours), then a `RunSummary` that writes every
      callback's report to ``speedkit_summary.json`` (and the W&B run summary). Every slot takes one form:
      ``False`` (leave it out), ``True`` (its defaults), a dict of its arguments, or an instance; ``prune`` also
      takes a channel amount and ``export`` a directory. In by default: ``channels_last`` (`ChannelsLast`, which
      acts only on conv nets and keeps NHWC only when real steps are faster), ``tune_precision`` (`PrecisionTuner`,
      with ``precision="auto"`` only), ``fused_optimizer`` (`FusedOptimizer`: the user's Adam, AdamW or SGD update
      as torch's fused kernel, kept only when real steps are faster), ``tune_data`` (`DataLoaderTuner`), ``warmup``
      (`WarmupScheduler`: warmup-stable-decay, the user's LR from the first step (a raised LR is ramped up to over
      5% of the steps left), held, and cooled down over the last 20% of the budget unless a trial at the start of
      the epoch in which the cool-down begins finds the held LR clearly better: ``cooldown_check="trial"``; with an
      LR scheduler of the user's own, that schedule alone, no decay on top: ``decay="auto"``), ``guard``
      (`TrainingGuard`: a last-good snapshot, rolled back at half the LR on a NaN or a loss spike) and ``monitor``
      (`UtilizationMonitor`). Out by default: ``batch_size`` (`BatchSizeFinder`; ``"auto"`` or ``True`` on CPU,
      which never runs out of memory, keeps the user's batch, with the reason), ``lr`` (`LRFinder`; ``lr="auto"``
      or ``True``: short LR trials at fit start keep the user's LR unless another is clearly and much better, then
      every LR is scaled to it and the warmup ramps to it), ``average`` (`WeightAverage`: validation, checkpoints
      and the weights after fit are a moving average of the trained weights, over a quarter of the steps between
      two validations; training itself is unchanged), ``compile`` (`Compile`: eager and
      compiled steps timed at fit start, the compiled module kept only when the steps left repay the compile),
      ``prune`` (`StructuredPruning`) and ``export`` (`Int8Export`).
    - Every lever remembers its decision across runs (``remember=False`` switches that off;
      `lightning_speedkit.trials.memory`): a later run of the same job on the same machine applies it without
      probing, and ``speedkit doctor`` / ``speedkit forget`` list and clear what is remembered.
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
    check_bool("verbose", verbose)
    check_bool("remember", remember)
    plugins = trainer_kwargs.get("plugins")
    plugins = plugins if isinstance(plugins, (list, tuple)) else [plugins]
    plugin = next((p for p in plugins if isinstance(p, Precision)), None)
    if plugin is not None and precision != "auto":
        raise ValueError(f"`precision`={precision!r} and a {type(plugin).__name__} in `plugins`: pass one of them.")
    asked_precision = plugin.precision if plugin is not None else precision
    choices = choose(cpu_info(), gpu_infos(), devices, num_nodes, asked_precision, strategy, accelerator)
    if plugin is not None:
        choices["reasons"]["precision"] = f"as asked, by the {type(plugin).__name__} in `plugins`"
    given = locals()
    slots = {slot.argument: given[slot.argument] for slot in SLOTS}  # every slot's argument, by the one table
    if not choices["tune_precision"]:  # an asked precision is used as it is
        if not isinstance(tune_precision, bool):
            raise ValueError(
                f"`tune_precision` must be True or False with `precision`={precision!r} (a precision asked for is"
                f" used as it is; pass precision='auto' to tune it), got {tune_precision!r}."
            )
        slots["tune_precision"] = False
    asked = slots["batch_size"]
    if (asked is True or (isinstance(asked, str) and asked == "auto")) and choices["accelerator"] == "cpu":
        slots["batch_size"] = False  # no memory limit to find; throughput alone grew a small model's batch to the data
        choices["reasons"]["batch_size"] = (
            "yours: a CPU never runs out of memory, and the fastest batch changes the training (a tiny model's grew to"
            " the whole data set, its LR x128); BatchSizeFinder(objective='throughput') searches anyway"
        )
    chosen_callbacks = default_callbacks(callbacks=callbacks, remember=remember, **slots)
    choices.attach(chosen_callbacks)
    if not any(isinstance(c, RunSummary) for c in chosen_callbacks):
        chosen_callbacks.append(RunSummary())
    strategy_obj: Any = strategy
    if strategy == "auto" and choices["strategy"] == "ddp":
        backend = "nccl" if choices["accelerator"] in ("gpu", "cuda") else "gloo"
        fork = num_nodes == 1 and interactive_session()  # a notebook cannot re-run a script: Lightning's ddp_fork
        kind = ForkedDDPStrategy if fork else DDPStrategy  # forked: the decisions come back to the notebook
        strategy_obj = kind(  # popen, DDPStrategy's default, runs the script again in each process
            process_group_backend=backend, gradient_as_bucket_view=True, start_method="fork" if fork else "popen"
        )
        if fork:
            choices["reasons"]["strategy"] += "; forked from this interactive session (a notebook re-runs no script)"
    chosen_logger, choices["reasons"]["logger"] = choose_logger(logger, trainer_kwargs.get("default_root_dir"))
    named = chosen_logger if isinstance(chosen_logger, list) else [chosen_logger]
    choices["logger"] = ", ".join(type(one).__name__ if isinstance(one, Logger) else str(one) for one in named)
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
    if plugin is None and str(trainer.precision) != str(choices["precision"]):  # e.g. 16-mixed runs bf16 on a CPU
        ran = str(trainer.precision)
        choices["reasons"]["precision"] += (
            f"; Lightning runs {ran} for {choices['precision']} on {choices['accelerator']}"
        )
        choices["precision"] = ran
    trainer.speedkit = choices  # type: ignore[attr-defined]
    if verbose:
        rank_zero_info(choices.summary())
    return trainer
