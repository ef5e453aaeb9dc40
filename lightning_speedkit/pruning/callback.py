"""StructuredPruning: remove channels during training, rebuild the optimizers, re-warm, fine-tune, report."""

from __future__ import annotations

import copy
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor, nn
from typing_extensions import override

from lightning_speedkit.hooks import LeanCallback
from lightning_speedkit.pruning.arguments import (
    check_example_fits,
    check_pruning_args,
    check_steps_reach,
    check_strategy,
    first_sample,
)
from lightning_speedkit.pruning.optimizers import rebuild_optimizers, restart_warmup
from lightning_speedkit.pruning.report import (
    DEFAULT_MONITOR,
    check_monitor_logged,
    final_metrics,
    finish_line,
    step_line,
    warn_if_nothing_removed,
    warn_monitor_not_logged,
)
from lightning_speedkit.pruning.restore import RestoreHook, rebuild_before_load
from lightning_speedkit.pruning.search import cpu_latency_ms
from lightning_speedkit.pruning.surgery import (
    History,
    apply_pruning_history,
    channel_step_ratio,
    count_macs_params,
    output_layer_names,
    plan_pruning,
    pruning_history,
    unsupported_layer_names,
)
from lightning_speedkit.pruning.targets import PlanArgs, Target, check_reachable, plan_toward, speedup_target
from lightning_speedkit.report import log_rank_zero
from lightning_speedkit.restore import ListOf, StateSpec, cached_state_key, check_checkpoints

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from torch.utils.hooks import RemovableHandle

log = logging.getLogger(__name__)

__all__ = ["StructuredPruning"]


class StructuredPruning(LeanCallback):
    """Removes whole channels (and attention heads) with torch-pruning during training, then fine-tunes.

    Unlike Lightning's ``ModelPruning`` (masks: same parameter count and latency), channels are cut out of the
    tensors, so parameters, MACs and latency drop. Step ``k`` (of ``iterative_steps``) runs at the first training
    batch of epoch ``start_epoch + k``; every later epoch trains the smaller model, the last ``finetune_epochs`` the
    fine-tune whose result the report gives. Each step prunes copies on rank zero to find the plan, broadcasts it
    and applies it on every rank, re-wraps the DDP model, rebuilds the optimizers and LR schedulers from
    ``configure_optimizers`` (carrying the current LRs and scheduler states over) and restarts the warmup of each
    warmup callback (a ``WarmupScheduler``, or any with `lightning_speedkit.lr.WarmupLike`'s methods).

    How much: ``amount`` removes that share of every layer's channels. ``target_speedup`` is a **MACs** ratio: the
    smallest channel ratio whose MACs reach the step's geometric share of the target (exact and portable, but
    2x fewer MACs is often only ~1.4x faster). ``target_latency`` is **measured speed**: each candidate ratio's pruned
    copy is timed against the current model on the example input, on the training device (or the CPU with
    ``latency_device="cpu"``, for CPU deployment), and the smallest ratio that is fast enough wins; ``round_to``
    keeps widths the kernels run fast. With a target, a scan at the first training batch checks that some ratio
    reaches it, so an unreachable target fails before training, not after it.

    Attention: timm-style (one ``qkv`` Linear reshaped by ``num_heads``) and BERT-style (``query``/``key``/
    ``value``) self-attention lose whole heads, and the module's head-count fields are updated, so its forward
    still runs; ``nn.MultiheadAttention`` shrinks with its embedding, to a multiple of its head count. Layers whose
    outputs reach the model output (the classifier) and ``nn.MultiheadAttention`` with ``kdim``/``vdim`` are left
    whole automatically, with one line saying so. The pruning history is this callback's state: ``trainer.fit(ckpt_path=
    ...)`` rebuilds the pruned architecture before the weights load (a ``load_state_dict`` pre-hook on the module),
    and `load_pruned_checkpoint` loads a checkpoint into a fresh module for inference.

    Args:
        amount: Share of each layer's channels to remove in all, in (0, 1). Exactly one of ``amount``,
            ``target_speedup`` and ``target_latency``.
        target_speedup: MACs before / MACs after, > 1 (e.g. 2.0). Not a latency.
        target_latency: Latency before / latency after on the example input, > 1 (e.g. 1.7), measured.
        start_epoch: Epoch of the first pruning step (train the dense model before it).
        iterative_steps: Pruning steps, one per epoch.
        finetune_epochs: Epochs after the last step's epoch before the report is final.
        importance: One of ``"magnitude"`` (group L2 norm) or ``"l1"``.
        ignored_layers: A list of submodules (or their names in the LightningModule) whose output channels are never
            pruned (torch-pruning's ``ignored_layers``: their input channels still follow the layer before them when
            it is pruned); one name is ``["net.0"]`` (a bare string is refused, not read as its characters).
        round_to: Keep channel counts a multiple of this (None: any count).
        example_input: An input for tracing (tensor, tuple or dict); default the module's ``example_input_array``,
            else the first sample of the first training batch. Run once through the model at fit start.
        rewarm: Warmup passed to the warmup callback's ``restart`` after each step (int steps or fraction in (0, 1)).
        monitor: Validation metric reported before pruning and after the fine-tune (None for none). One you name
            must be logged: the first validation of the fit checks it; the default, ``"val_loss"``, is only warned
            about when the module logs no such metric (its report then has none).
        latency_batch_sizes: A list of batch sizes at which CPU latency is measured before and after (empty: none).
        latency_device: Where ``target_latency`` is timed: ``"auto"`` (the training device) or ``"cpu"``.

    Raises:
        ValueError: In ``__init__`` for a bad argument; in ``setup`` for an unsupported strategy, too few
            ``max_epochs`` or an unknown layer name; at fit start for an ``example_input`` the model does not
            accept; at the first training batch for a target no ratio reaches (the message gives what was reached;
            the model is left as it was); at the end of the first validation of the fit for a ``monitor`` (other
            than the default) that is not logged (the message lists what is). With no validation at all, an
            unlogged ``monitor`` is a warning when the report is made.
        RuntimeError: If the model cannot be traced or breaks after pruning (the message names the layer).

    Logged metrics (to every Trainer logger, rank zero, at ``step=trainer.global_step``):
        - ``speedkit/pruning/step``, ``macs``, ``params`` after each step, and ``speedup`` (the MACs or latency
          speedup reached so far) with a target.
        - ``speedkit/pruning/macs_before``, ``macs_after``, ``macs_speedup``, ``params_before``, ``params_after``,
          ``latency_ms_b{B}_before``, ``latency_ms_b{B}_after``, ``latency_speedup_b{B}``, ``{monitor}_before``,
          ``{monitor}_after`` (all under ``speedkit/pruning/``): once, at the end of the fine-tune.

    Example:
        >>> import lightning as L
        >>> pruning = StructuredPruning(target_latency=1.7, start_epoch=5, finetune_epochs=5, latency_device="cpu")
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
        monitor: str | None = DEFAULT_MONITOR,
        latency_batch_sizes: Sequence[int] = (1,),
        *,
        target_latency: float | None = None,
        latency_device: str = "auto",
    ) -> None:
        check_pruning_args(
            amount,
            target_speedup,
            target_latency,
            start_epoch,
            iterative_steps,
            finetune_epochs,
            importance,
            ignored_layers,
            round_to,
            example_input,
            rewarm,
            monitor,
            latency_batch_sizes,
            latency_device,
        )
        self.amount, self.target_speedup, self.target_latency = amount, target_speedup, target_latency
        self.start_epoch, self.iterative_steps, self.finetune_epochs = start_epoch, iterative_steps, finetune_epochs
        self.importance, self.round_to, self.rewarm, self.monitor = importance, round_to, rewarm, monitor
        self.ignored_layers = list(ignored_layers or [])
        self.example_input, self.latency_batch_sizes = example_input, tuple(latency_batch_sizes)
        self.latency_device = latency_device
        self._example: Any = None
        self._last_metric: float | None = None  # the monitor at the last validation of the fit
        self._steps_done = 0
        self._report: dict[str, Any] = {}
        self._ignored: list[str] | None = None
        self._history: History = []
        self._trainer: pl.Trainer | None = None
        self._hook: RemovableHandle | None = None
        self._target_checked = self._monitor_checked = False

    @property
    @override
    def state_key(self) -> str:
        return cached_state_key(
            self,
            amount=self.amount,
            target_speedup=self.target_speedup,
            **({"target_latency": self.target_latency} if self.target_latency is not None else {}),
            start_epoch=self.start_epoch,
            iterative_steps=self.iterative_steps,
            importance=self.importance,
        )

    @property
    def last_epoch(self) -> int:
        """The epoch at whose end the report is final: the last step's epoch plus ``finetune_epochs``."""
        return self.start_epoch + self.iterative_steps - 1 + self.finetune_epochs

    state_spec: ClassVar[StateSpec] = {
        "history": ListOf(list),
        "steps_done": int,
        "example_input": (Tensor, tuple, list, dict, None),
        "report": dict,
        "last_metric": (float, None),
    }
    """What a checkpoint may hold for pruning (checked before anything is restored: `lightning_speedkit.restore`)."""

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        check_checkpoints(trainer)
        check_strategy(trainer.strategy)
        if stage == "fit":
            needed = self.last_epoch + 1
            if trainer.max_epochs is not None and 0 <= trainer.max_epochs < needed:
                fix = "`fast_dev_run` runs one epoch" if trainer.fast_dev_run else "raise it or lower those arguments"  # type: ignore[attr-defined]
                raise ValueError(
                    f"StructuredPruning needs `max_epochs` >= {needed} (start_epoch + iterative_steps +"
                    f" finetune_epochs), got {trainer.max_epochs}: {fix}."
                )
            self._steps_done, self._report, self._ignored = 0, {}, None  # a checkpoint's state loads after this
            self._target_checked = self._monitor_checked = self._example_checked = False
            example, convert = self.example_input, trainer.precision_plugin.convert_input  # as the module is fed
            self._example = None if example is None else convert(example)
        self._history = pruning_history(pl_module)
        names = {m: n for n, m in pl_module.named_modules()}
        for layer in self.ignored_layers:
            if isinstance(layer, nn.Module) and layer not in names:
                raise ValueError(f"`ignored_layers` holds a module that is not part of {type(pl_module).__name__}.")
            if isinstance(layer, str) and layer not in dict(pl_module.named_modules()):
                raise ValueError(f"`ignored_layers` names {layer!r}, which is not a submodule of the LightningModule.")
        self._trainer = trainer
        if self._hook is None:
            hook = RestoreHook(self._before_weights_load)
            self._hook = pl_module.register_load_state_dict_pre_hook(hook)  # type: ignore[no-untyped-call]

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        check_steps_reach(trainer, self.last_epoch)

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if not self._example_checked:  # one forward before any step, not at start_epoch: a wrong input is named
            self._example_checked = True
            example, context = self._resolve_example(pl_module, batch), trainer.precision_plugin.forward_context()
            check_example_fits(pl_module, example, "example_input", None, context)
        if not self._target_checked and self._steps_done == 0 and self.amount is None:
            self._target_checked = True
            example = self._resolve_example(pl_module, batch)
            check_reachable(trainer, pl_module, example, self._target(pl_module), self._plan_args(pl_module, example))
        if self._steps_done < self.iterative_steps and trainer.current_epoch >= self.start_epoch + self._steps_done:
            self._prune_step(trainer, pl_module, batch)

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.monitor is not None and not trainer.sanity_checking and trainer.state.fn == "fit":
            if not self._monitor_checked:
                self._monitor_checked = True
                check_monitor_logged(trainer, self.monitor)
            value = trainer.callback_metrics.get(self.monitor)
            self._last_metric = self._last_metric if value is None else float(value)  # the "before" of a resumed fit

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        done = self._steps_done == self.iterative_steps and trainer.current_epoch >= self.last_epoch
        if done and not self._report.get("finished"):
            self._finish(trainer, pl_module)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._steps_done and not self._report.get("finished"):  # stopped early: report what was reached
            self._finish(trainer, pl_module)
        elif not self._steps_done:
            rank_zero_warn(
                f"StructuredPruning: the fit ended after {trainer.current_epoch} epoch(s), before the first pruning"
                f" step at `start_epoch`={self.start_epoch} (stopped early?): nothing was pruned."
            )

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._hook is not None:
            self._hook.remove()
        self._hook, self._trainer = None, None

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "history": [list(record) for record in self._history],
            "steps_done": self._steps_done,
            "example_input": self._example,
            "report": self._report,
            "last_metric": self._last_metric,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._steps_done = int(state_dict.get("steps_done", 0))
        self._report = dict(state_dict.get("report", {}))
        self._last_metric = state_dict.get("last_metric")
        if state_dict.get("example_input") is not None:
            self._example = state_dict["example_input"]

    def report(self) -> dict[str, Any]:
        """MACs, parameters, CPU latency and the monitored metric before pruning and after the fine-tune, per step.

        Keys: ``macs_before``/``macs_after``, ``params_before``/``params_after``, ``latency_ms_before``/
        ``latency_ms_after`` (batch size -> ms), ``monitor``, ``metric_before``/``metric_after``, ``steps`` (one
        dict per step: ``epoch``, ``ratio``, ``macs``, ``params`` and, with a target, ``speedup``: the MACs or
        measured latency speedup over the unpruned model so far) and ``finished``.
        """
        return copy.deepcopy(self._report)

    def _before_weights_load(self, module: nn.Module, state_dict: dict[str, Any], prefix: str) -> None:
        """Rebuild the pruned architecture from the checkpoint Lightning is restoring, before its weights load."""
        example = self._example if self._example is not None else getattr(module, "example_input_array", None)
        if example is not None and self._example is None and self._trainer is not None:  # as the module is fed
            example = self._trainer.precision_plugin.convert_input(example)
        rebuilt = rebuild_before_load(self._trainer, module, state_dict, prefix, self.state_key, example)
        if rebuilt is not None:
            self._example, self._history = rebuilt, pruning_history(module)

    def _resolve_example(self, pl_module: pl.LightningModule, batch: Any) -> Any:
        if self._example is None:  # converted as Lightning feeds the module (bf16-true: to bfloat16)
            example = pl_module.example_input_array
            convert = pl_module.trainer.precision_plugin.convert_input
            self._example = convert(example) if example is not None else first_sample(batch)
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
        metric = None if self.monitor is None else trainer.callback_metrics.get(self.monitor, self._last_metric)
        latency, value = trainer.strategy.broadcast(latency, src=0), None if metric is None else float(metric)
        self._report.update({f"macs_{when}": macs, f"params_{when}": params, f"latency_ms_{when}": latency,
                             f"metric_{when}": value, "monitor": self.monitor})  # fmt: skip

    def _plan_step(self, pl_module: pl.LightningModule, example: Any, step: int) -> tuple[float, History, float | None]:
        args = self._plan_args(pl_module, example)
        if self.amount is not None:
            ratio = channel_step_ratio(self.amount, step, self.iterative_steps)
            return ratio, plan_pruning(pl_module, example, ratio, *args), None
        steps = self._report.get("steps", [])
        done = float(steps[-1].get("speedup") or 1.0) if steps else 1.0
        return plan_toward(pl_module, example, self._target(pl_module), step, self.iterative_steps, done, args)

    def _target(self, pl_module: pl.LightningModule) -> Target:
        return speedup_target(self.target_speedup, self.target_latency, self.latency_device, pl_module.device)

    def _plan_args(self, pl_module: pl.LightningModule, example: Any) -> PlanArgs:
        return self._ignored_names(pl_module, example), self.importance, self.round_to

    def _prune_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any) -> None:
        example, step = self._resolve_example(pl_module, batch), self._steps_done
        if "macs_before" not in self._report:
            self._measure(trainer, pl_module, "before")
        planned: Any = self._plan_step(pl_module, example, step) if trainer.is_global_zero else None
        ratio, plan, speedup = trainer.strategy.broadcast(planned, src=0)  # every rank applies rank zero's plan
        apply_pruning_history(pl_module, example, plan)
        self._history = pruning_history(pl_module)
        self._steps_done += 1
        rebuild_optimizers(trainer)
        restart_warmup(trainer, pl_module, batch, self.rewarm)
        macs, params = count_macs_params(pl_module, example)
        record = {"epoch": trainer.current_epoch, "ratio": ratio, "macs": macs, "params": params}
        self._report.setdefault("steps", []).append(record if speedup is None else {**record, "speedup": speedup})
        logged = {"step": float(self._steps_done), "macs": macs, "params": float(params)}
        self._log(trainer, logged if speedup is None else {**logged, "speedup": speedup})
        removed = sum(len(r[2]) for r in plan if r[1])
        warn_if_nothing_removed(removed, ratio, self.round_to)
        measured = None if self.target_latency is None else speedup
        rank_zero_info(step_line(self._report, self.iterative_steps, removed, measured))

    def _finish(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.monitor is not None and not self._monitor_checked:  # no validation ran: say so, once
            warn_monitor_not_logged(trainer, self.monitor)
        self._measure(trainer, pl_module, "after")
        self._report["finished"] = True
        metrics = final_metrics(self._report, self.monitor)
        self._log(trainer, metrics)
        rank_zero_info(finish_line(self._report, metrics, self.monitor))

    def _log(self, trainer: pl.Trainer, metrics: dict[str, float]) -> None:
        log_rank_zero(trainer, {f"speedkit/pruning/{k}": v for k, v in metrics.items()})
