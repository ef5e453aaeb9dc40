"""Structured pruning: channel removal with torch-pruning, as pure functions and a Lightning callback.

``StructuredPruning`` prunes during ``fit``; ``load_pruned_checkpoint`` loads a pruned run's checkpoint into a
fresh module. The functions in `lightning_speedkit.pruning.surgery` work on plain ``nn.Module`` objects.
"""

from lightning_speedkit.pruning.callback import StructuredPruning
from lightning_speedkit.pruning.surgery import (
    IMPORTANCES,
    History,
    apply_pruning_history,
    channel_step_ratio,
    count_macs_params,
    cpu_latency_ms,
    load_pruned_checkpoint,
    output_layer_names,
    plan_pruning,
    pruning_history,
    replay_pruning_history,
    search_pruning_ratio,
    unsupported_layer_names,
)

__all__ = [
    "IMPORTANCES",
    "History",
    "StructuredPruning",
    "apply_pruning_history",
    "channel_step_ratio",
    "count_macs_params",
    "cpu_latency_ms",
    "load_pruned_checkpoint",
    "output_layer_names",
    "plan_pruning",
    "pruning_history",
    "replay_pruning_history",
    "search_pruning_ratio",
    "unsupported_layer_names",
]
