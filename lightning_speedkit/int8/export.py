"""`export_int8`: ONNX, static QDQ INT8 calibrated on real batches, verified in ONNX Runtime, switched in atomically."""

from __future__ import annotations

import itertools
import json
import logging
import os
import platform
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn

from lightning_speedkit.hardware import cpu_info
from lightning_speedkit.int8.args import (
    ACTIONS_ON_METRIC_DROP,
    ACTIVATION_TYPES,
    check_batches,
    check_export_args,
    check_export_path,
    check_metadata,
    check_metric,
)
from lightning_speedkit.int8.formats import int8_format
from lightning_speedkit.int8.inputs import InputsFromBatch, batch_inputs, check_runs, feeds, named_inputs
from lightning_speedkit.int8.place import (
    can_link,
    clean_stale,
    export_exists,
    export_paths,
    sha256_of,
    staging,
    switch_into_place,
    version_dir_of,
)
from lightning_speedkit.int8.report import drop_message, size_words, verdict
from lightning_speedkit.int8.sensitivity import budget_shortfall, keep_layers_in_fp32, metric_drop
from lightning_speedkit.int8.steps import (
    export_onnx,
    files_of,
    import_export_deps,
    opset_of,
    ort_latency_ms,
    ort_session,
    preprocess,
    quantize_qdq,
    runs_once,
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
    "export_int8",
    "export_paths",
]


class Int8VerificationError(RuntimeError):
    """The INT8 model lost more of the metric than allowed, so nothing was written; ``report`` holds the numbers."""

    def __init__(self, message: str, report: dict[str, Any]) -> None:
        super().__init__(message)
        self.report = report


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


def export_int8(
    model: nn.Module,
    calibration_data: Iterable[Any],
    path: str | os.PathLike[str],
    example_input: torch.Tensor | tuple[torch.Tensor, ...] | Mapping[str, torch.Tensor] | None = None,
    symmetric: bool = False,
    *,
    inputs_from_batch: InputsFromBatch | None = None,
    activation_type: str | None = None,
    reduce_range: bool | None = None,
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
    inputs, where the model allows) and the dynamo ONNX exporter (opset 20 in torch 2.13, weights inline up to
    1.5 GB and in a ``.data`` sidecar past that, inputs named after ``forward``'s parameters);
    ``quant_pre_process`` (without symbolic shape inference where ORT's cannot finish the graph:
    `lightning_speedkit.int8.steps.preprocess`); ``quantize_static`` in QDQ format with per-channel symmetric
    weights and activations MinMax-calibrated on the first ``calibration_batches`` batches. The types come from
    the CPU this runs on (`lightning_speedkit.int8.formats.int8_format`, ONNX Runtime's guidance): U8S8 where the
    CPU has VNNI or AMX-INT8; U8S8 with 7-bit weights (``reduce_range``) on x86 without them, where 8-bit products
    can saturate; S8S8 on Arm. ``symmetric=True`` makes every zero point 0 with int8 activations (TensorRT's
    rule); an explicit ``activation_type`` or ``reduce_range`` is kept. Both models then run in ONNX Runtime on the
    validation data: max and mean abs difference, top-1 agreement, and ``metric`` (a torchmetrics metric, updated
    with the model's outputs and the batch targets) for FP32 and INT8; without one, top-1 accuracy when the targets
    are class indices. Latency is the median ORT time of each model at batch 1 and ``latency_batch_size``.

    Accuracy-aware: when ``max_metric_drop`` or ``min_agreement`` is given and the INT8 model misses it, every
    quantized activation tensor is ranked by how much leaving it (and the nodes around it) in FP32 helps (ORT's
    ``nodes_to_exclude``), and the most sensitive are kept in FP32 one at a time until the budget holds or
    ``max_fp32_layers`` nodes are (`lightning_speedkit.int8.sensitivity`). The report's ``accuracy_aware`` lists
    them and their size and latency cost. If the budget still fails, the export has failed: ``passed`` is False,
    ``status`` starts with ``FAILED``, a warning says by how much, and with ``on_metric_drop="raise"`` nothing is
    written.

    The export is one unit (`lightning_speedkit.int8.place`): every file is written into a hidden staging
    directory beside ``path`` and switched into place with one rename when complete: ``path`` (INT8),
    ``<stem>.fp32.onnx`` (if ``keep_fp32``) and ``<stem>.json`` (the report), each a symbolic link through
    ``.<name>.export`` (`lightning_speedkit.int8.place` says how a reader knows an export is complete). A failure,
    or a kill, leaves any previous export complete; what a killed run left is removed by the next export there.

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
            ``targets``/``target``/``y``. Default: a tensor batch, a sequence batch's first item, or a dict batch's
            keys that are ``forward``'s parameters (a target key such as ``labels`` is the target, not an input,
            unless ``forward`` requires it).
        activation_type: ``"int8"`` or ``"uint8"``; None: from the CPU (``"int8"`` if ``symmetric``).
        reduce_range: 7-bit weights (ORT's ``reduce_range``); None: from the CPU.
        calibration_batches: How many batches of ``calibration_data`` to calibrate on (None: all).
        validation_data: Batches to verify on (default: the calibration batches).
        metric: A torchmetrics ``Metric`` to compare (cloned, never synced; its ``higher_is_better`` sets which
            way is a drop), or None.
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
        metadata: Extra entries for the report (e.g. which checkpoint the weights came from): str keys, JSON
            values, none of the report's own keys (`lightning_speedkit.int8.args.REPORT_KEYS`).

    Returns:
        The report, also written as ``<stem>.json``: ``int8_path``, ``fp32_path``, ``report_path``,
        ``version_dir`` (the directory the names resolve into) and ``switch``, ``files`` and ``manifest`` (each
        file's ``bytes`` and ``sha256``),
        ``fp32_bytes`` and ``int8_bytes`` (sidecars included), ``size_ratio`` (FP32 / INT8), ``opset``,
        ``input_names``, ``dynamic_axes``, ``quantization`` (settings: ``int8_format``, ``activation_type``,
        ``weight_type``, ``reduce_range``, ``format_reason``, the ``cpu`` they were chosen for, ...),
        ``preprocess`` (``symbolic_shape_inference``: ``"done"`` or ``"skipped"``, ``fallback_reason``; ``untied``: the
        weights several layers share, each layer given a copy before quantizing, `int8.steps.untie_weights`),
        ``latency`` (``batch_<n>``: ``fp32_ms``, ``int8_ms``, ``speedup``), ``verification`` (see
        `lightning_speedkit.int8.steps.verify_outputs`), ``metric_drop``, ``accuracy_aware`` (None unless it ran),
        ``passed`` (False when the budget was missed), ``status`` (one line, ``FAILED: ...`` then) and ``versions``.

    Raises:
        ValueError: For a bad argument (the message names it and the value), an ``example_input`` or batch inputs
            that do not fit ``forward`` (its signature, or its shapes: the model's own error is quoted), a dict
            batch with no key that is a parameter of ``forward``, or data that yields no batch.
        ExportPathError: A ``ValueError`` and ``NotADirectoryError`` if ``path`` is a directory or lies under a file.
        TypeError: For a batch that is none of a tensor, a sequence starting with one or a dict (without
            ``inputs_from_batch``).
        FileExistsError: If an export exists at ``path`` and ``overwrite`` is False.
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
    check_batches("calibration_data", calibration_data)
    if validation_data is not None:
        check_batches("validation_data", validation_data)
    check_export_args(
        symmetric=symmetric,
        verify=verify,
        keep_fp32=keep_fp32,
        overwrite=overwrite,
        activation_type=activation_type,
        reduce_range=reduce_range,
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
    check_metric(metric)
    check_metadata(metadata)
    target = check_export_path(path)
    onnx, onnxruntime = import_export_deps()
    if example_input is not None:  # before any data is read: a wrong example is named as such
        example = named_inputs(model, example_input, "example_input")
        check_runs(model, example, "example_input", example_input)
    cpu = cpu_info()
    fmt = int8_format(cpu, symmetric, activation_type, reduce_range=reduce_range, machine=platform.machine())
    target.parent.mkdir(parents=True, exist_ok=True)
    removed = clean_stale(target)
    if removed:
        log.info("export_int8: removed what killed exports to %s left: %s", target, ", ".join(removed))
    if export_exists(target) and not overwrite:
        raise FileExistsError(f"export_int8: an export exists at {target}; pass overwrite=True to replace it.")
    calibration = list(itertools.islice(calibration_data, calibration_batches))
    if not calibration:
        raise ValueError("`calibration_data` must yield at least one batch, got none.")
    if example_input is None:  # the first batch's inputs: a mismatch is the batches' (or `inputs_from_batch`'s) fault
        source = "inputs_from_batch" if inputs_from_batch is not None else "calibration_data"
        first = batch_inputs(calibration[0], inputs_from_batch, model, source)
        example = named_inputs(model, first, source)
        check_runs(model, example, source, first)
    example = {k: v.detach().cpu() for k, v in example.items()}
    arrays = [feed for feed, _ in feeds(model, calibration, example, inputs_from_batch)]
    budget = verify and (max_metric_drop is not None or min_agreement is not None) and max_fp32_layers != 0
    links = can_link(target.parent)
    was_training = model.training
    with staging(target) as stage:
        fp32, int8, pre = stage / f"{target.stem}.fp32.onnx", stage / target.name, stage / ".pre.onnx"
        try:
            model.eval()
            with torch.no_grad():
                device = next(iter(model.parameters()), torch.empty(0)).device
                layers = export_onnx(model, {k: v.to(device) for k, v in example.items()}, fp32)
        finally:
            model.train(was_training)
        fp32_session = ort_session(onnxruntime, fp32, num_threads)
        prepared = preprocess(fp32, pre)
        settings = quantize_qdq(pre, int8, arrays, fmt, symmetric)
        settings["cpu"] = {"model": cpu.model, "flags": list(cpu.flags), "isa_limit": cpu.isa_limit}
        sessions = (fp32_session, ort_session(onnxruntime, int8, num_threads))
        runs_once(sessions[1], arrays[0])  # verified or not, an INT8 model that cannot run is never written
        report: dict[str, Any] = {
            "int8_path": str(target),
            "fp32_path": str(export_paths(target)["fp32"]) if keep_fp32 else None,
            "report_path": str(export_paths(target)["report"]),
            "version_dir": str(version_dir_of(target, stage)) if links else None,
            "switch": "pointer rename" if links else "file by file (no symbolic links here)",
            "opset": opset_of(onnx, fp32),
            "input_name": fp32_session.get_inputs()[0].name,
            "input_names": [i.name for i in fp32_session.get_inputs()],
            "dynamic_axes": {
                i.name: [axis for axis, d in enumerate(i.shape) if isinstance(d, str)]
                for i in fp32_session.get_inputs()
            },
            "quantization": settings,
            "preprocess": prepared,
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
                    return quantize_qdq(source, out, arrays, fmt, symmetric, excluded)

                found = keep_layers_in_fp32(
                    pre,
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
        for file in files_of(pre):
            file.unlink()
        fp32_bytes = sum(p.stat().st_size for p in files_of(fp32))
        int8_bytes = sum(p.stat().st_size for p in files_of(int8))
        if not keep_fp32:
            for file in files_of(fp32):
                file.unlink()
        kept = files_of(int8) + files_of(fp32)
        report.update(
            files=[p.name for p in kept],
            manifest={p.name: {"bytes": p.stat().st_size, "sha256": sha256_of(p)} for p in kept},
            fp32_bytes=fp32_bytes,
            int8_bytes=int8_bytes,
            size_ratio=fp32_bytes / int8_bytes,
            latency=_latencies(sessions, arrays[0], latency_batch_size, latency_repeats, num_threads),
            **dict(metadata or {}),
            versions={"torch": torch.__version__, "onnx": onnx.__version__, "onnxruntime": onnxruntime.__version__},
        )
        report["status"] = verdict(report)
        del sessions, fp32_session
        (stage / export_paths(target)["report"].name).write_text(json.dumps(report, indent=2))
        if not report["passed"] and on_metric_drop == "raise":
            raise Int8VerificationError(f"export_int8: {drop_message(report)}; nothing was written.", report)
        switch_into_place(stage, target, links)
    if not report["passed"]:
        rank_zero_warn(f"export_int8: FAILED its accuracy target: {drop_message(report)}.")
    log.info("export_int8: wrote %s (%s)", target, size_words(report["size_ratio"]))
    return report
