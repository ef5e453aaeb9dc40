"""Trials: real training steps under a candidate setting inside a running fit, with everything put back afterwards.

This is the one way speedkit decides anything about speed. A `TrialSession` snapshots the model, optimizers,
schedulers, precision plugin, fit-loop progress, RNG streams and the train loader's generators; each `TrialSession.run`
applies a `Setting` (a batch size, loader settings, a memory format, a precision, an LR schedule), trains k real
steps through the Trainer's own loops (data loading included, exactly as the loop does it; precision, DDP and the
user's hooks behave as in training), reverts the setting and restores the snapshot, so every trial starts from the
same state and sees the same batches (trials that differ only in what the steps do, an LR, fetch them once and
replay copies: `lightning_speedkit.trials.replay`). Each trial ends with a verdict all ranks agree on (an
out-of-memory error on any rank fails it on every rank) and rank zero's timings and losses broadcast to all, so
every rank decides alike.

When to probe, and what to keep, is decided by the pure rules of `lightning_speedkit.decisions`. Every lever's life
cycle (its decision, checkpoint, resume rule, logging and report) is `Lever`, its record `Decision`.
"""

from lightning_speedkit.trials.lever import SOURCES, Decision, Lever
from lightning_speedkit.trials.measure import PROBE_ROUNDS, measure, probe_cost, steps_left
from lightning_speedkit.trials.session import TrialSession
from lightning_speedkit.trials.settings import AsIs, BatchSize, LeaveOut, Setting, TrialResult, loss_of

__all__ = [
    "PROBE_ROUNDS",
    "SOURCES",
    "AsIs",
    "BatchSize",
    "Decision",
    "LeaveOut",
    "Lever",
    "Setting",
    "TrialResult",
    "TrialSession",
    "loss_of",
    "measure",
    "probe_cost",
    "steps_left",
]
