"""StructuredPruning: remove channels during training, rebuild the optimizers, re-warm, fine-tune, report."""

from __future__ import annotations

import logging
import math
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import nn
from typing_extensions import override

from lightning_speedkit.pruning.surgery import (
    IMPORTANCES,
    History,
    _find_pruning_state,
    apply_pruning_history,
    channel_step_ratio,
    count_macs_params,
    cpu_latency_ms,
    output_layer_names,
    plan_pruning,
    pruning_history,
    replay_pruning_history,
    search_pruning_ratio,
    unsupported_layer_names,
)

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from torch.utils.hooks import RemovableHandle

log = logging.getLogger(__name__)

__all__ = ["StructuredPruning"]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _first_sample(batch: Any) -> Any:
    """The model input of a batch (a tensor, or the first item of a tuple/list), cut to one sample, on the CPU."""
    if isinstance(batch, (tuple, list)) and batch:
        batch = batch[0]
    if not isinstance(batch, torch.Tensor):
        raise ValueError(
            f"`example_input` must be given: the model has no `example_input_array` and the first batch"
            f" ({type(batch).__name__}) is not a tensor or a tuple starting with one."
        )
    return batch[:1].detach().cpu()


class _RestoreHook:
    """A module's ``load_state_dict`` pre-hook that calls back into the callback through a weak reference.

    Copies and pickles of the module (planning copies, MAC counting) get a hook that does nothing, so they never
    drag the callback, and through it the Trainer, along.
    """

    def __init__(self, callback: StructuredPruning) -> None:
        self._ref: Callable[[], StructuredPruning | None] = weakref.ref(callback)

    def __call__(self, module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        callback = self._ref()
        if callback is not None:
            callback._before_weights_load(module, state_dict, prefix)

    def __getstate__(self) -> dict[str, Any]:
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._ref = lambda: None


class StructuredPruning(Callback):
    """Removes whole channels with torch-pruning during training, then fine-tunes the smaller model.

    Unlike Lightning's ``ModelPruning`` (masks: same parameter count and latency), channels are cut out of the
    tensors, so parameters, MACs and latency drop. Step ``k`` (of ``iterative_steps``) runs at the first training
    batch of epoch ``start_epoch + k``; every epoch after a step trains the smaller model, and the last
    ``finetune_epochs`` epochs after the last step are the fine-tune whose result the report gives. Each step
    prunes a copy to find the plan (for ``target_speedup``: the smallest channel ratio whose MACs reach the step's
    geometric share of the target), broadcasts rank zero's plan and applies it on every rank, re-wraps the DDP
    model, rebuilds the optimizers and LR schedulers from ``configure_optimizers`` (carrying the current LRs and
    scheduler states over) and, when a speedkit ``WarmupScheduler`` is in ``trainer.callbacks``, restarts its warmup.

    Layers whose outputs reach the model output (the classifier) and ``nn.MultiheadAttention`` are left whole
    automatically, with one line saying so. The pruning history is this callback's state: ``trainer.fit(ckpt_path=...)``
    rebuilds the pruned architecture before the weights load (a ``load_state_dict`` pre-hook on the module), and
    `load_pruned_checkpoint` loads a checkpoint into a fresh module for inference.

    Args:
        amount: Share of each layer's channels to remove in all, in (0, 1). Exactly one of ``amount`` and
            ``target_speedup``.
        target_speedup: MACs before / MACs after, > 1 (e.g. 2.0).
        start_epoch: Epoch of the first pruning step (train the dense model before it).
        iterative_steps: Pruning steps, one per epoch.
        finetune_epochs: Epochs after the last step's epoch before the report is final.
        importance: One of ``"magnitude"`` (group L2 norm) or ``"l1"``.
        ignored_layers: Submodules (or their names in the LightningModule) to leave whole.
        round_to: Keep channel counts a multiple of this (None: any count).
        example_input: An input for tracing (tensor, tuple or dict); default the module's ``example_input_array``,
            else the first sample of the first training batch.
        rewarm: Warmup passed to ``WarmupScheduler.restart`` after each step (int steps or fraction in (0, 1)).
        monitor: Validation metric reported before pruning and after the fine-tune (None for none).
        latency_batch_sizes: Batch sizes at which CPU latency is measured before and after (empty: none).

    Raises:
        ValueError: In ``__init__`` for a bad argument; in ``setup`` for an unsupported strategy, too few
            ``max_epochs`` or an unknown layer name.
        RuntimeError: If the model cannot be traced or breaks after pruning (the message names the layer).

    Logged metrics (to every Trainer logger, rank zero, at ``step=trainer.global_step``):
        - ``speedkit/pruning/step``, ``speedkit/pruning/macs``, ``speedkit/pruning/params``: after each step.
        - ``speedkit/pruning/macs_before``, ``macs_after``, ``macs_speedup``, ``params_before``, ``params_after``,
          ``latency_ms_b{B}_before``, ``latency_ms_b{B}_after``, ``latency_speedup_b{B}``, ``{monitor}_before``,
          ``{monitor}_after`` (all under ``speedkit/pruning/``): once, at the end of the fine-tune.

    Example:
        >>> import lightning as L
        >>> pruning = StructuredPruning(target_speedup=2.0, start_epoch=5, finetune_epochs=5)
        >>> trainer = L.Trainer(max_epochs=11, logger=False, callbacks=[pruning])
    """

    def __init__(
        self,
        amount: float | None = None,
        target_speedup: float | None = None,
        start_epoch: int = 0,
        iterative_steps: int = 1,
        finetune_epochs: int = 1,
        importance: str = "magnitude",
        ignored_layers: Sequence[str | nn.Module] | None = None,
        round_to: int | None = 8,
        example_input: Any = None,
        rewarm: int | float = 0.1,
        monitor: str | None = "val_loss",
        latency_batch_sizes: Sequence[int] = (1,),
    ) -> None:
        if (amount is None) == (target_speedup is None):
            raise ValueError(
                f"Exactly one of `amount` and `target_speedup` must be given, got amount={amount!r},"
                f" target_speedup={target_speedup!r}."
            )
        if amount is not None and not (isinstance(amount, (int, float)) and 0.0 < amount < 1.0):
            raise ValueError(f"`amount` must be a float in (0, 1), got {amount!r}.")
        if target_speedup is not None and not (
            isinstance(target_speedup, (int, float)) and math.isfinite(target_speedup) and target_speedup > 1.0
        ):
            raise ValueError(f"`target_speedup` must be a finite number > 1, got {target_speedup!r}.")
        for name, value, low in (("start_epoch", start_epoch, 0), ("iterative_steps", iterative_steps, 1)):
            if not _is_int(value) or value < low:
                raise ValueError(f"`{name}` must be an int >= {low}, got {value!r}.")
        if not _is_int(finetune_epochs) or finetune_epochs < 0:
            raise ValueError(f"`finetune_epochs` must be an int >= 0, got {finetune_epochs!r}.")
        if importance not in IMPORTANCES:
            raise ValueError(f"`importance` must be one of {', '.join(map(repr, IMPORTANCES))}, got {importance!r}.")
        if round_to is not None and (not _is_int(round_to) or round_to < 1):
            raise ValueError(f"`round_to` must be a positive int or None, got {round_to!r}.")
        if not (_is_int(rewarm) and rewarm >= 0) and not (isinstance(rewarm, float) and 0.0 < rewarm < 1.0):
            raise ValueError(f"`rewarm` must be an int >= 0 (steps) or a float in (0, 1), got {rewarm!r}.")
        if any(not _is_int(b) or b < 1 for b in latency_batch_sizes):
            raise ValueError(f"`latency_batch_sizes` must hold positive ints, got {latency_batch_sizes!r}.")
        if monitor is not None and not isinstance(monitor, str):
            raise ValueError(f"`monitor` must be a metric name or None, got {monitor!r}.")
        if ignored_layers is not None and any(not isinstance(x, (str, nn.Module)) for x in ignored_layers):
            raise ValueError(f"`ignored_layers` must hold module names or modules, got {ignored_layers!r}.")
        self.amount, self.target_speedup = amount, target_speedup
        self.start_epoch, self.iterative_steps, self.finetune_epochs = start_epoch, iterative_steps, finetune_epochs
        self.importance, self.round_to, self.rewarm, self.monitor = importance, round_to, rewarm, monitor
        self.ignored_layers = list(ignored_layers or [])
        self.example_input = example_input
        self.latency_batch_sizes = tuple(latency_batch_sizes)
        self._example: Any = None
        self._steps_done = 0
        self._report: dict[str, Any] = {}
        self._ignored: list[str] | None = None
        self._history: History = []
        self._trainer: pl.Trainer | None = None
        self._hook: RemovableHandle | None = None

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(
            amount=self.amount,
            target_speedup=self.target_speedup,
            start_epoch=self.start_epoch,
            iterative_steps=self.iterative_steps,
            importance=self.importance,
        )

    @property
    def last_epoch(self) -> int:
        """The epoch at whose end the report is final: the last step's epoch plus ``finetune_epochs``."""
        return self.start_epoch + self.iterative_steps - 1 + self.finetune_epochs

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        strategy = trainer.strategy
        if not isinstance(strategy, (SingleDeviceStrategy, DDPStrategy)) or strategy.restore_checkpoint_after_setup:
            raise ValueError(
                f"StructuredPruning supports single-device and DDP strategies, got {type(strategy).__name__}:"
                " use strategy='auto' or 'ddp'."
            )
        if isinstance(getattr(strategy, "launcher", None), _MultiProcessingLauncher):
            raise ValueError(
                "StructuredPruning cannot run under 'ddp_spawn'/'ddp_fork'/'ddp_notebook': the main process loads the"
                " trained weights back into its unpruned module. Use strategy='ddp' (a script or torchrun)."
            )
        if stage == "fit":
            needed = self.last_epoch + 1
            if trainer.max_epochs is not None and 0 <= trainer.max_epochs < needed:
                raise ValueError(
                    f"StructuredPruning needs `max_epochs` >= {needed} (start_epoch + iterative_steps +"
                    f" finetune_epochs), got {trainer.max_epochs}: raise max_epochs or lower those arguments."
                )
            self._steps_done, self._report, self._ignored = 0, {}, None  # a checkpoint's state loads after this
            self._example = self.example_input
        self._history = pruning_history(pl_module)
        names = {m: n for n, m in pl_module.named_modules()}
        for layer in self.ignored_layers:
            if isinstance(layer, nn.Module) and layer not in names:
                raise ValueError(f"`ignored_layers` holds a module that is not part of {type(pl_module).__name__}.")
            if isinstance(layer, str) and layer not in dict(pl_module.named_modules()):
                raise ValueError(f"`ignored_layers` names {layer!r}, which is not a submodule of the LightningModule.")
        self._trainer = trainer
        if self._hook is None:
            self._hook = pl_module.register_load_state_dict_pre_hook(_RestoreHook(self))  # type: ignore[no-untyped-call]

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._steps_done < self.iterative_steps and trainer.current_epoch >= self.start_epoch + self._steps_done:
            self._prune_step(trainer, pl_module, batch)

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        done = self._steps_done == self.iterative_steps and trainer.current_epoch >= self.last_epoch
        if done and not self._report.get("finished"):
            self._finish(trainer, pl_module)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._steps_done and not self._report.get("finished"):  # stopped early: report what was reached
            self._finish(trainer, pl_module)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._hook is not None:
            self._hook.remove()
        self._hook, self._trainer = None, None

    @override
    def state_dict(self) -> dict[str, Any]:
        history = [list(record) for record in self._history]
        return {
            "history": history,
            "steps_done": self._steps_done,
            "example_input": self._example,
            "report": self._report,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._steps_done = int(state_dict.get("steps_done", 0))
        self._report = dict(state_dict.get("report", {}))
        if state_dict.get("example_input") is not None:
            self._example = state_dict["example_input"]

    def report(self) -> dict[str, Any]:
        """MACs, parameters, CPU latency and the monitored metric before pruning and after the fine-tune, per step.

        Keys: ``macs_before``/``macs_after``, ``params_before``/``params_after``, ``latency_ms_before``/
        ``latency_ms_after`` (batch size -> ms), ``monitor``, ``metric_before``/``metric_after``, ``steps`` (one
        dict per step: ``epoch``, ``ratio``, ``macs``, ``params``) and ``finished``.
        """
        return {
            k: (list(v) if isinstance(v, list) else dict(v) if isinstance(v, dict) else v)
            for k, v in self._report.items()
        }

    def _before_weights_load(self, module: nn.Module, state_dict: dict[str, Any], prefix: str) -> None:
        """Rebuild the pruned architecture from the checkpoint Lightning is restoring, before its weights load."""
        connector = getattr(self._trainer, "_checkpoint_connector", None)
        checkpoint = getattr(connector, "_loaded_checkpoint", None)
        if not isinstance(checkpoint, dict):
            return
        weights = checkpoint.get("state_dict")
        if prefix or not isinstance(weights, dict) or len(weights) != len(state_dict):
            return
        if any(value is not weights.get(key) for key, value in state_dict.items()):
            return  # torch loads a shallow copy: the same tensors, or not Lightning restoring its checkpoint
        state = checkpoint.get("callbacks", {}).get(self.state_key) or _find_pruning_state(checkpoint)
        if not state or not state.get("history"):
            return
        example = state.get("example_input")
        if example is None:
            example = self._example if self._example is not None else getattr(module, "example_input_array", None)
        replay_pruning_history(module, example, state["history"])
        self._example, self._history = example, pruning_history(module)

    def _resolve_example(self, pl_module: pl.LightningModule, batch: Any) -> Any:
        if self._example is None:
            example = pl_module.example_input_array
            self._example = example if example is not None else _first_sample(batch)
        return self._example

    def _ignored_names(self, pl_module: pl.LightningModule, example: Any) -> list[str]:
        if self._ignored is None:
            names = {m: n for n, m in pl_module.named_modules()}
            user = [layer if isinstance(layer, str) else names[layer] for layer in self.ignored_layers]
            outputs, unsupported = output_layer_names(pl_module, example), unsupported_layer_names(pl_module)
            self._ignored = sorted({*user, *outputs, *unsupported})
            auto = [f"{n} (output)" for n in outputs] + [f"{n} (unsupported)" for n in unsupported]
            rank_zero_info(f"StructuredPruning: leaving whole {', '.join(auto) or 'no layers'} automatically.")
        return self._ignored

    def _measure(self, trainer: pl.Trainer, pl_module: pl.LightningModule, when: str) -> None:
        macs, params = count_macs_params(pl_module, self._example)
        latency = None
        if trainer.is_global_zero:
            latency = {b: cpu_latency_ms(pl_module, self._example, b) for b in self.latency_batch_sizes}
        metric = None if self.monitor is None else trainer.callback_metrics.get(self.monitor)
        self._report.update(
            {
                f"macs_{when}": macs,
                f"params_{when}": params,
                f"latency_ms_{when}": trainer.strategy.broadcast(latency, src=0),
                f"metric_{when}": None if metric is None else float(metric),
                "monitor": self.monitor,
            }
        )

    def _prune_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any) -> None:
        example, step = self._resolve_example(pl_module, batch), self._steps_done
        if "macs_before" not in self._report:
            self._measure(trainer, pl_module, "before")
        ignored = self._ignored_names(pl_module, example)
        args = (ignored, self.importance, self.round_to)
        if self.amount is not None:
            ratio = channel_step_ratio(self.amount, step, self.iterative_steps)
            plan = plan_pruning(pl_module, example, ratio, *args)
        else:
            target = self._report["macs_before"] / self.target_speedup ** ((step + 1) / self.iterative_steps)  # type: ignore[operator]
            ratio, plan, reached = search_pruning_ratio(pl_module, example, target, *args)
            if reached > target:
                rank_zero_warn(
                    f"StructuredPruning: step {step + 1} reaches {self._report['macs_before'] / max(reached, 1.0):.2f}x"
                    f" fewer MACs, short of its target; lower `round_to` ({self.round_to}) or ignore fewer layers."
                )
        plan = trainer.strategy.broadcast(plan, src=0)  # every rank applies rank zero's plan
        apply_pruning_history(pl_module, example, plan)
        self._history = pruning_history(pl_module)
        self._steps_done += 1
        self._rebuild_optimizers(trainer)
        self._rewarm(trainer, pl_module, batch)
        macs, params = count_macs_params(pl_module, example)
        record = {"epoch": trainer.current_epoch, "ratio": ratio, "macs": macs, "params": params}
        self._report.setdefault("steps", []).append(record)
        self._log(trainer, {"step": float(self._steps_done), "macs": macs, "params": float(params)})
        before = self._report["macs_before"]
        rank_zero_info(
            f"StructuredPruning: step {self._steps_done}/{self.iterative_steps} at epoch {trainer.current_epoch}:"
            f" removed {sum(len(r[2]) for r in plan if r[1])} channels (ratio {ratio:.3f}); MACs {before:,.0f} ->"
            f" {macs:,.0f} ({before / max(macs, 1.0):.2f}x), params {self._report['params_before']:,} -> {params:,}."
        )

    def _rebuild_optimizers(self, trainer: pl.Trainer) -> None:
        """New optimizers and schedulers for the new parameters, keeping the current LRs and scheduler states."""
        strategy = trainer.strategy
        old_optimizers = list(strategy.optimizers)
        old_schedulers = [config.scheduler for config in strategy.lr_scheduler_configs]
        if isinstance(strategy, DDPStrategy):  # the DDP reducer holds the old parameters: wrap again (collective)
            strategy.model = strategy.lightning_module
            strategy.configure_ddp()
        strategy.setup_optimizers(trainer)
        for old, new in zip(old_optimizers, strategy.optimizers, strict=False):
            if len(old.param_groups) == len(new.param_groups):
                for old_group, new_group in zip(old.param_groups, new.param_groups, strict=True):
                    new_group.update({k: v for k, v in old_group.items() if k != "params"})
        for old_scheduler, config in zip(old_schedulers, strategy.lr_scheduler_configs, strict=False):
            if type(old_scheduler) is type(config.scheduler):
                config.scheduler.load_state_dict(old_scheduler.state_dict())

    def _rewarm(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any) -> None:
        """Restart a speedkit ``WarmupScheduler``'s warmup, and let it attach to the new optimizers now."""
        for callback in trainer.callbacks:  # type: ignore[attr-defined]
            if type(callback).__name__ == "WarmupScheduler" and callable(getattr(callback, "restart", None)):
                callback.restart(self.rewarm)
                callback.on_train_batch_start(trainer, pl_module, batch, 0)  # idempotent: resolves and attaches

    def _finish(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._measure(trainer, pl_module, "after")
        self._report["finished"] = True
        r = self._report
        metrics = {
            "macs_before": r["macs_before"],
            "macs_after": r["macs_after"],
            "macs_speedup": r["macs_before"] / max(r["macs_after"], 1.0),
            "params_before": float(r["params_before"]),
            "params_after": float(r["params_after"]),
        }
        for b, ms in (r["latency_ms_before"] or {}).items():
            after = (r["latency_ms_after"] or {}).get(b)
            metrics[f"latency_ms_b{b}_before"] = ms
            if after is not None:
                metrics[f"latency_ms_b{b}_after"] = after
                metrics[f"latency_speedup_b{b}"] = ms / after
        for when in ("before", "after"):
            if r.get(f"metric_{when}") is not None:
                metrics[f"{self.monitor}_{when}"] = r[f"metric_{when}"]
        self._log(trainer, metrics)
        rank_zero_info(
            f"StructuredPruning: MACs {metrics['macs_before']:,.0f} -> {metrics['macs_after']:,.0f}"
            f" ({metrics['macs_speedup']:.2f}x), params {r['params_before']:,} -> {r['params_after']:,}, latency"
            f" {r['latency_ms_before']} -> {r['latency_ms_after']} ms, {self.monitor} {r.get('metric_before')} ->"
            f" {r.get('metric_after')}."
        )

    def _log(self, trainer: pl.Trainer, metrics: dict[str, float]) -> None:
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics({f"speedkit/pruning/{k}": v for k, v in metrics.items()}, step=trainer.global_step)
