"""Trials: real training steps under a candidate setting inside a running fit, with everything put back afterwards.

This is the one way speedkit decides anything about speed. A `TrialSession` snapshots the model, optimizers,
schedulers, precision plugin, fit-loop progress, RNG streams and the train loader's generators; each `TrialSession.run`
applies a `Setting` (a batch size, loader settings, a memory format, a precision, an LR schedule), trains k real
steps through the Trainer's own loops (data loading included, exactly as the loop does it; precision, DDP and the
user's hooks behave as in training), reverts the setting and restores the snapshot, so every trial starts from the
same state and sees the same batches. Each trial ends with a verdict all ranks agree on (an out-of-memory error on
any rank fails it on every rank) and rank zero's timings and losses broadcast to all, so every rank decides alike.

When to probe, and what to keep, is decided by the pure rules of `lightning_speedkit.decisions`.
"""

from lightning_speedkit.trials.measure import (
    PROBE_ROUNDS,
    RemembersDecision,
    decision_summary,
    log_decision,
    measure,
    steps_left,
)
from lightning_speedkit.trials.session import TrialSession
from lightning_speedkit.trials.settings import AsIs, BatchSize, Setting, TrialResult, loss_of

__all__ = [
    "PROBE_ROUNDS",
    "AsIs",
    "BatchSize",
    "RemembersDecision",
    "Setting",
    "TrialResult",
    "TrialSession",
    "decision_summary",
    "log_decision",
    "loss_of",
    "measure",
    "steps_left",
]
