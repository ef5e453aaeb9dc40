"""TrainingGuard: keep a last-good snapshot, and roll back with a lower LR on a NaN, a loss spike or a stalled run.

Anchors: LLM Foundry's ``KillLossSpike`` (a loss well above the window's), OLMo-core's skip-step optimizer (a z-score
over a window of recent losses) and PaLM's manual restarts from a checkpoint before the spike, with the data moving on.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from typing import Any, ClassVar

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor
from typing_extensions import override

from lightning_speedkit.budget import estimated_budget, schedule_step
from lightning_speedkit.checks import check_int, check_number, is_int
from lightning_speedkit.hooks import LeanCallback
from lightning_speedkit.lr import rescale_run_lrs
from lightning_speedkit.report import log_rank_zero
from lightning_speedkit.restore import ListOf, StateSpec, check_checkpoints
from lightning_speedkit.robust import robust_z
from lightning_speedkit.trials.snapshot import (
    SNAPSHOT_EVERY,
    SNAPSHOT_SHARE,
    host_memory,
    put_back,
    snapshot_bytes,
    snapshot_interval,
    take_state,
    tell_rolled_back,
)

__all__ = ["SNAPSHOT_EVERY", "SNAPSHOT_SHARE", "TrainingGuard", "robust_z", "snapshot_bytes", "snapshot_interval"]

_TIMED_STEPS = 10
"""Steps timed after the first snapshot to choose the interval."""

UNDONE = 0.5
"""The share of the loss's fall since the first steps (``window`` losses) a spike must take back: a classifier near a
loss of 0.01 from 1.4 met two hard batches at 0.2 in a row (z far over 8), and the guard halved its LR for them."""


class TrainingGuard(LeanCallback):
    """Roll training back to the last good state, at a lower LR, when the loss goes wrong; then go on.

    Every ``every_n_steps`` optimizer steps (and at the first step), the weights, optimizer, LR-scheduler and
    precision-plugin states are copied to host memory. By default the guard chooses the interval: `SNAPSHOT_EVERY`
    steps, doubled until a snapshot (timed at the first step) takes at most `SNAPSHOT_SHARE` of the time of the
    steps between two (the median of the first ten), so the insurance costs at most 1% of the run (a large model
    whose copy to host takes longer gets rarer snapshots); rank zero's choice holds on every rank. Each step's train
    loss, averaged over ranks (so every rank decides alike), is checked (read after each step, or in batches of
    ``check_every_n_steps``; under manual optimization, a step that returns no scalar loss is not watched:
    ``unwatched`` in `report`, and one warning):

    - **non-finite**: a NaN or an infinity;
    - **spike**: more than ``spike_z`` robust standard deviations (`robust_z`) above the median of the last
      ``window`` losses, and back up by at least `UNDONE` of the loss's fall since the first steps, on two steps in a
      row. One batch alone is not enough: late in training a single hard batch can lie 8 MADs out (the demo: a batch
      loss of 0.55 against a median of 0.18), while weights a bad step broke give a high loss on the next batch too;
    - **stall**: with ``stall_steps``, the mean of the latest losses is still above ``stall_fraction`` times the mean
      of the first ones, ``stall_steps`` steps after the start (or after a stall rollback): a run stuck on a plateau
      (at too high an LR, typically). A stall rolls back to the first snapshot.

    A rollback restores the snapshot, multiplies every LR by ``backoff`` (through `lightning_speedkit.lr`, so a
    `WarmupScheduler` follows; an optimizer with no ``lr`` is left as it is, said in the warning), calls
    ``rolled_back(trainer, step)`` on every callback that has it (a `WeightAverage` starts again: its average holds
    the broken steps) and goes on with the next batch. After ``max_rollbacks`` rollbacks the next trigger raises a
    `RuntimeError` that says what happened. A snapshot larger than ``max_snapshot_bytes`` (default: a quarter of host
    memory) is not taken, nor kept from before: the guard then only watches and raises on the first trigger. Its
    state is checkpointed (counters, events, the loss window); snapshots are not, since a checkpoint is one: a fit
    resumed from it rolls back (a stall too) to the resume point at the latest.

    Args:
        every_n_steps: Optimizer steps between snapshots; None (default) for the guard's choice (`snapshot_interval`).
        window: Losses the spike and stall checks look back over (>= 2).
        spike_z: Robust z-score above which a loss is a spike.
        stall_steps: Steps (at least 2) after which a run whose loss has not fallen is stalled (a float in (0, 1):
            that fraction of the run's steps); None never checks. The means compared are over ``min(window,
            stall_steps // 2)`` steps, so the two never overlap.
        stall_fraction: The loss must be below this fraction of its starting value by ``stall_steps``, in (0, 1).
        backoff: LR multiplier after a rollback, in (0, 1).
        max_rollbacks: Rollbacks allowed before the guard stops the run (>= 0).
        max_snapshot_bytes: Largest snapshot kept in host memory; None: a quarter of the machine's memory.
        check_every_n_steps: Steps whose losses are read and judged together (>= 1; default 1, each step). Reading a
            loss on a GPU waits for its step, and under DDP each read is an all-reduce; on one H200 reading every 16
            steps was not measurably faster (`benchmarks/guard_overhead.py`). Pending losses are also read before each
            snapshot (a snapshot is only taken of checked steps), at an epoch's last batch and when training ends; a
            trigger is acted on up to ``check_every_n_steps - 1`` steps after its step (the event's ``step``).

    Raises:
        ValueError: For a non-positive ``every_n_steps``, ``check_every_n_steps``, ``spike_z`` or ``stall_steps``, a
            ``window`` below 2, ``backoff`` or ``stall_fraction`` outside (0, 1), or a negative ``max_rollbacks``.

    Logged metrics: ``speedkit/guard/rollbacks``, ``speedkit/guard/lr_scale`` and ``speedkit/guard/snapshot_mb``.

    Example:
        >>> import lightning as L
        >>> trainer = L.Trainer(logger=False, callbacks=[TrainingGuard(every_n_steps=50, backoff=0.5)])
    """

    def __init__(
        self,
        every_n_steps: int | None = None,
        window: int = 50,
        spike_z: float = 8.0,
        stall_steps: int | float | None = None,
        stall_fraction: float = 0.9,
        backoff: float = 0.5,
        max_rollbacks: int = 3,
        max_snapshot_bytes: int | None = None,
        check_every_n_steps: int = 1,
    ) -> None:
        check_int("every_n_steps", every_n_steps, optional=True)
        check_int("check_every_n_steps", check_every_n_steps)
        check_int("window", window, low=2)
        whole = isinstance(stall_steps, float) and stall_steps >= 2 and stall_steps.is_integer()  # a YAML/CLI float
        share = isinstance(stall_steps, float) and 0.0 < stall_steps < 1.0
        if stall_steps is not None and not (whole or share or is_int(stall_steps, low=2)):
            raise ValueError(
                f"`stall_steps` must be an int >= 2, a fraction of the run in (0, 1), or None, got {stall_steps!r}."
            )
        stall_steps = int(stall_steps) if whole and stall_steps is not None else stall_steps
        check_number("spike_z", spike_z, 0, open_low=True)
        check_number("backoff", backoff, 0, 1, open_low=True, open_high=True)
        check_number("stall_fraction", stall_fraction, 0, 1, open_low=True, open_high=True)
        check_int("max_rollbacks", max_rollbacks, low=0)
        check_int("max_snapshot_bytes", max_snapshot_bytes, low=0, optional=True)
        self.every_n_steps, self.window, self.spike_z = every_n_steps, window, float(spike_z)
        self.stall_steps, self.stall_fraction = stall_steps, float(stall_fraction)
        self.backoff, self.max_rollbacks = float(backoff), max_rollbacks
        self.max_snapshot_bytes, self.check_every_n_steps = max_snapshot_bytes, check_every_n_steps
        self._stall_at: int | None = stall_steps if isinstance(stall_steps, int) else None
        self._reset()

    def _reset(self) -> None:
        """A fit's own state: a second fit (another model, or the same one again) starts from none of the first's."""
        self._pending: list[tuple[int, Tensor | float]] = []  # (step, its loss on this rank), not yet read
        self._losses: deque[float] = deque(maxlen=self.window)
        self._spiked = False  # the last step's loss was a spike: one more in a row rolls back
        self._start_losses: list[float] = []
        self._stall_from, self._rollbacks, self._lr_scale = 0, 0, 1.0
        self._events: list[dict[str, Any]] = []
        self._snapshot: dict[str, Any] | None = None
        self._first: dict[str, Any] | None = None
        self._watch_only, self._snapshot_size, self._snapshot_s = "", 0, 0.0
        self._unwatched = 0  # manual optimization's steps that returned no scalar loss
        self._every = self.every_n_steps or SNAPSHOT_EVERY
        self._step_s: list[float] = []  # the first steps' durations, while the interval is chosen
        self._last_end: float | None = None

    state_spec: ClassVar[StateSpec] = {
        "losses": ListOf(float),
        "spiked": bool,
        "start_losses": ListOf(float),
        "stall_from": int,
        "rollbacks": int,
        "lr_scale": float,
        "events": ListOf(dict),
        "pending": ListOf(ListOf((int, float))),
        "unwatched": int,
    }
    """What a checkpoint may hold for the guard (checked before anything is restored: `lightning_speedkit.restore`)."""

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        check_checkpoints(trainer)
        if stage == "fit":  # each fit chooses the interval again; a checkpoint's state loads after this
            self._reset()

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if isinstance(self.stall_steps, float):
            total = estimated_budget(trainer)
            self._stall_at = None if math.isinf(total) else max(4, int(self.stall_steps * total))

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._snapshot is None and not self._watch_only:
            if self._pending and not self._check(trainer):  # a resumed run's unread losses (a rollback raises)
                return
            self._take(trainer, first=True)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if pl_module.automatic_optimization and (outputs is None or outputs == {}):
            return  # `training_step` returned None: Lightning skipped the batch, and so does the guard
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if not isinstance(loss, Tensor) or loss.numel() != 1:  # manual optimization: the step is not watched
            self._unwatched += 1
            if self._unwatched == 1:
                got = "None" if outputs is None or outputs == {} else repr(outputs)[:80]
                rank_zero_warn(f"TrainingGuard: `training_step` returned no scalar loss under manual optimization (got"
                               f" {got}): such steps are not watched, and nothing rolls them back; return the loss (a"
                               " scalar tensor, or a dict with one under 'loss') to have them guarded.")  # fmt: skip
            return
        self._pending.append((schedule_step(trainer), loss.detach().float().reshape(())))
        if (len(self._pending) >= self.check_every_n_steps or trainer.is_last_batch) and not self._check(trainer):
            return
        if self.every_n_steps is None and len(self._step_s) < _TIMED_STEPS and not self._watch_only:
            self._time_step(trainer)
        stale = self._stale(trainer)  # the optimizer was rebuilt (pruning: new shapes): a new first snapshot
        if (stale or schedule_step(trainer) % self._every == 0) and not self._watch_only:
            if self._pending and not self._check(trainer):  # a snapshot of checked steps only
                return
            self._take(trainer, first=stale)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._pending:  # the last steps' losses are judged too: a broken last step is rolled back
            self._check(trainer)

    def settle_weights(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """`on_train_end`'s check, which `Int8Export` calls before exporting: judged once (a second call finds none)."""
        self.on_train_end(trainer, pl_module)

    def _check(self, trainer: pl.Trainer) -> bool:
        """Read the pending losses (one sync, one reduction over ranks) and judge them in order; False: rolled back."""
        pending, self._pending = self._pending, []
        device = trainer.strategy.root_device  # where the reduction runs; a checkpoint's unread losses are floats
        stacked = torch.stack([torch.as_tensor(v, dtype=torch.float32, device=device) for _, v in pending])
        values = trainer.strategy.reduce(stacked, reduce_op="mean").tolist()
        for (step, _), value in zip(pending, values, strict=True):
            trigger = self._judge(value, step)
            if trigger is not None:
                self._roll_back(trainer, trigger, value)
                return False
            self._losses.append(value)
            if len(self._start_losses) < self.window:
                self._start_losses.append(value)
        return True

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "losses": list(self._losses),
            "spiked": self._spiked,
            "start_losses": list(self._start_losses),
            "stall_from": self._stall_from,
            "rollbacks": self._rollbacks,
            "lr_scale": self._lr_scale,
            "events": list(self._events),
            # Unread losses, this rank's, read after a resume. Under DDP a checkpoint holds rank 0's state, so those
            # steps (< check_every_n_steps) are then judged by rank 0's losses on every rank; none with the default 1.
            "pending": [[step, float(v)] for step, v in self._pending],
            "unwatched": self._unwatched,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._losses = deque(state_dict.get("losses", []), maxlen=self.window)
        self._spiked = bool(state_dict.get("spiked", False))
        self._start_losses = list(state_dict.get("start_losses", []))
        self._stall_from = int(state_dict.get("stall_from", 0))
        self._rollbacks = int(state_dict.get("rollbacks", 0))
        self._lr_scale = float(state_dict.get("lr_scale", 1.0))
        self._events = list(state_dict.get("events", []))
        self._pending = [(int(step), float(v)) for step, v in state_dict.get("pending", [])]
        self._unwatched = int(state_dict.get("unwatched", 0))

    def report(self) -> dict[str, Any]:
        """What the guard did, as a plain dict.

        Keys: ``rollbacks``, ``lr_scale`` (the product of the backoffs), ``events`` (step, trigger, loss (None when
        non-finite), restored step, LR scale), ``snapshot_bytes``, ``snapshot_s`` (the first snapshot's seconds),
        ``every_n_steps`` (the interval in use), ``check_every_n_steps`` (losses read at once), ``watch_only`` (why
        no snapshot is kept, if so) and ``unwatched`` (steps of manual optimization that returned no scalar loss).
        """
        return {"rollbacks": self._rollbacks, "lr_scale": self._lr_scale, "events": list(self._events),
                "snapshot_bytes": self._snapshot_size, "snapshot_s": self._snapshot_s, "every_n_steps": self._every,
                "watch_only": self._watch_only, "check_every_n_steps": self.check_every_n_steps,
                "unwatched": self._unwatched}  # fmt: skip

    def _judge(self, value: float, step: int) -> str | None:
        if not math.isfinite(value):
            return "non-finite loss"
        window = list(self._losses)
        spiked = len(window) >= self.window and robust_z(value, window) > self.spike_z
        if spiked and self._start_losses:  # near convergence two hard batches are far out, but undo little
            middle = statistics.median(window)
            spiked = value > middle + UNDONE * max(0.0, statistics.fmean(self._start_losses) - middle)
        self._spiked, twice = spiked, spiked and self._spiked
        if twice:
            return "loss spike"
        if self._stall_at is not None and step - self._stall_from == self._stall_at:
            n = min(self.window, self._stall_at // 2)
            latest, first = list(self._losses)[-n:], self._start_losses[:n]
            if len(first) == n and statistics.fmean(latest) > self.stall_fraction * statistics.fmean(first):
                return "stalled"
        return None

    def _time_step(self, trainer: pl.Trainer) -> None:
        """Time the steps after the first snapshot; after `_TIMED_STEPS`, choose the interval (rank zero's)."""
        now = time.perf_counter()
        if self._last_end is not None:
            self._step_s.append(now - self._last_end)
        self._last_end = now
        if len(self._step_s) == _TIMED_STEPS:
            interval = snapshot_interval(self._snapshot_s, statistics.median(self._step_s))
            self._every = int(trainer.strategy.broadcast(interval, src=0))

    def _take(self, trainer: pl.Trainer, first: bool) -> None:
        started = time.perf_counter()
        states = {
            "model": trainer.lightning_module.state_dict(),
            "optimizers": [opt.state_dict() for opt in trainer.optimizers],
        }
        size = snapshot_bytes(states)
        budget = self.max_snapshot_bytes if self.max_snapshot_bytes is not None else host_memory() // 4
        if size > budget:  # the snapshots so far go too (the first one had no optimizer state yet): none to go back to
            self._watch_only = f"a snapshot takes {size / 2**20:.0f} MiB, over the {budget / 2**20:.0f} MiB budget"
            rank_zero_warn(f"TrainingGuard: {self._watch_only}; watching only (a trigger stops the run).")
            self._snapshot, self._first, self._snapshot_size = None, None, size
            return
        snapshot = take_state(trainer)
        snapshot["step"], snapshot["lr_scale"], snapshot["built"] = (
            schedule_step(trainer),
            self._lr_scale,
            trainer.optimizers,
        )
        self._snapshot, self._snapshot_size = snapshot, size
        if first:
            self._first, self._snapshot_s = snapshot, time.perf_counter() - started
            log_rank_zero(trainer, {"speedkit/guard/snapshot_mb": size / 2**20})

    def _stale(self, trainer: pl.Trainer) -> bool:
        """Whether the snapshot is of optimizers since rebuilt (pruning's: its weights no longer fit the module)."""
        return self._snapshot is not None and self._snapshot["built"] != trainer.optimizers

    def _roll_back(self, trainer: pl.Trainer, trigger: str, loss: float) -> None:
        step = schedule_step(trainer)
        if stale := self._stale(trainer):
            self._snapshot = self._first = None
        if self._rollbacks >= self.max_rollbacks or self._snapshot is None:
            why = self._watch_only or f"{self._rollbacks} rollbacks already (max_rollbacks={self.max_rollbacks})"
            why = "the module changed (pruned) since the last snapshot" if stale else why
            kept = "no snapshot to put back: the weights are those of the failed step"
            if self._snapshot is not None:  # leave the model as it was last good, not with the failed step's weights
                self._restore(trainer, self._snapshot)
                kept = f"the weights, optimizer and scheduler states of step {self._snapshot['step']} were put back"
            raise RuntimeError(
                f"TrainingGuard: {trigger} at step {step} (loss {loss:.4g}) and no rollback left: {why}; {kept}."
                " Lower the learning rate, or check the data and the model for the cause."
            )
        snapshot = self._first if trigger == "stalled" and self._first is not None else self._snapshot
        self._restore(trainer, snapshot)
        self._snapshot = snapshot  # after a stall, the stalled run's later snapshot is no state to go back to
        self._rollbacks += 1
        with_lr = ["lr" in group for optimizer in trainer.optimizers for group in optimizer.param_groups]
        new_scale = self._lr_scale * (self.backoff if any(with_lr) else 1.0)  # no LR at all (LR-free): none to back off
        rescale_run_lrs(trainer, new_scale / snapshot["lr_scale"], lengthen_warmup=False)
        self._lr_scale = new_scale
        self._losses.clear()
        self._pending, self._spiked = [], False
        if trigger == "stalled":
            self._start_losses, self._stall_from = [], step
        finite = loss if math.isfinite(loss) else None  # None for NaN/inf: the report stays plain JSON
        self._events.append({"step": step, "trigger": trigger, "loss": finite, "restored_step": snapshot["step"],
                             "lr_scale": new_scale})  # fmt: skip
        lr = f"multiplied the LR by {self.backoff}" if any(with_lr) else "left the LR as it is (no `lr` to scale)"
        lr += "" if all(with_lr) or not any(with_lr) else " (the param groups with no `lr` left as they are)"
        rank_zero_warn(
            f"TrainingGuard: {trigger} at step {step} (loss {loss:.4g}); restored step {snapshot['step']} and {lr}"
            f" (now x{new_scale:.3g}); rollback {self._rollbacks} of {self.max_rollbacks}."
        )
        metrics = {"speedkit/guard/rollbacks": float(self._rollbacks), "speedkit/guard/lr_scale": new_scale}
        log_rank_zero(trainer, metrics, step=step)

    @staticmethod
    def _restore(trainer: pl.Trainer, snapshot: dict[str, Any]) -> None:
        """Put a snapshot's weights, optimizer, scheduler and precision-plugin states back (copies: it may be again)."""
        put_back(trainer, snapshot)
        for optimizer in trainer.optimizers:
            optimizer.zero_grad(set_to_none=True)
        tell_rolled_back(trainer, snapshot["step"])
