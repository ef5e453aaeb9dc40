"""The steps of an INT8 export, each a plain function: ONNX export, QDQ quantization, ORT checks, atomic moves.

`lightning_speedkit.int8.export_int8` chains them; they are public so that a pipeline can reuse one step.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import types
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

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


def _layer_of(model: nn.Module, error: BaseException) -> str | None:
    """The innermost submodule of ``model`` whose ``forward`` was running when ``error`` was raised."""
    names = {id(module): name for name, module in model.named_modules()}
    found: tuple[int, str] | None = None
    seen: set[int] = set()
    pending: list[BaseException | None] = [error]
    while pending:
        exc = pending.pop()
        if exc is None or id(exc) in seen:
            continue
        seen.add(id(exc))
        tb = exc.__traceback__
        while tb is not None:
            owner = tb.tb_frame.f_locals.get("self")
            if id(owner) in names:
                name = names[id(owner)]
                depth = name.count(".") + bool(name)
                if found is None or depth >= found[0]:
                    found = (depth, f"`{name or '<root>'}` ({type(owner).__name__})")
            tb = tb.tb_next
        pending += [exc.__cause__, exc.__context__]
    return None if found is None else found[1]


def _node_layer(program: Any, message: str) -> str | None:
    """The layer that made the FX node named in a dynamo conversion error, from the node's ``nn_module_stack``."""
    match = re.search(r"translating node %(\S+)", message)
    if match is None:
        return None
    for node in program.graph_module.graph.nodes:
        if node.name == match.group(1):
            stack = node.meta.get("nn_module_stack") or {}
            if not stack:
                return f"node `{node.name}`"
            name, kind = list(stack.values())[-1]
            name = re.sub(r"^L\['self'\]\.?", "", str(name)) or "<root>"
            return f"`{name}` ({getattr(kind, '__name__', str(kind).rsplit('.', 1)[-1])})"
    return None


def describe_failure(error: BaseException, model: nn.Module, program: Any = None) -> str:
    """One line naming the operator and the layer where an export failed, and the innermost cause."""
    text = "\n".join(str(e) for e in (error, error.__cause__) if e is not None)
    ops = re.findall(r"OpOverload\(op='([^']+)'", text)
    layer = (_node_layer(program, text) if program is not None else None) or _layer_of(model, error)
    where = " ".join(
        part for part in (f"operator `{ops[0]}`" if ops else "", f"in layer {layer}" if layer else "") if part
    )
    root = error
    while root.__cause__ is not None:
        root = root.__cause__
    lines = str(root).strip().splitlines()
    return f"{where or 'somewhere in the model'}: {type(root).__name__}: {lines[0] if lines else ''}"


@contextlib.contextmanager
def _quiet_exporter() -> Iterator[None]:
    """Silence the exporter's "torchvision is not installed" warnings while it runs."""
    logger = logging.getLogger("torch.onnx._internal.exporter._registration")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def export_onnx(model: nn.Module, example: torch.Tensor, path: Path) -> None:
    """``torch.export`` with a dynamic batch, then the dynamo ONNX exporter (weights go to ``<path>.data``).

    The exporter's per-node debug metadata (stack traces with local file paths, module paths) is dropped: it is
    not needed to run the model and would be ~8% of a small INT8 model.

    The model must already be in ``eval()`` mode; ``example`` needs a batch of at least 2 (torch.export
    specialises a batch of 1 to a constant).

    Raises:
        RuntimeError: If tracing or conversion fails; the message names the operator and the layer.
        OSError: If the model cannot be written (disk full, no permission).
    """
    batch = torch.export.Dim("batch")
    # torch.export first, on its own: its traceback still holds the failing layer's frame, and one non-strict
    # attempt is all we want (torch.onnx.export would retry in strict mode and bury the first error).
    try:
        program = torch.export.export(model, (example,), dynamic_shapes=({0: batch},), strict=False)
    except Exception as error:
        raise RuntimeError(
            "INT8 export: torch.export could not trace the model with a dynamic batch, "
            + describe_failure(error, model)
        ) from error
    try:
        with _quiet_exporter():
            onnx_program = torch.onnx.export(program, (example,), dynamo=True, verbose=False)
        if onnx_program is None:  # only the TorchScript exporter returns None
            raise RuntimeError("torch.onnx.export returned no ONNX program")
        for node in onnx_program.model.graph.all_nodes():
            node.metadata_props.clear()  # debug data: source stack traces and module paths, ~0.5 KB per node
    except Exception as error:
        raise RuntimeError(f"INT8 export: cannot convert to ONNX, {describe_failure(error, model, program)}") from error
    try:
        onnx_program.save(str(path), external_data=True)
    except OSError as error:  # a full or read-only disk: say so, not "cannot convert"
        raise OSError(error.errno, f"INT8 export: cannot write the ONNX model ({error.strerror})", str(path)) from error


class _Reader:
    """An ONNX Runtime ``CalibrationDataReader`` over a list of input arrays.

    Duck-typed: onnxruntime's ``CalibrationDataReader`` ABC accepts any class with ``get_next``, and onnxruntime
    stays an import inside the functions that use it.
    """

    def __init__(self, name: str, arrays: Sequence[np.ndarray]) -> None:
        self._items = iter([{name: array} for array in arrays])

    def get_next(self) -> dict[str, np.ndarray] | None:
        return next(self._items, None)


def quantize_qdq(
    fp32: Path,
    out: Path,
    input_name: str,
    arrays: Sequence[np.ndarray],
    symmetric: bool,
    activation_type: str = "int8",
) -> dict[str, Any]:
    """``quant_pre_process``, then static QDQ: per-channel symmetric int8 weights, MinMax-calibrated activations.

    Args:
        fp32: The FP32 ONNX model (with its sidecar beside it).
        out: Where the INT8 model goes; the pre-processed model is written beside it and removed.
        input_name: The model's input name.
        arrays: Calibration inputs, one array per batch.
        symmetric: Symmetric activations too, so that every zero point is 0 (TensorRT's rule; needs ``"int8"``).
        activation_type: ``"int8"`` (QInt8) or ``"uint8"`` (QUInt8, ORT's fast U8S8 kernels on x86).

    Returns:
        The quantization settings, for the report.
    """
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quant_pre_process, quantize_static

    large = sum(p.stat().st_size for p in files_of(fp32)) > _EXTERNAL_DATA_BYTES
    pre = out.with_name(".pre-" + out.name)
    quant_pre_process(str(fp32), str(pre), save_as_external_data=large)
    quantize_static(
        str(pre),
        str(out),
        _Reader(input_name, arrays),
        quant_format=QuantFormat.QDQ,
        per_channel=True,
        activation_type=QuantType.QInt8 if activation_type == "int8" else QuantType.QUInt8,
        weight_type=QuantType.QInt8,
        calibrate_method=CalibrationMethod.MinMax,
        use_external_data_format=large,
        extra_options={"ActivationSymmetric": symmetric, "WeightSymmetric": True},
    )
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
        "calibration_batches": len(arrays),
        "calibration_samples": sum(len(a) for a in arrays),
    }


def ort_session(onnxruntime: Any, path: Path, threads: int = 0) -> Any:
    """A CPU ONNX Runtime session with ``threads`` intra-op threads (0: all cores), quiet."""
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = threads
    options.log_severity_level = 3
    return onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def ort_latency_ms(session: Any, input_name: str, sample: np.ndarray, batch_size: int, repeats: int) -> float:
    """Median wall time in ms of ``repeats`` runs on ``batch_size`` copies of ``sample[0]``, after 2 warm-up runs."""
    inputs = {input_name: np.ascontiguousarray(np.repeat(sample[:1], batch_size, axis=0))}
    return median_ms(lambda: session.run(None, inputs), repeats, warmup=2)


def _metric_copy(metric: Metric) -> Metric:
    copy = metric.clone().cpu()
    copy.reset()
    copy.sync_on_compute = False  # only one rank verifies: never wait for the others
    return copy


def verify_outputs(
    sessions: tuple[Any, Any],
    input_name: str,
    batches: Iterable[Any],
    metric: Metric | None = None,
    max_batches: int | None = None,
) -> dict[str, Any]:
    """Run an FP32 and an INT8 session on ``batches`` and compare their first outputs and their metric.

    Returns:
        ``samples``, ``max_abs_diff``, ``mean_abs_diff``, ``relative_error`` (summed abs difference over summed
        abs FP32 output), ``top1_agreement`` (None unless the output is ``(batch, classes)``), ``metric`` (the
        metric's class name; ``"top1_accuracy"`` without a metric when targets are class indices; None without
        targets), ``metric_fp32``, ``metric_int8`` and ``higher_is_better``.

    Raises:
        ValueError: If ``batches`` yields nothing.
    """
    metrics = None if metric is None else (_metric_copy(metric), _metric_copy(metric))
    samples = agree = classified = correct32 = correct8 = labelled = count = 0
    max_diff = sum_diff = sum_abs = 0.0
    for index, batch in enumerate(batches):
        if max_batches is not None and index >= max_batches:
            break
        x, target = split_batch(batch)
        array = x.detach().cpu().numpy()
        out32, out8 = (np.asarray(s.run(None, {input_name: array})[0], dtype=np.float64) for s in sessions)
        diff = np.abs(out32 - out8)
        max_diff = max(max_diff, float(diff.max(initial=0.0)))
        sum_diff, sum_abs, count = sum_diff + float(diff.sum()), sum_abs + float(np.abs(out32).sum()), count + diff.size
        samples += len(array)
        if out32.ndim == 2:
            top32, top8 = out32.argmax(-1), out8.argmax(-1)
            agree, classified = agree + int((top32 == top8).sum()), classified + len(array)
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
