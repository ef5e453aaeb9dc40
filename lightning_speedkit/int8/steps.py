"""The steps of an INT8 export, each a plain function: ONNX export, pre-processing, QDQ quantization, ORT checks.

`lightning_speedkit.int8.export_int8` chains them; they are public so that a pipeline can reuse one step. The ONNX
step lives in `lightning_speedkit.int8.to_onnx`, the inputs in `lightning_speedkit.int8.inputs` and the switch into
place in `lightning_speedkit.int8.place`.
"""

from __future__ import annotations

import logging
import types
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from lightning_speedkit.int8.formats import Int8Format
from lightning_speedkit.int8.ties import untie_weights
from lightning_speedkit.int8.to_onnx import EXTERNAL_DATA_BYTES, describe_failure, export_onnx, files_of
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


def preprocess(fp32: Path, out: Path) -> dict[str, Any]:
    """ONNX Runtime's ``quant_pre_process`` (shape inference, graph clean-up) of ``fp32`` into ``out``.

    ORT's symbolic shape inference cannot finish some graphs ("Incomplete symbolic shape inference": a position-id
    buffer sliced to the sequence length, as in Hugging Face's BERT, gives ``Min(512, sequence)`` where the rest of
    the graph has ``sequence``). Then it runs again with ``skip_symbolic_shape=True`` (ONNX's own shape inference
    only), and the file ORT dumps into the current directory on that failure is removed.

    Returns:
        ``symbolic_shape_inference``: ``"done"`` or ``"skipped"``, and ``fallback_reason`` (None, or why).
    """
    from onnxruntime.quantization import quant_pre_process

    large = sum(p.stat().st_size for p in files_of(fp32)) > EXTERNAL_DATA_BYTES
    dump = Path(_ORT_SYMBOLIC_DUMP).absolute()
    dumped_before = dump.exists()
    with quiet_logger(None):  # ONNX Runtime notes each 1-D weight on the root logger
        try:
            quant_pre_process(str(fp32), str(out), save_as_external_data=large)
        except Exception as error:
            if not _raised_in_symbolic_shape_inference(error):
                raise
            if not dumped_before:
                _remove_onnx_files(dump)
            for path in files_of(out):
                path.unlink()
            reason = f"{type(error).__name__}: {_first_line(error)}"
            log.info("INT8 export: ORT's symbolic shape inference failed (%s); pre-processing without it", reason)
            # ORT's optimizer output points at the input's sidecar unless it writes its own (external data here)
            quant_pre_process(
                str(fp32),
                str(out),
                skip_symbolic_shape=True,
                save_as_external_data=True,
                external_data_location=out.name + ".data",
            )
            return {"symbolic_shape_inference": "skipped", "fallback_reason": reason, "untied": untie_weights(out)}
    return {"symbolic_shape_inference": "done", "fallback_reason": None, "untied": untie_weights(out)}


def runs_once(session: Any, feed: Mapping[str, np.ndarray]) -> None:
    """Run a quantized model once on a calibration batch: one ONNX Runtime cannot run is never written.

    Raises:
        RuntimeError: Naming ONNX Runtime's error, when the run fails.
    """
    try:
        session.run(None, dict(feed))
    except Exception as error:
        raise RuntimeError(
            f"Int8Export: ONNX Runtime cannot run the INT8 model it quantized ({type(error).__name__}:"
            f" {_first_line(error)[:300]}); nothing was written: its quantizer made a graph it cannot run for this"
            " model (the FP32 export itself ran)."
        ) from error


_ORT_SYMBOLIC_DUMP = "sym_shape_infer_temp.onnx"  # where ORT saves the half-inferred model, in the current directory


def _raised_in_symbolic_shape_inference(error: BaseException) -> bool:
    """Whether ``error`` was raised inside ORT's symbolic shape inference (``symbolic_shape_infer.py``)."""
    tb = error.__traceback__
    while tb is not None:
        if Path(tb.tb_frame.f_code.co_filename).name == "symbolic_shape_infer.py":
            return True
        tb = tb.tb_next
    return False


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else ""


def _remove_onnx_files(path: Path) -> None:
    """Remove the ONNX model at ``path`` and the external-data files it names (those beside it), if they exist."""
    import onnx

    if not path.is_file():
        return
    try:
        model = onnx.load(str(path), load_external_data=False)
        names = {
            entry.value
            for tensor in model.graph.initializer
            for entry in tensor.external_data
            if entry.key == "location"
        }
    except Exception:  # a damaged dump: remove the model file alone
        names = set()
    for name in names:
        candidate = path.parent / name
        if candidate.parent == path.parent and candidate.is_file():
            candidate.unlink()
    path.unlink()


def quantize_qdq(
    pre: Path,
    out: Path,
    feeds: Sequence[Mapping[str, np.ndarray]],
    fmt: Int8Format,
    symmetric: bool,
    nodes_to_exclude: Sequence[str] = (),
) -> dict[str, Any]:
    """Static QDQ of the pre-processed model ``pre`` (see `preprocess`): per-channel weights, MinMax activations.

    Args:
        pre: The FP32 ONNX model after `preprocess` (with its sidecar beside it).
        out: Where the INT8 model goes.
        feeds: Calibration inputs, one ``{input name: array}`` per batch.
        fmt: Activation and weight types and ``reduce_range`` (see `lightning_speedkit.int8.formats.int8_format`).
        symmetric: Symmetric activations too, so that every zero point is 0 (TensorRT's rule; needs int8).
        nodes_to_exclude: ONNX node names left in FP32 (their weights and their own computation).

    Returns:
        The quantization settings, for the report.
    """
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static

    if isinstance(nodes_to_exclude, str):
        raise ValueError(f"`nodes_to_exclude` must be a sequence of node names, got {nodes_to_exclude!r}.")
    types = {"int8": QuantType.QInt8, "uint8": QuantType.QUInt8}
    large = sum(p.stat().st_size for p in files_of(pre)) > EXTERNAL_DATA_BYTES
    with quiet_logger(None):  # ONNX Runtime notes each 1-D weight on the root logger
        quantize_static(
            str(pre),
            str(out),
            _Reader(feeds),
            quant_format=QuantFormat.QDQ,
            per_channel=True,
            reduce_range=fmt.reduce_range,
            activation_type=types[fmt.activation_type],
            weight_type=types[fmt.weight_type],
            calibrate_method=CalibrationMethod.MinMax,
            use_external_data_format=large,
            nodes_to_exclude=list(nodes_to_exclude),
            extra_options={"ActivationSymmetric": symmetric, "WeightSymmetric": True},
        )
    return {
        "format": "QDQ",
        "per_channel": True,
        **fmt.settings(),
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
        abs FP32 output), ``top1_agreement`` (None unless the output is ``(batch, classes)`` with two classes or
        more: one column, a binary logit or a regression, has no argmax to compare), ``metric`` (the metric's class
        name; ``"top1_accuracy"`` without a metric when targets are class indices; None without
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
        if out32.ndim == 2 and out32.shape[1] > 1:  # one column (a binary logit, a regression): no argmax to compare
            top32, top8 = out32.argmax(-1), out8.argmax(-1)
            agree, classified = agree + int((top32 == top8).sum()), classified + len(out32)
            if isinstance(target, torch.Tensor) and not target.is_floating_point() and target.numel() == len(top32):
                labels = target.cpu().numpy().reshape(top32.shape)
                correct32, correct8 = correct32 + int((top32 == labels).sum()), correct8 + int((top8 == labels).sum())
                labelled += len(labels)
        if metrics is not None and target is not None:
            for m, out in zip(metrics, (out32, out8), strict=True):
                _update_metric(m, out, target.cpu() if isinstance(target, torch.Tensor) else target)
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


def _update_metric(metric: Metric, output: np.ndarray, target: Any) -> None:
    """``metric.update`` with the model's output as the module's ``validation_step`` would give it.

    A one-column output (a binary logit, a regression) is ``(batch, 1)`` from the model, and usually squeezed to the
    target's ``(batch,)`` before the metric sees it: so is it here.

    Raises:
        ValueError: Naming ``metric`` and the shapes, when the metric refuses the output.
    """
    prediction = torch.from_numpy(output).float()
    if isinstance(target, torch.Tensor) and prediction.shape == (*target.shape, 1):
        prediction = prediction.squeeze(-1)
    try:
        metric.update(prediction, target)
    except Exception as error:
        shown = tuple(target.shape) if isinstance(target, torch.Tensor) else type(target).__name__
        raise ValueError(
            f"Int8Export: the metric {type(metric).__name__} (`metric`) refused the model's output of shape"
            f" {tuple(prediction.shape)} against targets {shown} ({error}); pass `metric=` a metric that takes the"
            " model's own output."
        ) from error
