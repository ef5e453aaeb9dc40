"""What a trial or a rollback copies and puts back: host copies of the training state, loop flags, a GradScaler's state.

`take_state` and `put_back` serve `TrialSession`, `TrainingGuard` and `PrecisionTuner`'s counted blocks alike.
"""

from __future__ import annotations

import copy
import os
from collections import defaultdict
from typing import TYPE_CHECKING, Any

from lightning.pytorch.loops.loop import _Loop
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor, nn
from torch.amp.grad_scaler import _refresh_per_optimizer_state
from torchmetrics import Metric

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = [
    "SNAPSHOT_EVERY",
    "SNAPSHOT_SHARE",
    "cpu_copy",
    "host_memory",
    "loop_flags",
    "metric_states",
    "put_back",
    "put_metric_states",
    "reset_grad_scaler",
    "restore_loop_flags",
    "snapshot_bytes",
    "snapshot_interval",
    "take_state",
    "tell_rolled_back",
    "undo_block",
]


SNAPSHOT_EVERY = 50
"""The fewest optimizer steps between snapshots when the guard chooses (``every_n_steps=None``)."""
SNAPSHOT_SHARE = 0.01
"""The most of the training time the guard's snapshots may take when it chooses their interval."""


def cpu_copy(value: Any) -> Any:
    """A deep copy with every tensor copied to host memory (so a snapshot costs no device memory).

    Example:
        >>> import torch
        >>> state = {"w": torch.ones(2), "step": 3}
        >>> copied = cpu_copy(state)
        >>> copied["w"].add_(1.0).tolist(), state["w"].tolist(), copied["step"]
        ([2.0, 2.0], [1.0, 1.0], 3)
    """
    copies: dict[int, Tensor] = {}

    def host(tensor: Tensor) -> Tensor:
        copied = tensor.detach().to("cpu", copy=True)
        copies[id(copied)] = copied
        return copied

    return copy.deepcopy(apply_to_collection(value, Tensor, host), memo=copies)  # the host copies are not copied again


def take_state(trainer: pl.Trainer, schedulers: bool = True, precision: bool = True) -> dict[str, Any]:
    """Host copies of what training steps change, for `put_back`.

    The weights and every optimizer's state; unless told not to, every LR scheduler's state and the precision
    plugin's (a GradScaler's scale).

    Example:
        >>> import lightning as L, torch
        >>> from lightning.pytorch.demos.boring_classes import BoringModel
        >>> quiet = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False)
        >>> trainer = L.Trainer(max_steps=1, enable_model_summary=False, **quiet)
        >>> trainer.fit(BoringModel())
        >>> state = take_state(trainer)
        >>> sorted(state), state["model"]["layer.weight"].device.type
        (['model', 'optimizers', 'precision', 'schedulers'], 'cpu')
        >>> with torch.no_grad():
        ...     _ = trainer.lightning_module.layer.weight.add_(1.0)
        >>> put_back(trainer, state)
        >>> torch.equal(trainer.lightning_module.layer.weight, state["model"]["layer.weight"])
        True
    """
    state = {
        "model": cpu_copy(trainer.lightning_module.state_dict()),
        "optimizers": [cpu_copy(optimizer.state_dict()) for optimizer in trainer.optimizers],
    }
    if schedulers:
        state["schedulers"] = [copy.deepcopy(config.scheduler.state_dict()) for config in trainer.lr_scheduler_configs]
    if precision:
        state["precision"] = cpu_copy(trainer.precision_plugin.state_dict())
    return state


def put_back(trainer: pl.Trainer, state: dict[str, Any]) -> None:
    """Load what `take_state` copied (schedulers and precision plugin only when it copied them).

    Loads copies: torch's ``Optimizer.load_state_dict`` keeps the host tensors it is given on a CPU run (an SGD
    momentum buffer, Adam's moments) and the next steps would change them in place, and the state with them; a
    rollback or a trial that puts the same state back twice would then load those steps' moments (after a NaN
    step, NaN ones).
    """
    trainer.lightning_module.load_state_dict(state["model"])
    for optimizer, saved in zip(trainer.optimizers, state["optimizers"], strict=True):
        optimizer.load_state_dict(copy.deepcopy(saved))
    for config, saved in zip(trainer.lr_scheduler_configs, state.get("schedulers", []), strict="schedulers" in state):
        config.scheduler.load_state_dict(copy.deepcopy(saved))
    if "precision" in state:
        reset_grad_scaler(trainer.precision_plugin)
        trainer.precision_plugin.load_state_dict(copy.deepcopy(state["precision"]))


def tell_rolled_back(trainer: pl.Trainer, step: int) -> None:
    """Call ``rolled_back(trainer, step)`` on every callback that has it: the run's state of ``step`` was put back.

    A `~lightning_speedkit.average.WeightAverage` starts its average again (it holds the steps undone); whoever
    undoes steps of the run (`~lightning_speedkit.guard.TrainingGuard`'s rollback, a rejected precision block) tells
    them.
    """
    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        if callable(told := getattr(callback, "rolled_back", None)):
            told(trainer, step)


def undo_block(trainer: pl.Trainer, state: dict[str, Any]) -> None:
    """Put back a counted block's start (`take_state` without schedulers, with its ``"step"``); tell every callback.

    The step count goes on, so the LRs stay where the schedule has taken them: a scheduler that steps from the
    current LR (``ExponentialLR``, ``StepLR``) would otherwise carry the block's first LR on for the rest of the run.
    """
    lrs = [[group.get("lr") for group in optimizer.param_groups] for optimizer in trainer.optimizers]
    put_back(trainer, state)
    for optimizer, kept in zip(trainer.optimizers, lrs, strict=True):
        for group, lr in zip(optimizer.param_groups, kept, strict=False):
            if lr is not None:
                group["lr"] = lr
    tell_rolled_back(trainer, state["step"])


def _loops(loop: _Loop) -> list[_Loop]:
    """``loop`` and every loop under it."""
    found = [loop]
    for value in vars(loop).values():
        if isinstance(value, _Loop):
            found += _loops(value)
    return found


_LOOP_FLAGS = ("_restarting", "_resuming_from_checkpoint", "_loaded_from_state_dict", "_restart_stage", "_has_run")
"""What a loop's run and its state loading set beside its progress (those a Lightning version has)."""


def loop_flags(loop: _Loop) -> list[tuple[_Loop, dict[str, Any]]]:
    """The flags (`_LOOP_FLAGS`) of ``loop`` and every loop under it, for `restore_loop_flags`.

    Loading a loop's state marks it (and its children) restarting and resuming from a checkpoint; a trial loads the
    fit loop's state, so a session started mid-fit puts these flags back, or the run's next epoch would take itself
    for a resumed one (and skip its data iterator's reset). The restart stage (Lightning 2.5+) too: a trial at the
    start of a fit resumed mid-epoch reset it, and Lightning then began that epoch again with its start hooks. And
    whether the validation loop has run: a trial's validation batch at the start of a resumed fit left it set, and the
    resumed epoch loop, still restarting, took its epoch for done: the fit trained no batch (or, with ``max_steps``,
    ran empty epochs without end).
    """
    return [(each, {name: getattr(each, name) for name in _LOOP_FLAGS if hasattr(each, name)}) for each in _loops(loop)]


def restore_loop_flags(flags: list[tuple[_Loop, dict[str, Any]]]) -> None:
    """Put back what `loop_flags` read."""
    for loop, values in flags:
        for name, value in values.items():
            setattr(loop, name, value)


def reset_grad_scaler(plugin: Any) -> None:
    """Forget a GradScaler's per-optimizer step state, which ``load_state_dict`` leaves as it is.

    An OOM between ``unscale_`` and ``update`` leaves an optimizer marked unscaled; the next trial's ``unscale_``
    would then fail with "unscale_() has already been called".
    """
    scaler = getattr(plugin, "scaler", None)
    if scaler is not None and hasattr(scaler, "_per_optimizer_states"):
        scaler._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)


def snapshot_bytes(*states: Any) -> int:
    """The bytes the tensors in ``states`` take (what a host-memory snapshot of them costs).

    Example:
        >>> import torch
        >>> snapshot_bytes({"w": torch.zeros(10)}, [{"m": torch.zeros(5, dtype=torch.float64)}])
        80
    """
    total = 0

    def count(tensor: Tensor) -> Tensor:
        nonlocal total
        total += tensor.numel() * tensor.element_size()
        return tensor

    apply_to_collection(states, Tensor, count)
    return total


def host_memory() -> int:
    """Bytes of the machine's memory (16 GiB when the system does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return 16 * 2**30


def snapshot_interval(
    snapshot_s: float, step_s: float, least: int = SNAPSHOT_EVERY, share: float = SNAPSHOT_SHARE
) -> int:
    """Steps between snapshots: ``least`` doubled until a snapshot takes at most ``share`` of the steps' time.

    Example:
        >>> snapshot_interval(0.0005, 0.002), snapshot_interval(0.5, 0.1), snapshot_interval(0.1, 0.0)
        (50, 800, 50)
    """
    interval = least
    while step_s > 0 and snapshot_s > share * interval * step_s:
        interval *= 2
    return interval


_METRIC_FIELDS = ("_update_count", "_computed", "_forward_cache")
"""What a torchmetrics `Metric` holds beside its states (``_defaults``) that ``compute`` and ``update`` read."""


def metric_states(module: nn.Module) -> list[tuple[Metric, dict[str, Any]]]:
    """Each torchmetrics `Metric` in ``module`` with a copy of what it has accumulated, for `put_metric_states`.

    Metric states are not in ``state_dict`` (unless persistent): put back, a trial's updates are taken out and the
    run's kept (resetting them lost what a metric had gathered over the epochs before a later trial).

    Example:
        >>> from torchmetrics import SumMetric
        >>> total = SumMetric(); total.update(3.0)
        >>> saved = metric_states(nn.ModuleDict({"total": total})); total.update(4.0); put_metric_states(saved)
        >>> total.compute().item()
        3.0
    """
    saved = []
    for sub in module.modules():
        if isinstance(sub, Metric):
            names = [name for name in (*sub._defaults, *_METRIC_FIELDS) if hasattr(sub, name)]
            saved.append((sub, {name: copy.deepcopy(getattr(sub, name)) for name in names}))
    return saved


def put_metric_states(saved: list[tuple[Metric, dict[str, Any]]]) -> None:
    """Put back the states `metric_states` copied (copies again: the same saved states may be put back twice)."""
    for metric, state in saved:
        for name, value in state.items():
            setattr(metric, name, copy.deepcopy(value))
