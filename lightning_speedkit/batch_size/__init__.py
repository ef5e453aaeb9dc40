"""Batch-size finder: honest trials at fit start on every rank, the LR rescaled to the new global batch.

`search` holds the maths (which size next, which to keep, the LR rule), `finder` the `BatchSizeFinder` callback; the
trials run through the foundation's `lightning_speedkit.trials`.
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

__all__ = [
    "LR_SCALINGS",
    "MODES",
    "OBJECTIVES",
    "BatchSizeFinder",
    "Choice",
    "apply_margin",
    "choose_batch_size",
    "hold_global_batch",
    "lr_scale_factor",
    "next_trial_size",
]
