"""The steps of an INT8 export, each a plain function: ONNX export, QDQ quantization, ORT checks, atomic moves.

`lightning_speedkit.int8.export_int8` chains them; they are public so that a pipeline can reuse one step. The ONNX
step lives in `lightning_speedkit.int8.to_onnx` and the inputs in `lightning_speedkit.int8.inputs`.
"""

from __future__ import annotations

import logging
import os
import types
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from lightning_speedkit.int8.to_onnx import describe_failure, export_onnx
from lightning_speedkit.report import quiet_logger
from lightning_speedkit.timing import median_ms

if TYPE_CHECKING:
    from torchmetrics import Metric

log = logging.getLogger(__name__)

__all__ = [
    "EXPORT_EXTRA",
    "describe_failure",
    "export_onnx",
    "files_of",
    "import_export_deps",
    "move_into_place",
    "opset_of",
    "ort_latency_ms",
    "ort_session",
    "preprocess",
    "quantize_qdq",
    "split_batch",
    "verify_outputs",
]

EXPORT_EXTRA = 'pip install "lightning-speedkit[export]"'
"""How to install what the INT8 export needs (onnx, onnxruntime, onnxscript)."""

_EXTERNAL_DATA_BYTES = 1_500_000_000  # protobuf's 2 GB limit, with room: larger models keep their weights in a sidecar


def import_export_deps() -> tuple[types.ModuleType, types.ModuleType]:
    """``(onnx, onnxruntime)``, or an ``ImportError`` that names the extra to install."""
    try:
        import onnx
        import onnxruntime
        import onnxscript  # noqa: F401  (the dynamo exporter needs it)
    except ImportError as error:
        raise ImportError(f"INT8 export needs onnx, onnxruntime and onnxscript: {EXPORT_EXTRA}") from error
    return onnx, onnxruntime


def split_batch(batch: Any) -> tuple[torch.Tensor, Any]:
    """``(input, target or None)`` of a batch: a tensor, or a sequence whose first item is the input tensor.

    Example:
        >>> x, y = split_batch((torch.zeros(2, 3), torch.tensor([0, 1])))
        >>> tuple(x.shape), y.tolist()
        ((2, 3), [0, 1])
    """
    if isinstance(batch, torch.Tensor):
        return batch, None
    if isinstance(batch, Sequence) and len(batch) > 0 and isinstance(batch[0], torch.Tensor):
        return batch[0], batch[1] if len(batch) > 1 else None
    raise TypeError(
        "INT8 export takes batches that are a tensor or a sequence (input, target, ...) with a tensor input,"
        f" got {type(batch).__name__}."
    )


def files_of(model_path: Path) -> list[Path]:
    """A model file and its external-data sidecar (``<name>.data``), those that exist."""
    return [p for p in (model_path, model_path.with_name(model_path.name + ".data")) if p.is_file()]


def opset_of(onnx: Any, path: Path) -> int | None:
    """The default-domain opset of the ONNX model at ``path`` (its weights are not loaded)."""
    model = onnx.load(str(path), load_external_data=False)
    return next((int(o.version) for o in model.opset_import if o.domain in ("", "ai.onnx")), None)


class _Reader:
    """An ONNX Runtime ``CalibrationDataReader`` over a list of feeds (``{input name: array}``).

    Duck-typed: onnxruntime's ``CalibrationDataReader`` ABC accepts any class with ``get_next``, and onnxruntime
    stays an import inside the functions that use it.
    """

    def __init__(self, feeds: Sequence[Mapping[str, np.ndarray]]) -> None:
        self._items = iter([dict(feed) for feed in feeds])

    def get_next(self) -> dict[str, np.ndarray] | None:
        return next(self._items, None)


def preprocess(fp32: Path, out: Path) -> None:
    """ONNX Runtime's ``quant_pre_process`` (shape inference, graph clean-up) of ``fp32`` into ``out``."""
    from onnxruntime.quantization import quant_pre_process

    large = sum(p.stat().st_size for p in files_of(fp32)) > _EXTERNAL_DATA_BYTES
    with quiet_logger(None):  # ONNX Runtime notes each 1-D weight on the root logger
        quant_pre_process(str(fp32), str(out), save_as_external_data=large)


def quantize_qdq(
    fp32: Path,
    out: Path,
    feeds: Sequence[Mapping[str, np.ndarray]],
    symmetric: bool,
    activation_type: str = "int8",
    nodes_to_exclude: Sequence[str] = (),
    preprocessed: bool = False,
) -> dict[str, Any]:
    """``quant_pre_process``, then static QDQ: per-channel symmetric int8 weights, MinMax-calibrated activations.

    Args:
        fp32: The FP32 ONNX model (with its sidecar beside it).
        out: Where the INT8 model goes; the pre-processed model is written beside it and removed.
        feeds: Calibration inputs, one ``{input name: array}`` per batch.
        symmetric: Symmetric activations too, so that every zero point is 0 (TensorRT's rule; needs ``"int8"``).
        activation_type: ``"int8"`` (QInt8) or ``"uint8"`` (QUInt8, ORT's fast U8S8 kernels on x86).
        nodes_to_exclude: ONNX node names left in FP32 (their weights and their own computation).
        preprocessed: ``fp32`` has been through `preprocess` already.

    Returns:
        The quantization settings, for the report.
    """
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static

    large = sum(p.stat().st_size for p in files_of(fp32)) > _EXTERNAL_DATA_BYTES
    pre = fp32 if preprocessed else out.with_name(".pre-" + out.name)
    if not preprocessed:
        preprocess(fp32, pre)
    with quiet_logger(None):  # ONNX Runtime notes each 1-D weight on the root logger
        quantize_static(
            str(pre),
            str(out),
            _Reader(feeds),
            quant_format=QuantFormat.QDQ,
            per_channel=True,
            activation_type=QuantType.QInt8 if activation_type == "int8" else QuantType.QUInt8,
            weight_type=QuantType.QInt8,
            calibrate_method=CalibrationMethod.MinMax,
            use_external_data_format=large,
            nodes_to_exclude=list(nodes_to_exclude),
            extra_options={"ActivationSymmetric": symmetric, "WeightSymmetric": True},
        )
    if not preprocessed:
        for path in files_of(pre):
            path.unlink()
    return {
        "format": "QDQ",
        "per_channel": True,
        "activation_type": "QInt8" if activation_type == "int8" else "QUInt8",
        "weight_type": "QInt8",
        "calibrate_method": "MinMax",
        "activation_symmetric": symmetric,
        "weight_symmetric": True,
        "calibration_batches": len(feeds),
        "calibration_samples": sum(len(next(iter(feed.values()))) for feed in feeds),
    }


def ort_session(onnxruntime: Any, path: Path, threads: int = 0) -> Any:
    """A CPU ONNX Runtime session with ``threads`` intra-op threads (0: all cores), quiet."""
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = threads
    options.log_severity_level = 3
    return onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def ort_latency_ms(session: Any, feed: Mapping[str, np.ndarray], batch_size: int, repeats: int) -> float:
    """Median wall time in ms of ``repeats`` runs on ``batch_size`` copies of each input's first sample (2 warm-ups)."""
    inputs = {name: np.ascontiguousarray(np.repeat(array[:1], batch_size, axis=0)) for name, array in feed.items()}
    return median_ms(lambda: session.run(None, inputs), repeats, warmup=2)


def _metric_copy(metric: Metric) -> Metric:
    copy = metric.clone().cpu()
    copy.reset()
    copy.sync_on_compute = False  # only one rank verifies: never wait for the others
    return copy


def verify_outputs(
    sessions: tuple[Any, Any],
    feeds: Iterable[tuple[Mapping[str, np.ndarray], Any]],
    metric: Metric | None = None,
    max_batches: int | None = None,
    fp32_outputs: list[np.ndarray] | None = None,
) -> dict[str, Any]:
    """Run an FP32 and an INT8 session on ``(feed, target)`` pairs and compare their first outputs and their metric.

    ``fp32_outputs``, if given, caches the FP32 outputs: filled when empty, reused (FP32 not run again) when not.

    Returns:
        ``samples``, ``max_abs_diff``, ``mean_abs_diff``, ``relative_error`` (summed abs difference over summed
        abs FP32 output), ``top1_agreement`` (None unless the output is ``(batch, classes)``), ``metric`` (the
        metric's class name; ``"top1_accuracy"`` without a metric when targets are class indices; None without
        targets), ``metric_fp32``, ``metric_int8`` and ``higher_is_better``.

    Raises:
        ValueError: If ``feeds`` yields nothing.
    """
    metrics = None if metric is None else (_metric_copy(metric), _metric_copy(metric))
    cached = fp32_outputs is not None and len(fp32_outputs) > 0
    samples = agree = classified = correct32 = correct8 = labelled = count = 0
    max_diff = sum_diff = sum_abs = 0.0
    for index, (feed, target) in enumerate(feeds):
        if max_batches is not None and index >= max_batches:
            break
        if cached:
            out32 = fp32_outputs[index]  # type: ignore[index]
        else:
            out32 = np.asarray(sessions[0].run(None, dict(feed))[0], dtype=np.float64)
            if fp32_outputs is not None:
                fp32_outputs.append(out32)
        out8 = np.asarray(sessions[1].run(None, dict(feed))[0], dtype=np.float64)
        diff = np.abs(out32 - out8)
        max_diff = max(max_diff, float(diff.max(initial=0.0)))
        sum_diff, sum_abs, count = sum_diff + float(diff.sum()), sum_abs + float(np.abs(out32).sum()), count + diff.size
        samples += len(out32)
        if out32.ndim == 2:
            top32, top8 = out32.argmax(-1), out8.argmax(-1)
            agree, classified = agree + int((top32 == top8).sum()), classified + len(out32)
            if isinstance(target, torch.Tensor) and not target.is_floating_point() and target.numel() == len(top32):
                labels = target.cpu().numpy().reshape(top32.shape)
                correct32, correct8 = correct32 + int((top32 == labels).sum()), correct8 + int((top8 == labels).sum())
                labelled += len(labels)
        if metrics is not None and target is not None:
            for m, out in zip(metrics, (out32, out8), strict=True):
                m.update(torch.from_numpy(out).float(), target.cpu() if isinstance(target, torch.Tensor) else target)
    if samples == 0:
        raise ValueError("INT8 export: the validation data yielded no batch to verify on.")
    result: dict[str, Any] = {
        "samples": samples,
        "max_abs_diff": max_diff,
        "mean_abs_diff": sum_diff / max(1, count),
        "relative_error": sum_diff / sum_abs if sum_abs else 0.0,
        "top1_agreement": agree / classified if classified else None,
        "metric": None,
        "metric_fp32": None,
        "metric_int8": None,
        "higher_is_better": True,
    }
    if metrics is not None and metrics[0].update_count > 0:
        result["metric"] = type(metric).__name__
        result["metric_fp32"], result["metric_int8"] = (float(m.compute()) for m in metrics)
        result["higher_is_better"] = getattr(metric, "higher_is_better", None) is not False
    elif labelled:
        result.update(metric="top1_accuracy", metric_fp32=correct32 / labelled, metric_int8=correct8 / labelled)
    return result


def move_into_place(staged: Mapping[Path, Path], owned: Sequence[Path]) -> None:
    """Move staged files (source -> target, in order) into place, replacing the previous export in ``owned``.

    Put sidecars before the models that reference them and the report last. Files of the previous export that the
    new one does not write (a sidecar it no longer has) are removed. If any move fails, the new files are removed
    and the previous export is put back, so the targets hold either the old export or the new one.
    """
    backup = next(iter(staged)).parent / ".previous"
    backup.mkdir()
    saved: list[tuple[Path, Path]] = []
    moved: list[Path] = []
    try:
        for target in owned:
            if target.exists():
                os.replace(target, backup / target.name)
                saved.append((backup / target.name, target))
        for source, target in staged.items():
            os.replace(source, target)
            moved.append(target)
    except BaseException:
        for target in moved:
            target.unlink(missing_ok=True)
        for source, target in saved:
            os.replace(source, target)
        raise
