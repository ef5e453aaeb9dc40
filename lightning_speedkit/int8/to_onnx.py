"""The ONNX step of an INT8 export: ``torch.export`` with dynamic batch and sequence axes, then the dynamo exporter.

Input names are ``forward``'s parameter names; the symbolic dimensions are named ``batch`` and ``sequence``. A
failure names the operator and the layer.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_speedkit.int8.inputs import dynamic_shapes, named_inputs, with_batch_of_two
from lightning_speedkit.report import quiet_logger

log = logging.getLogger(__name__)

__all__ = ["EXTERNAL_DATA_BYTES", "describe_failure", "export_onnx", "files_of"]

EXTERNAL_DATA_BYTES = 1_500_000_000
"""Models with more weight bytes keep them in a ``.data`` sidecar (protobuf's 2 GB limit, with room); others inline.

Inline weights keep an export one file per model: ONNX refuses external data reached through a symbolic link, which
is how `lightning_speedkit.int8.place` exposes the files of an export."""


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
    said = f"{where or 'somewhere in the model'}: {type(root).__name__}: {lines[0] if lines else ''}"
    fixed = next((line.strip(" -") for line in lines[1:] if "specialized it to be a constant" in line), None)
    if fixed:  # torch's reason is on the next line; the usual cause is a shape read as a number
        said += (
            f" {fixed.split('. ')[0]}: the model's forward fixes the batch size (`x.view(len(x), ...)`, a shape"
            " turned into a Python int): use `x.view(-1, ...)` or `x.flatten(1)`."
        )
    return said


def _name_dimensions(graph: Any) -> None:
    """Rename the symbolic batch and sequence dimensions of the inputs (``s0``, ``s1``, ...) everywhere they occur.

    A dimension ``torch.export`` fixed (an MLP's features) can come out as a symbol named by its size (``"8"``): it is
    written as that size, never labelled ``sequence`` (ONNX reads one symbol on two inputs as "equal").
    """
    import onnx_ir as ir

    def fixed(d: Any) -> bool:
        return isinstance(d, ir.SymbolicDim) and str(d.value).isdigit()

    labels: dict[str, str] = {}
    for value in graph.inputs:
        for axis, label in ((0, "batch"), (1, "sequence")):
            dim = value.shape[axis] if value.shape is not None and len(value.shape) > axis else None
            if isinstance(dim, ir.SymbolicDim) and not fixed(dim):
                labels.setdefault(str(dim.value), label)

    def rename(value: Any) -> None:
        if value.shape is not None:
            dims = [
                int(str(d.value))
                if fixed(d)
                else ir.SymbolicDim(labels[str(d.value)])
                if isinstance(d, ir.SymbolicDim) and str(d.value) in labels
                else d
                for d in value.shape
            ]
            value.shape = ir.Shape(dims)

    for value in [*graph.inputs, *graph.outputs, *(v for node in graph.all_nodes() for v in node.outputs)]:
        rename(value)


def export_onnx(model: nn.Module, example: torch.Tensor | Mapping[str, torch.Tensor], path: Path) -> dict[str, str]:
    """``torch.export`` with dynamic batch (and sequence) axes, then the dynamo ONNX exporter.

    ``example`` is a tensor or ``{forward parameter: tensor}`` (see `lightning_speedkit.int8.inputs.named_inputs`);
    the ONNX inputs take those names. A batch of 1 is doubled (``torch.export`` would fix it to 1). The exporter's
    per-node debug metadata (stack traces with local file paths, module paths) is dropped: it is not needed to run
    the model and would be ~8% of a small INT8 model. The model must already be in ``eval()`` mode.

    Returns:
        ``{ONNX node name: the module it came from}``, read from that metadata before it is dropped.

    Raises:
        RuntimeError: If tracing or conversion fails; the message names the operator and the layer.
        OSError: If the model cannot be written (disk full, no permission).
    """
    named = with_batch_of_two(named_inputs(model, example))
    # torch.export first, on its own: its traceback still holds the failing layer's frame, and one non-strict
    # attempt is all we want (torch.onnx.export would retry in strict mode and bury the first error).
    try:
        program = torch.export.export(model, (), kwargs=named, dynamic_shapes=dynamic_shapes(named), strict=False)
    except Exception as error:
        raise RuntimeError(
            "INT8 export: torch.export could not trace the model with a dynamic batch, "
            + describe_failure(error, model)
        ) from error
    layers: dict[str, str] = {}
    try:
        with quiet_logger("torch.onnx._internal.exporter._registration"):
            onnx_program = torch.onnx.export(program, (), kwargs=named, dynamo=True, verbose=False)
        if onnx_program is None:  # only the TorchScript exporter returns None
            raise RuntimeError("torch.onnx.export returned no ONNX program")
        for node in onnx_program.model.graph.all_nodes():
            scopes = node.metadata_props.get("pkg.torch.onnx.name_scopes", "")
            found = re.findall(r"'([^']*)'", scopes)
            if node.name and len(found) > 1:
                layers[node.name] = found[-2] or "<root>"
            node.metadata_props.clear()  # debug data: source stack traces and module paths, ~0.5 KB per node
        _name_dimensions(onnx_program.model.graph)
    except Exception as error:
        raise RuntimeError(f"INT8 export: cannot convert to ONNX, {describe_failure(error, model, program)}") from error
    try:
        weights = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        onnx_program.save(str(path), external_data=weights > EXTERNAL_DATA_BYTES)
    except OSError as error:  # a full or read-only disk: say so, not "cannot convert"
        raise OSError(error.errno, f"INT8 export: cannot write the ONNX model ({error.strerror})", str(path)) from error
    return layers


def files_of(model_path: Path) -> list[Path]:
    """A model file and its external-data sidecar (``<name>.data``), those that exist."""
    return [p for p in (model_path, model_path.with_name(model_path.name + ".data")) if p.is_file()]
