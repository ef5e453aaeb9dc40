"""Bad input to the INT8 API: a clear error naming the argument and the value, before any training or export work."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torchmetrics.classification import MulticlassAccuracy

from lightning_speedkit.hardware import CpuInfo
from lightning_speedkit.int8 import (
    ExportPathError,
    Int8Export,
    export_int8,
    export_paths,
    int8_format,
    int8_metrics,
    keep_sensitive_layers,
    named_inputs,
)
from lightning_speedkit.int8.steps import quantize_qdq

NET, DATA = nn.Linear(2, 2), [torch.zeros(4, 2)]


@pytest.mark.parametrize(
    ("kwargs", "argument", "shown"),
    [
        ({"metric": 1}, "metric", "1"),
        ({"metric": ""}, "metric", "''"),
        ({"dirpath": ""}, "dirpath", "''"),
        ({"dirpath": "  "}, "dirpath", "'  '"),
        ({"filename": ".onnx"}, "filename", "'.onnx'"),
        ({"reduce_range": 1}, "reduce_range", "1"),
    ],
)
def test_the_callback_refuses_bad_arguments_in_init(kwargs: dict[str, Any], argument: str, shown: str) -> None:
    """Int8Export(metric=1), dirpath="" and the like fail at construction, naming the argument and the value."""
    with pytest.raises(ValueError, match=f"`{argument}`") as caught:
        Int8Export(**kwargs)
    assert re.search(r"got " + re.escape(shown), str(caught.value)), str(caught.value)


@pytest.mark.parametrize(
    ("kwargs", "argument", "shown"),
    [
        ({"metric": "accuracy"}, "metric", "'accuracy'"),
        ({"metric": MulticlassAccuracy}, "metric", "<class"),
        ({"metadata": "x"}, "metadata", "'x': not a dict"),
        ({"metadata": 5}, "metadata", "5: not a dict"),
        ({"metadata": {"k": object()}}, "metadata", "the value of 'k' is not JSON"),
        ({"metadata": {1: "v"}}, "metadata", "key 1 is not a str"),
        ({"metadata": {"passed": True}}, "metadata", "'passed' is a key of the report itself"),
        ({"metadata": {"x": float("nan")}}, "metadata", "the value of 'x' is not JSON"),
        ({"reduce_range": 0}, "reduce_range", "0"),
        ({"calibration_data": {"x": torch.zeros(2, 2)}}, "calibration_data", "{'x'"),
        ({"path": "exports/.onnx"}, "path", "'exports/.onnx'"),
    ],
)
def test_export_int8_refuses_bad_arguments(tmp_path: Path, kwargs: dict[str, Any], argument: str, shown: str) -> None:
    """Each bad argument raises ValueError naming it and the value received; nothing is written."""
    arguments: dict[str, Any] = {"model": NET, "calibration_data": DATA, "path": tmp_path / "m.onnx"} | kwargs
    with pytest.raises(ValueError, match=f"`{argument}`") as caught:
        export_int8(**arguments)
    assert re.search(r"got .*" + re.escape(shown), str(caught.value)), str(caught.value)
    assert list(tmp_path.iterdir()) == []


def test_a_path_under_a_file_is_named_as_the_problem(tmp_path: Path) -> None:
    """``path=<a file>/m.onnx`` says that the file is not a directory (not a bare FileExistsError); nothing is made."""
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(
        ExportPathError, match=r"`path` must be a path in a directory, got .*notes.txt/m.onnx.*is a file"
    ):
        export_int8(NET, DATA, tmp_path / "notes.txt" / "m.onnx")
    assert ExportPathError.__mro__[1:3] == (ValueError, NotADirectoryError)
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


def test_a_path_that_is_a_directory_is_refused(tmp_path: Path) -> None:
    """``path`` naming an existing directory (``model.onnx/``) is refused before any work."""
    (tmp_path / "model.onnx").mkdir()
    with pytest.raises(ValueError, match=r"`path` must be a path to a file, got .*model.onnx'.*it is a directory"):
        export_int8(NET, DATA, tmp_path / "model.onnx")


@pytest.mark.parametrize("beside", ["model.json", "model.fp32.onnx", "model.onnx.data"])
def test_a_directory_where_the_export_writes_a_file_beside_path_is_refused_first(tmp_path: Path, beside: str) -> None:
    """A directory named like one of the files written beside ``path`` is refused before any work, nothing written.

    The export ran, then failed half-way through switching its files into place (``IsADirectoryError``), leaving
    dangling links at ``model.onnx`` and ``model.fp32.onnx`` and a stray staging directory.
    """
    (tmp_path / beside).mkdir()
    with pytest.raises(ExportPathError, match=rf"must leave room for the export's files.*{beside} is a directory"):
        export_int8(NET, DATA, tmp_path / "model.onnx", overwrite=True)
    assert [p.name for p in tmp_path.iterdir()] == [beside]


def test_an_example_input_of_the_wrong_shape_is_named_as_the_cause(tmp_path: Path) -> None:
    """A (3, 3) example for a Linear(2, 2) names `example_input`, its shape and the model's own error, early."""
    calls: list[int] = []

    def data() -> Any:
        calls.append(1)
        yield torch.zeros(4, 2)

    match = r"`example_input` must be inputs that forward\(input\) of Linear accepts, got a float32 tensor of shape"
    with pytest.raises(ValueError, match=match + r" \(3, 3\): forward raised RuntimeError: mat1 and mat2"):
        export_int8(NET, data(), tmp_path / "m.onnx", example_input=torch.randn(3, 3))
    assert calls == []  # before any batch was read
    assert list(tmp_path.iterdir()) == []


def test_batches_of_the_wrong_shape_are_named_as_the_cause(tmp_path: Path) -> None:
    """Without an example, a first batch the model cannot take names `calibration_data`."""
    with pytest.raises(ValueError, match=r"`calibration_data` must be inputs that forward\(input\) of Linear accepts"):
        export_int8(NET, [torch.zeros(4, 5)], tmp_path / "m.onnx")
    assert list(tmp_path.iterdir()) == []


CPU = CpuInfo(2, 2, "EPYC", ("avx2",), "AVX2")
FMT = int8_format(CPU)


@pytest.mark.parametrize(
    ("call", "argument", "shown"),
    [
        (lambda: int8_format("avx2"), "cpu", "'avx2'"),  # type: ignore[arg-type]
        (lambda: int8_format(CPU, symmetric=1), "symmetric", "1"),  # type: ignore[arg-type]
        (lambda: int8_format(CPU, activation_type="fp8"), "activation_type", "'fp8'"),
        (lambda: int8_format(CPU, reduce_range="no"), "reduce_range", "'no'"),  # type: ignore[arg-type]
        (lambda: int8_format(CPU, machine=""), "machine", "''"),
        (lambda: export_paths(""), "path", "''"),
        (lambda: export_paths(5), "path", "5"),  # type: ignore[arg-type]
        (lambda: named_inputs("model", torch.zeros(2)), "model", "'model'"),  # type: ignore[arg-type]
        (lambda: int8_metrics("report"), "report", "'report'"),  # type: ignore[arg-type]
        (lambda: keep_sensitive_layers(lambda kept: {}, "ab", {}, 1), "units", "'ab'"),  # type: ignore[arg-type]
        (lambda: keep_sensitive_layers(lambda kept: {}, [], {}, -1), "max_layers", "-1"),
        (lambda: keep_sensitive_layers(3, [], {}, 1), "evaluate", "3"),  # type: ignore[arg-type]
        (
            lambda: quantize_qdq(Path("a"), Path("b"), [], int8_format(CPU), False, "conv1"),
            "nodes_to_exclude",
            "'conv1'",
        ),
    ],
)
def test_the_rest_of_the_int8_api_names_bad_arguments(call: Any, argument: str, shown: str) -> None:
    """The helpers refuse a string for a sequence, 1 for a bool, an empty path, an object of the wrong kind."""
    with pytest.raises(ValueError, match=f"`{argument}`") as caught:
        call()
    assert re.search(r"got " + re.escape(shown), str(caught.value)), str(caught.value)


class _Delegating(nn.Module):
    """A wrapper whose forward passes everything through: it names no input."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(8, 3)

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.net(*args, **kwargs)  # type: ignore[no-any-return]


def test_a_forward_that_names_no_input_is_refused_naming_the_model(tmp_path: Path) -> None:
    """``forward(*args, **kwargs)``: the export feeds inputs by name, so it says so, naming ``model``.

    It refused ``example_input`` for a parameter 'input' the user never passed (or ``calibration_data``).
    """
    data = [(torch.randn(16, 8), torch.randint(0, 3, (16,)))]
    with pytest.raises(ValueError, match=r"`model` must name its inputs in forward\(\).*\(\*args, \*\*kwargs\)"):
        export_int8(_Delegating(), data, tmp_path / "m.onnx", latency_repeats=0)
    assert not any(tmp_path.iterdir())
