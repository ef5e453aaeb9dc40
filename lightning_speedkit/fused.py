"""FusedOptimizer: the user's Adam, AdamW or SGD update as torch's fused kernel, kept only when its steps are faster.

torch's Adam, AdamW and SGD take ``fused=True``: every parameter's update in one kernel per device and dtype, instead of
torch's CPU default, a Python loop of small ops per tensor. The update is the same (up to rounding), so the user's
optimizer, its state and its checkpoints stay as they are; only the step's speed changes, and by how much depends on
the model (many small tensors gain most) and the CPU: on the 2-core AVX-512 EPYC the fused AdamW step of the
``lr_tasks`` transformer took 0.7 ms against 1.5 ms, of a 7.8 ms training step (a scratch timing, not a benchmark).
So the lever trains the fit's first steps in counted blocks with the flag on and off
(`lightning_speedkit.trials.counted`), timing in each step what the flag changes, the update (`_UpdateClock`), and
keeps the fused update only when it wins by the margin.

Only a group whose ``fused`` and ``foreach`` the user left unset (None) is switched: an explicit choice is the
user's. Only CPU parameters: on CUDA torch already defaults to ``foreach``, and its fused Adam keeps the step count on
the GPU where the default keeps it on the host, a switch mid-run this CPU-only project cannot test.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from torch.optim import SGD, Adam, AdamW, Optimizer
from torch.utils.hooks import RemovableHandle
from typing_extensions import override

from lightning_speedkit import trials
from lightning_speedkit.checks import check_bool, check_margin, check_probe_steps
from lightning_speedkit.timing import StepClock
from lightning_speedkit.trials.counted import CountedTrials

__all__ = ["FUSABLE", "FusedOptimizer", "fusable_groups", "set_fused"]

FUSABLE: tuple[type[Optimizer], ...] = (Adam, AdamW, SGD)
"""The optimizers switched, by exact type (a subclass may step its own way)."""

_FUSED, _DEFAULT = "fused", "default"
_MAX_GAIN = 0.25
"""The most the fused update is taken to save of a step, for the payback rule (an optimizer step is part of a step)."""

_SPARSE = (torch.nn.Embedding, torch.nn.EmbeddingBag)
"""Layers whose weight may get sparse gradients (``sparse=True``), which torch's fused kernels refuse."""

_HOOK = "_speedkit_fused_hook"
"""The attribute of an optimizer that holds this lever's ``load_state_dict`` hook (one per optimizer)."""


def fusable_groups(optimizer: Optimizer, switched: bool = False) -> tuple[list[dict[str, Any]], str]:
    """The param groups of ``optimizer`` the fused kernel can take over, or none and why.

    A group qualifies when the optimizer is exactly `FUSABLE`, the group's ``fused`` and ``foreach`` are unset (None;
    with ``switched``, ``fused`` may also be True: set by this lever), it is not ``differentiable``, and each of its
    parameters is a floating-point CPU tensor; torch's default dtype must be float32 (the fused kernels count steps in
    float32).

    Example:
        >>> w = torch.nn.Parameter(torch.zeros(3))
        >>> len(fusable_groups(torch.optim.AdamW([w], lr=0.1))[0])
        1
        >>> fusable_groups(torch.optim.AdamW([w], lr=0.1, foreach=False))[1]
        'AdamW: `foreach`/`fused` set by you (foreach=False, fused=None)'
        >>> fusable_groups(torch.optim.RMSprop([w]))[1]
        'RMSprop has no fused kernel here (Adam, AdamW, SGD)'
    """
    name = type(optimizer).__name__
    if type(optimizer) not in FUSABLE:
        return [], f"{name} has no fused kernel here ({', '.join(c.__name__ for c in FUSABLE)})"
    if torch.get_default_dtype() != torch.float32:
        return [], f"torch's default dtype is {torch.get_default_dtype()}, not float32"
    fused_ok = (None, True) if switched else (None,)
    groups = []
    for group in optimizer.param_groups:
        if group.get("fused") not in fused_ok or group.get("foreach") is not None:
            chosen = f"foreach={group.get('foreach')}, fused={group.get('fused')}"
            return [], f"{name}: `foreach`/`fused` set by you ({chosen})"
        if group.get("differentiable"):
            return [], f"{name}: differentiable=True"
        params = group["params"]
        if any(p.device.type != "cpu" or not torch.is_floating_point(p) for p in params):
            return [], f"{name}: parameters that are not floating-point CPU tensors"
        groups.append(group)
    return groups, ""


def set_fused(groups: Sequence[dict[str, Any]], on: bool) -> None:
    """Switch ``groups`` to the fused update (``on``) or back to torch's default (``fused=None``).

    Example:
        >>> w = torch.nn.Parameter(torch.zeros(3))
        >>> opt = torch.optim.SGD([w], lr=0.1)
        >>> set_fused(opt.param_groups, True); opt.param_groups[0]["fused"]
        True
    """
    for group in groups:
        group["fused"] = True if on else None


class _Fused(trials.Setting):
    """The fused update on or off for a counted trial: only a flag the optimizer reads at each step changes."""

    changes_math = False

    def __init__(self, lever: FusedOptimizer, on: bool) -> None:
        self.lever, self.on, self.name = lever, on, _FUSED if on else _DEFAULT
        self._was = False

    @override
    def apply(self, trainer: pl.Trainer) -> None:
        self._was = self.lever.fused_on
        self.lever.use(trainer, self.on)

    @override
    def revert(self, trainer: pl.Trainer) -> None:
        self.lever.use(trainer, self._was)


class _UpdateClock(StepClock):
    """Times the part of a step the fused flag changes: from ``on_before_optimizer_step`` (`mark`) to the step's end.

    The forward and backward passes are the same in both settings; left out, their noise on a shared machine does
    not hide the update's gain (the update is 5-20% of a step on the ``lr_tasks`` workloads, and fused takes about
    half of it) as it did over whole steps, where five fits of one job kept the fused update two or three times. A
    step without a mark is timed whole.
    """

    def __init__(self) -> None:
        super().__init__()
        self._marked = 0.0

    def mark(self) -> None:
        """The gradients are ready and the update is next (the first mark of a running step counts)."""
        if self.running and not self._marked:
            self._marked = time.perf_counter()

    @override
    def stop(self) -> float:
        marked, self._marked = self._marked, 0.0
        whole = super().stop()
        return time.perf_counter() - marked if marked else whole


class _UpdateTrials(CountedTrials):
    """Counted trials whose blocks time the update of each step (`_UpdateClock`), not the whole step."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._clock = self.clock = _UpdateClock()


class FusedOptimizer(trials.Lever):
    """Run the user's Adam, AdamW or SGD update as torch's fused kernel when real steps show it faster.

    At fit start the optimizers' param groups that qualify (`fusable_groups`: the optimizer's ``fused`` and ``foreach``
    left unset, CPU parameters) are found; with none, nothing is measured and the report says why. Otherwise the
    fit's first training steps are the probe (counted trials, `lightning_speedkit.trials.counted`): blocks of
    ``probe_steps`` steps alternate torch's default update and the fused one, three rounds, every step training the
    model as the run would, so the probe costs only the slower blocks' extra seconds. Each step is timed from
    Lightning's ``on_before_optimizer_step`` (the gradients ready) to its end, the part the flag changes (whole
    steps when gradients accumulate over several batches); the fused update is kept when it is at least
    ``margin`` faster. The choice outlives an optimizer state being loaded (a checkpoint, a
    `TrainingGuard` rollback): a hook on each optimizer puts the flag back. A run too short for the probe to pay
    back keeps the default, and the report says why. The life cycle (checkpointed decision, resume, report) is
    `lightning_speedkit.trials.Lever`'s. An optimizer rebuilt from one of these with its param groups' settings
    (a pruning fine-tune's) keeps the fused update; one built anew keeps torch's default.

    Args:
        margin: How much faster (relative time of the span timed, in [0, 1)) the fused update must be to be kept.
        probe_steps: The longest block of each setting, in training steps (the first of each block is a warm-up); a
            run too short to repay blocks that long gets the longest it can, down to ``MIN_BLOCK``.
        remember: Remember the decision across runs (`lightning_speedkit.trials.memory`): a later run with the same
            fingerprint (model, batch, loader, devices, hardware, versions, arguments) applies it without probing.

    Raises:
        ValueError: For a ``margin`` outside [0, 1), ``probe_steps`` below 2 or a non-bool ``remember``.

    Logged metrics: ``speedkit/optimizer/<setting>_step_ms`` and ``speedkit/optimizer/probe_s``.

    Example:
        >>> import lightning as L
        >>> trainer = L.Trainer(logger=False, callbacks=[FusedOptimizer(margin=0.05)])
    """

    AREA = "optimizer"
    MAX_GAIN = _MAX_GAIN
    COUNTED = True
    MIN_BLOCK = 5  # the first step of each block is a warm-up

    def __init__(self, margin: float = 0.03, probe_steps: int = 20, remember: bool = True) -> None:
        self.remember = check_bool("remember", remember)
        self.margin = check_margin("margin", margin)
        self.probe_steps = check_probe_steps("probe_steps", probe_steps, low=2)
        self.fused_on = False
        self.switched = 0
        self._accumulate = 1

    @override
    def counted_trials(
        self, current: trials.Setting, others: Sequence[trials.Setting], steps: int, warmup: int
    ) -> CountedTrials:
        """Blocks timed from the gradients to the step's end (`_UpdateClock`), or whole steps under accumulation."""
        kind = _UpdateTrials if self._accumulate == 1 else CountedTrials
        return kind(current, others, steps, self.margin, warmup=warmup)

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        """Mark the update's start for the counted blocks (a no-op once decided)."""
        if isinstance(self._counted, _UpdateTrials):
            self._counted.clock.mark()

    @override
    def finish(self, decision: trials.Decision) -> trials.Decision:
        if decision.probed and decision.source == "measured" and self._accumulate == 1:  # a remembered one has it
            decision.reason += " (the update timed: from the gradients to the step's end)"
        return decision

    @override
    def plan(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule
    ) -> tuple[trials.Setting, Sequence[trials.Setting]] | trials.Decision:
        if not trainer.optimizers:
            return trials.Decision.skipped(_DEFAULT, "no optimizer")
        self._accumulate = trainer.accumulate_grad_batches
        sparse = {id(m.weight) for m in pl_module.modules() if isinstance(m, _SPARSE) and m.sparse}
        if any(id(p) in sparse for o in trainer.optimizers for g in o.param_groups for p in g["params"]):
            return trials.Decision.skipped(_DEFAULT, "left as it is: sparse gradients (an Embedding with sparse=True)")
        found = [fusable_groups(optimizer) for optimizer in trainer.optimizers]
        problems = [why for groups, why in found if not groups]
        if problems:
            return trials.Decision.skipped(_DEFAULT, f"left as it is: {'; '.join(problems)}")
        return _Fused(self, False), [_Fused(self, True)]

    @override
    def apply(self, trainer: pl.Trainer, pl_module: pl.LightningModule, decision: trials.Decision) -> None:
        if decision.decision == _FUSED or self.fused_on:  # never touch groups this lever did not switch
            self.use(trainer, decision.decision == _FUSED)

    def use(self, trainer: pl.Trainer, on: bool) -> None:
        """Switch every qualifying group of the Trainer's optimizers to the fused update (``on``) or back.

        The first switch on hooks each optimizer's ``load_state_dict``, so a loaded state keeps the current choice.
        """
        self.fused_on, self.switched = on, 0
        for optimizer in trainer.optimizers:
            groups, _ = fusable_groups(optimizer, switched=True)
            set_fused(groups, on)
            self.switched += len(groups) if on else 0
            if on and not hasattr(optimizer, _HOOK):
                setattr(optimizer, _HOOK, optimizer.register_load_state_dict_post_hook(_keeper(self)))

    @override
    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        """A checkpoint written mid-probe holds torch's default update, never the fused block's candidate.

        The default is the setting before the probe: a resume probes again, or keeps it.
        """
        if self._counted is None or not self.fused_on:
            return
        for optimizer, state in zip(trainer.optimizers, checkpoint.get("optimizer_states") or [], strict=False):
            switched = {id(group) for group in fusable_groups(optimizer, switched=True)[0]}
            for live, saved in zip(optimizer.param_groups, state.get("param_groups", []), strict=False):
                if id(live) in switched:
                    saved["fused"] = None

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().teardown(trainer, pl_module, stage)
        for optimizer in trainer.optimizers:
            hook: RemovableHandle | None = optimizer.__dict__.pop(_HOOK, None)
            if hook is not None:
                hook.remove()

    @override
    def status(self) -> dict[str, Any]:
        """``fused_groups``: the param groups running the fused update now.

        The decision beside it (`lightning_speedkit.trials.Decision`): ``decision`` (``"fused"`` or ``"default"``),
        ``reason``, ``source``, ``step_ms`` (per setting when measured, the median milliseconds from the gradients to
        the step's end: the update, and what follows it in every step alike),
        ``probe_s`` and ``probed``.
        """
        return {"fused_groups": self.switched}


def _keeper(lever: FusedOptimizer) -> Any:
    """A ``load_state_dict`` post-hook that puts the lever's current choice back (holding the lever weakly)."""
    ref = weakref.ref(lever)

    def keep(optimizer: Optimizer) -> None:
        owner = ref()
        if owner is not None:
            groups, _ = fusable_groups(optimizer, switched=True)
            set_fused(groups, owner.fused_on)

    return keep
