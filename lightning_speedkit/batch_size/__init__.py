"""Batch-size finder: honest trials at fit start on every rank, the LR rescaled to the new global batch.

`search` holds the maths (which size next, which to keep, the LR rule), `trials` the runs inside Lightning's loops,
`finder` the `BatchSizeFinder` callback.
"""

from lightning_speedkit.batch_size.finder import BatchSizeFinder
from lightning_speedkit.batch_size.search import (
    LR_SCALINGS,
    MODES,
    OBJECTIVES,
    Choice,
    apply_margin,
    choose_batch_size,
    hold_global_batch,
    lr_scale_factor,
    next_trial_size,
)
from lightning_speedkit.batch_size.trials import TrialResult, TrialSession

__all__ = [
    "LR_SCALINGS",
    "MODES",
    "OBJECTIVES",
    "BatchSizeFinder",
    "Choice",
    "TrialResult",
    "TrialSession",
    "apply_margin",
    "choose_batch_size",
    "hold_global_batch",
    "lr_scale_factor",
    "next_trial_size",
]
