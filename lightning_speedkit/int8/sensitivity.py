"""Accuracy-aware INT8: when the first INT8 model misses the budget, keep the most sensitive layers in FP32.

Like NNCF's accuracy-aware quantization (which ranks its quantizers), but inside ONNX Runtime and with no other
dependency. The unit is a quantized activation tensor of the INT8 model together with the nodes that make and use
it: leaving those nodes unquantized (ORT's ``nodes_to_exclude``: FP32 weights, FP32 compute) is what keeps that
tensor in FP32, since ORT quantizes a tensor for any quantized node that touches it. Each unit is ranked by how close
to the budget the model comes with that unit alone in FP32; then units are kept in FP32 one at a time, in that
order, until the budget holds or the limit on FP32 layers (nodes) would be passed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from lightning_speedkit.checks import check_int

log = logging.getLogger(__name__)

__all__ = [
    "CANDIDATE_OPS",
    "budget_shortfall",
    "candidate_nodes",
    "default_fp32_limit",
    "keep_layers_in_fp32",
    "keep_sensitive_layers",
    "metric_drop",
    "quantized_tensors",
]

CANDIDATE_OPS = ("Conv", "ConvTranspose", "Gemm", "MatMul")
"""The layers that count in the default limit on FP32 layers: the ones that carry weights or most of the compute."""

Evaluate = Callable[[list[str]], Mapping[str, Any]]
"""Quantize with these nodes left in FP32 and verify: ``excluded -> verification`` (see ``verify_outputs``)."""

Unit = tuple[str, list[str]]
"""A quantized activation tensor and the nodes (of the pre-processed FP32 model) that make or use it."""


def candidate_nodes(onnx: Any, path: Path) -> list[str]:
    """Names of the `CANDIDATE_OPS` nodes of the ONNX model at ``path``, in graph order (weights not loaded)."""
    model = onnx.load(str(path), load_external_data=False)
    return [node.name for node in model.graph.node if node.op_type in CANDIDATE_OPS and node.name]


def quantized_tensors(onnx: Any, int8: Path, fp32: Path) -> list[Unit]:
    """The activation tensors ``int8`` quantizes, each with the nodes of ``fp32`` that make or use it.

    ``fp32`` is the pre-processed model ``int8`` was quantized from (same node and tensor names). A graph output
    that ORT renamed to ``<name>_QuantizeLinear_Input`` is matched to ``<name>``.
    """
    qdq = onnx.load(str(int8), load_external_data=False)
    weights = {init.name for init in qdq.graph.initializer}
    model = onnx.load(str(fp32), load_external_data=False)
    touching: dict[str, list[str]] = {}
    for node in model.graph.node:
        for tensor in [*node.input, *node.output]:
            if tensor and node.name and node.name not in touching.setdefault(tensor, []):
                touching[tensor].append(node.name)
    units: list[Unit] = []
    for node in qdq.graph.node:
        tensor = node.input[0] if node.op_type == "QuantizeLinear" and node.input else ""
        tensor = tensor.removesuffix("_QuantizeLinear_Input") if tensor not in touching else tensor
        if tensor and tensor not in weights and touching.get(tensor) and tensor not in dict(units):
            units.append((tensor, touching[tensor]))
    return units


def default_fp32_limit(candidates: int) -> int:
    """At most half of the candidate layers stay in FP32 by default (at least one): past that it is not INT8.

    Example:
        >>> [default_fp32_limit(n) for n in (1, 2, 9, 40)]
        [1, 1, 4, 20]
    """
    return max(1, candidates // 2)


def metric_drop(verification: Mapping[str, Any]) -> float | None:
    """How much the metric fell from FP32 to INT8 (its ``higher_is_better`` sets which way is a fall), or None.

    Example:
        >>> round(metric_drop({"metric_fp32": 0.9, "metric_int8": 0.85, "higher_is_better": True}), 4)
        0.05
    """
    fp32, int8 = verification.get("metric_fp32"), verification.get("metric_int8")
    if fp32 is None or int8 is None:
        return None
    return float(fp32 - int8) if verification.get("higher_is_better", True) else float(int8 - fp32)


def budget_shortfall(
    verification: Mapping[str, Any], max_metric_drop: float | None, min_agreement: float | None
) -> float:
    """How far a verification misses the budget; 0 when it holds.

    The metric drop beyond ``max_metric_drop`` plus the top-1 agreement below ``min_agreement``; a bound that
    cannot be measured (no metric, no class output) is not counted.

    Example:
        >>> round(budget_shortfall({"metric_fp32": 0.9, "metric_int8": 0.86, "top1_agreement": 0.9}, 0.01, 0.95), 4)
        0.08
    """
    shortfall = 0.0
    drop = metric_drop(verification)
    if max_metric_drop is not None and drop is not None:
        shortfall += max(0.0, drop - max_metric_drop)
    agreement = verification.get("top1_agreement")
    if min_agreement is not None and agreement is not None:
        shortfall += max(0.0, min_agreement - agreement)
    return shortfall


def keep_sensitive_layers(
    evaluate: Evaluate,
    units: Sequence[Unit],
    first: Mapping[str, Any],
    max_layers: int,
    max_metric_drop: float | None = None,
    min_agreement: float | None = None,
) -> dict[str, Any]:
    """Keep the fewest, most sensitive ``units`` in FP32 so that the budget holds.

    Args:
        evaluate: Quantizes with the given nodes in FP32 and verifies (one quantization and one run per call).
        units: ``(tensor, nodes)`` that may stay in FP32 (see `quantized_tensors`).
        first: The verification of the model with everything in INT8.
        max_layers: Most nodes kept in FP32 in all.
        max_metric_drop: Allowed metric drop (None: not checked).
        min_agreement: Required top-1 agreement with FP32 (None: not checked).

    Returns:
        ``fp32_layers`` (node names, in the order they were kept), ``fp32_tensors``, ``verification`` (of that
        model), ``met`` (the budget holds), ``ranking`` (each unit's ``tensor``, ``nodes``, ``shortfall`` and
        ``relative_error`` alone in FP32, most sensitive first) and ``trials`` (quantizations run). If the budget is
        never met, the state closest to it.

    Example:
        >>> gain = {"a": 0.2, "b": 0.01, "c": 0.1}
        >>> evaluate = lambda kept: {"top1_agreement": 0.8 + sum(gain[n] for n in kept), "relative_error": 0.1}
        >>> units = [("t1", ["a", "b"]), ("t2", ["c"])]
        >>> result = keep_sensitive_layers(evaluate, units, evaluate([]), 2, min_agreement=0.9)
        >>> result["fp32_layers"], result["fp32_tensors"], result["met"], result["trials"]
        (['c'], ['t2'], True, 2)
    """
    if not callable(evaluate):
        raise ValueError(f"`evaluate` must be a function of the nodes kept in FP32, got {evaluate!r}.")
    if isinstance(units, (str, bytes)) or not all(
        isinstance(u, (tuple, list)) and len(u) == 2 and isinstance(u[0], str) for u in units
    ):
        raise ValueError(f"`units` must be a sequence of (tensor name, node names) pairs, got {units!r}.")
    check_int("max_layers", max_layers, low=0)

    def score(verification: Mapping[str, Any]) -> tuple[float, float]:
        return budget_shortfall(verification, max_metric_drop, min_agreement), verification.get("relative_error", 0.0)

    nodes = dict(units)
    alone = {tensor: evaluate(list(nodes[tensor])) for tensor in nodes if len(nodes[tensor]) <= max_layers}
    order = sorted(alone, key=lambda tensor: (score(alone[tensor]), len(nodes[tensor])))
    ranking = [
        {"tensor": t, "nodes": nodes[t], "shortfall": score(alone[t])[0], "relative_error": score(alone[t])[1]}
        for t in order
    ]
    best: tuple[tuple[float, int], list[str], list[str], Mapping[str, Any]] = ((score(first)[0], 0), [], [], first)
    trials, kept, tensors = len(alone), list[str](), list[str]()
    for tensor in order:
        added = [node for node in nodes[tensor] if node not in kept]
        if not added or len(kept) + len(added) > max_layers:
            continue
        kept, tensors = kept + added, [*tensors, tensor]
        if len(tensors) == 1 and kept == nodes[tensor]:
            verification = alone[tensor]
        else:
            verification = evaluate(list(kept))
            trials += 1
        state = ((score(verification)[0], len(kept)), list(kept), list(tensors), verification)
        best = min(best, state, key=lambda s: s[0])
        if state[0][0] == 0.0:
            break
    log.info("accuracy-aware INT8: %d node(s) in FP32 after %d quantizations", len(best[1]), trials)
    return {
        "fp32_layers": best[1],
        "fp32_tensors": best[2],
        "verification": dict(best[3]),
        "met": best[0][0] == 0.0,
        "ranking": ranking,
        "trials": trials,
    }


def keep_layers_in_fp32(
    pre: Path,
    int8: Path,
    quantize: Callable[[Path, Path, list[str]], Any],
    sessions: tuple[Any, Any],
    validation: Sequence[tuple[Mapping[str, Any], Any]],
    *,
    first: Mapping[str, Any],
    sample: Mapping[str, Any],
    fp32_outputs: list[Any],
    metric: Any = None,
    max_layers: int | None = None,
    max_metric_drop: float | None = None,
    min_agreement: float | None = None,
    threads: int = 0,
    latency_repeats: int = 10,
    layers: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Accuracy-aware INT8 on files: `keep_sensitive_layers`, then ``int8`` quantized again with them in FP32.

    Args:
        pre: The FP32 ONNX model after `lightning_speedkit.int8.steps.preprocess` (``int8`` was quantized from it).
        int8: The all-INT8 model, replaced by the result when layers are kept in FP32.
        quantize: ``(pre-processed FP32 path, out path, nodes to exclude) -> settings``, calibrated as ``int8`` was.
        sessions: ONNX Runtime sessions of ``fp32`` and ``int8``.
        validation: The verification feeds and targets (a list: it is run once per trial).
        first: The verification of ``int8``.
        sample: A feed for the latency comparison (batch 1).
        fp32_outputs: The FP32 outputs on ``validation``, as ``verify_outputs`` caches them (filled if empty).
        metric: The torchmetrics metric of the verification, if any.
        max_layers: Most layers (nodes) kept in FP32 (None: `default_fp32_limit` of the Conv/Gemm/MatMul count).
        max_metric_drop: Allowed metric drop.
        min_agreement: Required top-1 agreement.
        threads: ONNX Runtime intra-op threads.
        latency_repeats: Timed runs for the latency cost (0: not measured).
        layers: ONNX node name -> the module it came from, for the report.

    Returns:
        ``fp32_layers`` (``node``, ``op``, ``layer``), ``fp32_tensors``, ``ranking`` (the ten most sensitive
        units), ``limit``, ``candidates`` (units ranked), ``met``, ``trials``, ``verification`` (of the final
        model), ``all_int8`` (``int8_bytes``, ``latency_ms_b1``, ``top1_agreement``, ``metric_drop`` of the first
        model) and ``cost`` (``int8_bytes`` and ``latency_ms_b1`` added by keeping those layers in FP32).
    """
    import onnx
    import onnxruntime

    from lightning_speedkit.int8.steps import files_of, ort_latency_ms, ort_session, verify_outputs

    trial = int8.with_name(".sensitivity-trial.onnx")
    ops = {n.name: n.op_type for n in onnx.load(str(pre), load_external_data=False).graph.node}
    units = quantized_tensors(onnx, int8, pre)
    limit = default_fp32_limit(len(candidate_nodes(onnx, pre))) if max_layers is None else max_layers
    outputs32 = fp32_outputs

    def evaluate(excluded: list[str]) -> Mapping[str, Any]:
        quantize(pre, trial, excluded)
        session = ort_session(onnxruntime, trial, threads)
        return verify_outputs((sessions[0], session), validation, metric, fp32_outputs=outputs32)

    def cost() -> tuple[int, float | None]:
        session = ort_session(onnxruntime, int8, threads)
        latency = ort_latency_ms(session, sample, 1, latency_repeats) if latency_repeats else None
        return sum(p.stat().st_size for p in files_of(int8)), latency

    before = cost()
    result = keep_sensitive_layers(evaluate, units, first, limit, max_metric_drop, min_agreement)
    if result["fp32_layers"]:
        quantize(pre, int8, result["fp32_layers"])
    after = cost()
    for path in files_of(trial):
        path.unlink()
    return {
        "fp32_layers": [{"node": n, "op": ops.get(n), "layer": (layers or {}).get(n)} for n in result["fp32_layers"]],
        "fp32_tensors": result["fp32_tensors"],
        "ranking": result["ranking"][:10],
        "limit": limit,
        "candidates": len(units),
        "met": result["met"],
        "trials": result["trials"],
        "verification": result["verification"],
        "all_int8": {
            "int8_bytes": before[0],
            "latency_ms_b1": before[1],
            "top1_agreement": first.get("top1_agreement"),
            "metric_drop": metric_drop(first),
        },
        "cost": {
            "int8_bytes": after[0] - before[0],
            "latency_ms_b1": None if before[1] is None or after[1] is None else after[1] - before[1],
        },
    }
