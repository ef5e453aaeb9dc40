"""Structured pruning: channel and attention-head removal with torch-pruning, as pure functions and a callback.

``StructuredPruning`` prunes during ``fit`` (by an ``amount``, a MACs ``target_speedup`` or a measured
``target_latency``); ``load_pruned_checkpoint`` loads a pruned run's checkpoint into a fresh module. The functions
in `lightning_speedkit.pruning.surgery` (plan, apply, replay), `lightning_speedkit.pruning.search` (latency, the
ratio search) and `lightning_speedkit.pruning.attention` (heads) work on plain ``nn.Module`` objects.
"""

from lightning_speedkit.pruning.arguments import IMPORTANCES, LATENCY_DEVICES, TARGET_KINDS
from lightning_speedkit.pruning.attention import AttentionLayer, find_attention, update_head_counts
from lightning_speedkit.pruning.callback import StructuredPruning
from lightning_speedkit.pruning.checkpoint import load_pruned_checkpoint
from lightning_speedkit.pruning.search import (
    cpu_latency_ms,
    device_latency_ms,
    latency_speedup,
    search_latency_ratio,
    search_pruning_ratio,
    search_target,
)
from lightning_speedkit.pruning.surgery import (
    History,
    apply_pruning_history,
    channel_step_ratio,
    count_macs_params,
    output_layer_names,
    plan_pruning,
    pruned_copy,
    pruning_history,
    replay_pruning_history,
    unsupported_layer_names,
)

__all__ = [
    "IMPORTANCES",
    "LATENCY_DEVICES",
    "TARGET_KINDS",
    "AttentionLayer",
    "History",
    "StructuredPruning",
    "apply_pruning_history",
    "channel_step_ratio",
    "count_macs_params",
    "cpu_latency_ms",
    "device_latency_ms",
    "find_attention",
    "latency_speedup",
    "load_pruned_checkpoint",
    "output_layer_names",
    "plan_pruning",
    "pruned_copy",
    "pruning_history",
    "replay_pruning_history",
    "search_latency_ratio",
    "search_pruning_ratio",
    "search_target",
    "unsupported_layer_names",
    "update_head_counts",
]
