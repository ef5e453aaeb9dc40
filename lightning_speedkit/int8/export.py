"""`export_int8`: ONNX, static QDQ INT8 calibrated on real batches, verified in ONNX Runtime, written atomically."""

from __future__ import annotations

import itertools
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn

from lightning_speedkit.checks import check_bool, check_choice, check_int, is_int, is_number
from lightning_speedkit.int8.inputs import InputsFromBatch, batch_inputs, feeds, named_inputs
from lightning_speedkit.int8.sensitivity import budget_shortfall, keep_layers_in_fp32, metric_drop
from lightning_speedkit.int8.steps import (
    export_onnx,
    files_of,
    import_export_deps,
    move_into_place,
    opset_of,
    ort_latency_ms,
    ort_session,
    quantize_qdq,
    verify_outputs,
)

if TYPE_CHECKING:
    import numpy as np
    from torchmetrics import Metric

log = logging.getLogger(__name__)

__all__ = [
    "ACTIONS_ON_METRIC_DROP",
    "ACTIVATION_TYPES",
    "Int8VerificationError",
    "check_export_args",
    "drop_message",
    "export_int8",
    "export_paths",
]

ACTIONS_ON_METRIC_DROP = ("raise", "warn")
"""What `export_int8` and `Int8Export` do when the INT8 metric drops more than allowed."""

ACTIVATION_TYPES = ("int8", "uint8")
"""Activation types of the INT8 model; weights are always per-channel symmetric int8."""


class Int8VerificationError(RuntimeError):
    """The INT8 model lost more of the metric than allowed, so nothing was written; ``report`` holds the numbers."""

    def __init__(self, message: str, report: dict[str, Any]) -> None:
        super().__init__(message)
        self.report = report


def _check_batches(name: str, value: object) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``value`` is an iterable of batches (not a string)."""
    if not isinstance(value, Iterable) or isinstance(value, (str, bytes)):
        raise ValueError(f"`{name}` must be an iterable of batches (e.g. a DataLoader), got {value!r}.")


def check_export_args(**values: Any) -> None:
    """Raise ``ValueError`` naming the first argument of `export_int8` / `Int8Export` that is out of range.

    Example:
        >>> check_export_args(calibration_batches=0)
        Traceback (most recent call last):
        ...
        ValueError: `calibration_batches` must be a positive int or None, got 0.
    """
    for name in ("calibration_batches", "verify_batches"):
        check_int(name, values.get(name), optional=True)
    drop = values.get("max_metric_drop")
    if drop is not None and not is_number(drop, 0):
        raise ValueError(f"`max_metric_drop` must be a number >= 0 or None, got {drop!r}.")
    agreement = values.get("min_agreement")
    if agreement is not None and not is_number(agreement, 0, 1, open_low=True):
        raise ValueError(f"`min_agreement` must be a number in (0, 1] or None, got {agreement!r}.")
    check_int("max_fp32_layers", values.get("max_fp32_layers"), low=0, optional=True)
    if values.get("inputs_from_batch") is not None and not callable(values["inputs_from_batch"]):
        raise ValueError(
            f"`inputs_from_batch` must be a function of the batch or None, got {values['inputs_from_batch']!r}."
        )
    check_choice("on_metric_drop", values.get("on_metric_drop", "warn"), ACTIONS_ON_METRIC_DROP)
    for name in ("symmetric", "verify", "keep_fp32", "overwrite"):
        if name in values:
            check_bool(name, values[name])
    activation_type = values.get("activation_type")
    if activation_type is not None and activation_type not in ACTIVATION_TYPES:
        choices = ", ".join(map(repr, ACTIVATION_TYPES))
        raise ValueError(f"`activation_type` must be one of {choices} or None, got {activation_type!r}.")
    if values.get("symmetric") and activation_type == "uint8":
        raise ValueError("`activation_type` must be 'int8' or None with symmetric=True (zero points 0), got 'uint8'.")
    for name, low in (("latency_batch_size", 1), ("latency_repeats", 0), ("num_threads", 0)):
        value = values.get(name, low)
        if not is_int(value, low):
            raise ValueError(f"`{name}` must be an int >= {low}, got {value!r}.")


def export_paths(path: str | os.PathLike[str]) -> dict[str, Path]:
    """The files an export to ``path`` may write, in the order they are moved into place (the report last).

    Example:
        >>> [p.name for p in export_paths("out/model.onnx").values()]
        ['model.fp32.onnx.data', 'model.fp32.onnx', 'model.onnx.data', 'model.onnx', 'model.json']
    """
    int8 = Path(path)
    fp32 = int8.with_name(f"{int8.stem}.fp32.onnx")
    return {
        "fp32_data": fp32.with_name(fp32.name + ".data"),
        "fp32": fp32,
        "int8_data": int8.with_name(int8.name + ".data"),
        "int8": int8,
        "report": int8.with_suffix(".json"),
    }


def _latencies(
    sessions: tuple[Any, Any], sample: Mapping[str, np.ndarray], batch_size: int, repeats: int, threads: int
) -> dict[str, Any] | None:
    if repeats == 0:
        return None
    result: dict[str, Any] = {"threads": threads or os.cpu_count(), "repeats": repeats}
    for batch in sorted({1, batch_size}):
        fp32_ms, int8_ms = (ort_latency_ms(s, sample, batch, repeats) for s in sessions)
        result[f"batch_{batch}"] = {"fp32_ms": fp32_ms, "int8_ms": int8_ms, "speedup": fp32_ms / int8_ms}
    return result


def drop_message(report: Mapping[str, Any]) -> str:
    """What a failed verification says: the metric (or top-1 agreement) for FP32 and INT8 and the bound it missed."""
    v = report["verification"]
    drop, limit = report.get("metric_drop"), report.get("max_metric_drop")
    parts = []
    if drop is not None and limit is not None and drop > limit:
        parts.append(
            f"INT8 {v['metric']} is {v['metric_int8']:.4f} vs FP32 {v['metric_fp32']:.4f} on {v['samples']} samples:"
            f" a drop of {drop:.4f}, more than max_metric_drop={limit}"
        )
    agreement, required = v.get("top1_agreement"), report.get("min_agreement")
    if agreement is not None and required is not None and agreement < required:
        parts.append(f"INT8 top-1 agreement with FP32 is {agreement:.4f}, less than min_agreement={required}")
    kept = report.get("accuracy_aware") or {}
    if kept.get("fp32_layers") is not None:
        parts.append(f"even with {len(kept['fp32_layers'])} layer(s) kept in FP32 (max_fp32_layers={kept['limit']})")
    return "; ".join(parts)


def export_int8(
    model: nn.Module,
    calibration_data: Iterable[Any],
    path: str | os.PathLike[str],
    example_input: torch.Tensor | tuple[torch.Tensor, ...] | Mapping[str, torch.Tensor] | None = None,
    symmetric: bool = False,
    *,
    inputs_from_batch: InputsFromBatch | None = None,
    activation_type: str | None = None,
    calibration_batches: int | None = 32,
    validation_data: Iterable[Any] | None = None,
    metric: Metric | None = None,
    max_metric_drop: float | None = None,
    min_agreement: float | None = None,
    max_fp32_layers: int | None = None,
    on_metric_drop: str = "warn",
    verify: bool = True,
    verify_batches: int | None = None,
    keep_fp32: bool = True,
    overwrite: bool = False,
    latency_batch_size: int = 32,
    latency_repeats: int = 10,
    num_threads: int = 0,
    metadata: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Export ``model`` to ONNX, quantize it to static QDQ INT8 calibrated on real batches, verify it and report.

    Steps: ``eval()``; ``torch.export`` with a dynamic batch axis (and sequence axis: dimension 1 of 2-D and 3-D
    inputs, where the model allows) and the dynamo ONNX exporter (opset 20 in torch 2.13, weights in a ``.data``
    sidecar, inputs named after ``forward``'s parameters); ``quant_pre_process``; ``quantize_static`` in QDQ format
    with per-channel symmetric QInt8 weights and activations MinMax-calibrated on the first ``calibration_batches``
    batches. ``symmetric=True`` makes every zero point 0 with QInt8 activations (TensorRT's rule, S8S8);
    otherwise activations are asymmetric QUInt8 (U8S8), the form ONNX Runtime's x86 kernels fuse and run fast
    (a demo ResNet on an AVX2 CPU: U8S8 3.0x faster than FP32, S8S8 no faster). Both models then run in ONNX Runtime
    on the validation data: max and mean abs difference, top-1 agreement, and ``metric`` (a torchmetrics metric,
    updated with the model's outputs and the batch targets) for FP32 and INT8; without one, top-1 accuracy when
    the targets are class indices. Latency is the median ORT time of each model at batch 1 and
    ``latency_batch_size``.

    Accuracy-aware: when ``max_metric_drop`` or ``min_agreement`` is given and the INT8 model misses it, every
    Conv/Gemm/MatMul node is ranked by how much leaving it alone in FP32 helps (ORT's ``nodes_to_exclude``), and
    the most sensitive are kept in FP32 one at a time until the budget holds or ``max_fp32_layers`` are
    (`lightning_speedkit.int8.sensitivity`). The report's ``accuracy_aware`` lists them and their size and
    latency cost. This costs one quantization and one verification per node: ``verify_batches`` bounds it.

    Everything is written into a temporary directory beside ``path`` and moved into place only when complete:
    ``path`` (INT8), ``<stem>.fp32.onnx`` with its ``.data`` sidecar (if ``keep_fp32``) and ``<stem>.json`` (the
    report). A failure leaves nothing behind and any previous export untouched.

    Args:
        model: The model, batch first; one input or several. Its training mode is restored afterwards.
        calibration_data: Batches, e.g. a ``DataLoader``: tensors, or sequences ``(input, target, ...)``; any form
            with ``inputs_from_batch``.
        path: Where the INT8 model goes; must end in ``.onnx``.
        example_input: Inputs to trace with: a tensor, a tuple (positional) or a dict (by parameter name); default:
            the first calibration batch's inputs. A batch of 1 is doubled.
        symmetric: Symmetric activations too, so that all zero points are 0 (QInt8 activations).
        inputs_from_batch: ``batch -> inputs`` (tensor, tuple or dict, as ``example_input``) for calibration and
            verification; the target is then a sequence batch's last item, or a dict batch's ``labels``/``label``/
            ``targets``/``target``/``y``. Default: a tensor batch, or a sequence batch's first item.
        activation_type: ``"int8"`` or ``"uint8"``; None: ``"int8"`` if ``symmetric`` else ``"uint8"``.
        calibration_batches: How many batches of ``calibration_data`` to calibrate on (None: all).
        validation_data: Batches to verify on (default: the calibration batches).
        metric: A torchmetrics metric to compare (cloned, never synced; its ``higher_is_better`` sets which way
            is a drop).
        max_metric_drop: Allowed drop of the metric (absolute: 0.01 is one point of accuracy); None: no check.
        min_agreement: Required FP32/INT8 top-1 agreement, in (0, 1]; None: no check.
        max_fp32_layers: Most layers accuracy-aware mode may keep in FP32 (None: half the candidates; 0: off).
        on_metric_drop: ``"warn"`` (write, and warn by how much) or ``"raise"`` (write nothing and raise).
        verify: Compare the two models on ``validation_data``; False skips it (sizes and latency still come).
        verify_batches: Verify on at most this many batches (None: all).
        keep_fp32: Keep the FP32 ONNX model too (its size is reported either way).
        overwrite: Replace an existing export at ``path``; otherwise raise ``FileExistsError``.
        latency_batch_size: The larger batch of the latency comparison.
        latency_repeats: Timed runs per model and batch size; 0 skips the latency comparison.
        num_threads: ONNX Runtime intra-op threads (0: all cores).
        metadata: Extra entries for the report (e.g. which checkpoint the weights came from).

    Returns:
        The report, also written as ``<stem>.json``: ``int8_path``, ``fp32_path``, ``report_path``, ``files``,
        ``fp32_bytes`` and ``int8_bytes`` (sidecars included), ``size_ratio`` (FP32 / INT8), ``opset``,
        ``input_names``, ``dynamic_axes``, ``quantization`` (settings), ``latency`` (``batch_<n>``: ``fp32_ms``,
        ``int8_ms``, ``speedup``), ``verification`` (see `lightning_speedkit.int8.steps.verify_outputs`),
        ``metric_drop``, ``accuracy_aware`` (None unless it ran), ``passed`` and library ``versions``.

    Raises:
        ValueError: For a bad argument (the message names it), an ``example_input`` or batch inputs that do not
            match ``forward``'s signature, or data that yields no batch.
        TypeError: For a batch that is neither a tensor nor a sequence starting with one (without
            ``inputs_from_batch``).
        FileExistsError: If a file of the export exists and ``overwrite`` is False.
        RuntimeError: If the model cannot be exported; the message names the operator and the layer.
        Int8VerificationError: If ``on_metric_drop="raise"`` and the budget is missed.
        ImportError: Without the ``export`` extra.

    Example:
        >>> import tempfile
        >>> net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        >>> data = [torch.randn(16, 8) for _ in range(4)]
        >>> report = export_int8(net, data, Path(tempfile.mkdtemp()) / "mlp.onnx", latency_repeats=0)
        >>> report["opset"], report["quantization"]["format"], report["verification"]["samples"], report["input_names"]
        (20, 'QDQ', 64, ['input'])
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"`model` must be a torch.nn.Module, got {model!r}.")
    _check_batches("calibration_data", calibration_data)
    if validation_data is not None:
        _check_batches("validation_data", validation_data)
    check_export_args(
        symmetric=symmetric,
        verify=verify,
        keep_fp32=keep_fp32,
        overwrite=overwrite,
        activation_type=activation_type,
        calibration_batches=calibration_batches,
        max_metric_drop=max_metric_drop,
        min_agreement=min_agreement,
        max_fp32_layers=max_fp32_layers,
        inputs_from_batch=inputs_from_batch,
        on_metric_drop=on_metric_drop,
        verify_batches=verify_batches,
        latency_batch_size=latency_batch_size,
        latency_repeats=latency_repeats,
        num_threads=num_threads,
    )
    if not str(path).endswith(".onnx"):
        raise ValueError(f"`path` must end in '.onnx', got {str(path)!r}.")
    onnx, onnxruntime = import_export_deps()
    targets = export_paths(Path(path).absolute())
    existing = [p for p in targets.values() if p.exists()]
    if existing and not overwrite:
        raise FileExistsError(f"export_int8: {existing[0]} exists; pass overwrite=True to replace that export.")
    calibration = list(itertools.islice(calibration_data, calibration_batches))
    if not calibration:
        raise ValueError("`calibration_data` must yield at least one batch, got none.")
    if example_input is not None:
        example = named_inputs(model, example_input, "example_input")
    else:  # the first batch's inputs: a mismatch is the batches' (or `inputs_from_batch`'s) fault
        source = "inputs_from_batch" if inputs_from_batch is not None else "calibration_data"
        example = named_inputs(model, batch_inputs(calibration[0], inputs_from_batch), source)
    example = {k: v.detach().cpu() for k, v in example.items()}
    arrays = [feed for feed, _ in feeds(model, calibration, example, inputs_from_batch)]
    budget = verify and (max_metric_drop is not None or min_agreement is not None) and max_fp32_layers != 0

    targets["int8"].parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{targets['int8'].name}.tmp-", dir=targets["int8"].parent))
    was_training = model.training
    try:
        fp32, int8 = staging / targets["fp32"].name, staging / targets["int8"].name
        model.eval()
        with torch.no_grad():
            device = next(iter(model.parameters()), torch.empty(0)).device
            layers = export_onnx(model, {k: v.to(device) for k, v in example.items()}, fp32)
        model.train(was_training)
        fp32_session = ort_session(onnxruntime, fp32, num_threads)
        activations = activation_type or ("int8" if symmetric else "uint8")
        settings = quantize_qdq(fp32, int8, arrays, symmetric, activations)
        sessions = (fp32_session, ort_session(onnxruntime, int8, num_threads))
        report: dict[str, Any] = {
            "int8_path": str(targets["int8"]),
            "fp32_path": str(targets["fp32"]) if keep_fp32 else None,
            "report_path": str(targets["report"]),
            "opset": opset_of(onnx, fp32),
            "input_name": fp32_session.get_inputs()[0].name,
            "input_names": [i.name for i in fp32_session.get_inputs()],
            "dynamic_axes": {
                i.name: [axis for axis, d in enumerate(i.shape) if isinstance(d, str)]
                for i in fp32_session.get_inputs()
            },
            "quantization": settings,
            "verification": None,
            "metric_drop": None,
            "max_metric_drop": max_metric_drop,
            "min_agreement": min_agreement,
            "accuracy_aware": None,
            "passed": True,
        }
        if verify:
            batches = calibration if validation_data is None else validation_data
            checked = feeds(model, batches, example, inputs_from_batch, verify_batches)
            validation = list(checked) if budget else checked
            outputs32: list[np.ndarray] = []  # kept for accuracy-aware trials: FP32 runs once
            report["verification"] = verification = verify_outputs(
                sessions, validation, metric, fp32_outputs=outputs32 if budget else None
            )
            if budget and budget_shortfall(verification, max_metric_drop, min_agreement) > 0:

                def quantize(source: Path, out: Path, excluded: list[str]) -> Any:
                    return quantize_qdq(source, out, arrays, symmetric, activations, excluded, preprocessed=True)

                found = keep_layers_in_fp32(
                    fp32,
                    int8,
                    quantize,
                    sessions,
                    validation,  # type: ignore[arg-type]
                    first=verification,
                    sample=arrays[0],
                    fp32_outputs=outputs32,
                    metric=metric,
                    max_layers=max_fp32_layers,
                    max_metric_drop=max_metric_drop,
                    min_agreement=min_agreement,
                    threads=num_threads,
                    latency_repeats=latency_repeats,
                    layers=layers,
                )
                sessions = (fp32_session, ort_session(onnxruntime, int8, num_threads))
                report["verification"] = verification = found.pop("verification")
                report["accuracy_aware"] = found
            report["metric_drop"] = metric_drop(verification)
            report["passed"] = budget_shortfall(verification, max_metric_drop, min_agreement) == 0
        fp32_bytes = sum(p.stat().st_size for p in files_of(fp32))
        int8_bytes = sum(p.stat().st_size for p in files_of(int8))
        report.update(
            files=[p.name for p in files_of(int8) + (files_of(fp32) if keep_fp32 else [])],
            fp32_bytes=fp32_bytes,
            int8_bytes=int8_bytes,
            size_ratio=fp32_bytes / int8_bytes,
            latency=_latencies(sessions, arrays[0], latency_batch_size, latency_repeats, num_threads),
            **dict(metadata or {}),
            versions={"torch": torch.__version__, "onnx": onnx.__version__, "onnxruntime": onnxruntime.__version__},
        )
        del sessions, fp32_session
        (staging / targets["report"].name).write_text(json.dumps(report, indent=2))
        if not report["passed"] and on_metric_drop == "raise":
            raise Int8VerificationError(f"export_int8: {drop_message(report)}; nothing was written.", report)
        kept = [key for key in targets if keep_fp32 or not key.startswith("fp32")]
        staged = {staging / targets[k].name: targets[k] for k in kept if (staging / targets[k].name).is_file()}
        move_into_place(staged, list(targets.values()))
    finally:
        model.train(was_training)
        shutil.rmtree(staging, ignore_errors=True)
    if not report["passed"]:
        rank_zero_warn(f"export_int8: {drop_message(report)}.")
    log.info("export_int8: wrote %s (%.1fx smaller than FP32)", targets["int8"], report["size_ratio"])
    return report
