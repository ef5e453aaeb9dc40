"""Weights several layers share, untied in an ONNX model before ONNX Runtime quantizes it."""

from __future__ import annotations

from pathlib import Path

from lightning_speedkit.int8.to_onnx import EXTERNAL_DATA_BYTES, files_of

__all__ = ["untie_weights"]


def untie_weights(path: Path) -> list[str]:
    """Give each node after the first that reads a shared weight its own copy, in place; the weights untied.

    ONNX Runtime's quantizer quantizes an initializer once for all its readers: a weight tied between an
    ``Embedding`` (a ``Gather``, whose output is an activation) and a ``Linear`` (per-channel weights) gets the
    ``Linear``'s per-channel scale on the ``Gather``'s output too, and the INT8 model cannot run ("For per axis
    quantization, scale must be 1D tensor with size ..."). Only float initializers of two dimensions or more (weights)
    are untied; a shape or a scalar read by many nodes is left as it is.
    """
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(path))
    weights = {i.name: i for i in model.graph.initializer if len(i.dims) >= 2 and i.data_type in _FLOAT_TYPES}
    readers: dict[str, int] = {}
    added = 0  # bytes of the copies: the file grows by them
    for node in model.graph.node:
        for k, name in enumerate(node.input):
            if name in weights:
                readers[name] = readers.get(name, 0) + 1
                if readers[name] > 1:
                    copy = onnx.TensorProto()
                    copy.CopyFrom(weights[name])
                    copy.name = node.input[k] = f"{name}__reader{readers[name]}"
                    model.graph.initializer.append(copy)
                    added += numpy_helper.to_array(copy).nbytes
    untied = sorted(name for name, count in readers.items() if count > 1)
    if untied:
        large = sum(p.stat().st_size for p in files_of(path)) + added > EXTERNAL_DATA_BYTES
        location = path.name + ".data"  # `files_of`'s sidecar, written again
        onnx.save_model(model, str(path), save_as_external_data=large, all_tensors_to_one_file=True, location=location)
    return untied


_FLOAT_TYPES = (1, 10, 11, 16)  # onnx.TensorProto FLOAT, FLOAT16, DOUBLE, BFLOAT16
