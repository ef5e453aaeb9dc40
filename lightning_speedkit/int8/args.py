"""The argument checks of `export_int8` and `Int8Export`: each names the argument and the value received."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from lightning_speedkit.checks import check_bool, check_choice, check_int, is_int, is_number, unwritable
from lightning_speedkit.int8.place import export_paths

__all__ = [
    "ACTIONS_ON_METRIC_DROP",
    "ACTIVATION_TYPES",
    "REPORT_KEYS",
    "ExportPathError",
    "ExportPlaceError",
    "check_batches",
    "check_export_args",
    "check_export_path",
    "check_metadata",
    "check_metric",
]

ACTIONS_ON_METRIC_DROP = ("raise", "warn")
"""What `export_int8` and `Int8Export` do when the INT8 metric drops more than allowed."""

ACTIVATION_TYPES = ("int8", "uint8")
"""Activation types of the INT8 model; weights are always per-channel symmetric."""

REPORT_KEYS = (
    "int8_path", "fp32_path", "report_path", "version_dir", "switch", "opset", "input_name", "input_names",
    "dynamic_axes", "quantization", "preprocess", "verification", "metric_drop", "max_metric_drop", "min_agreement",
    "accuracy_aware", "passed", "status", "files", "manifest", "fp32_bytes", "int8_bytes", "size_ratio", "latency",
    "cpu", "versions", "exported",
)  # fmt: skip
"""The keys an `export_int8` report sets itself (``exported``: `Int8Export`'s); ``metadata`` may not use them."""


class ExportPathError(ValueError, NotADirectoryError):
    """``path`` (or ``dirpath``) cannot hold an export: a file stands where a directory must be, or the reverse.

    A ``ValueError`` like every bad argument, and a ``NotADirectoryError`` (an ``OSError``) like the file system's.
    """


class ExportPlaceError(ValueError, PermissionError):
    """``path`` lies where no file can be made (a read-only directory or mount, ``/proc``).

    A ``ValueError`` like every bad argument, and a ``PermissionError`` (an ``OSError``) like the file system's.
    """


def check_batches(name: str, value: object) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``value`` is an iterable of batches (not a string).

    Example:
        >>> check_batches("calibration_data", "images/")
        Traceback (most recent call last):
        ...
        ValueError: `calibration_data` must be an iterable of batches (e.g. a DataLoader), got 'images/'.
    """
    if not isinstance(value, Iterable) or isinstance(value, (str, bytes, Mapping)):
        raise ValueError(f"`{name}` must be an iterable of batches (e.g. a DataLoader), got {value!r}.")


def check_metric(value: object, names: bool = False) -> None:
    """Raise ``ValueError`` unless ``value`` is a torchmetrics ``Metric`` or None (or, with ``names``, a non-empty str).

    Example:
        >>> check_metric("accuracy")
        Traceback (most recent call last):
        ...
        ValueError: `metric` must be a torchmetrics Metric or None, got 'accuracy'.
    """
    from torchmetrics import Metric

    if value is None or isinstance(value, Metric) or (names and isinstance(value, str) and value):
        return
    kind = "a torchmetrics Metric or None"
    if names:
        kind = "a torchmetrics Metric, the name of one of the module's, or None"
    raise ValueError(f"`metric` must be {kind}, got {value!r}.")


def check_metadata(value: object) -> None:
    """Raise ``ValueError`` unless ``value`` is None or a dict of str keys to JSON values, none of them a report key.

    Example:
        >>> check_metadata({"checkpoint": "best.ckpt", "epoch": 3})
        >>> check_metadata({1: "v"})
        Traceback (most recent call last):
        ...
        ValueError: `metadata` must be a dict of str keys to JSON values, got {1: 'v'}: key 1 is not a str.
    """
    if value is None:
        return
    problem = None
    if not isinstance(value, Mapping):
        problem = "not a dict"
    else:
        for key, item in value.items():
            if not isinstance(key, str):
                problem = f"key {key!r} is not a str"
            elif key in REPORT_KEYS:
                problem = f"{key!r} is a key of the report itself"
            else:
                try:
                    json.dumps(item, allow_nan=False)
                except (TypeError, ValueError) as error:
                    problem = f"the value of {key!r} is not JSON ({error})"
            if problem:
                break
    if problem:
        raise ValueError(f"`metadata` must be a dict of str keys to JSON values, got {value!r}: {problem}.")


def check_export_path(value: object, name: str = "path") -> Path:
    """``value`` as a path to an ``.onnx`` file whose directory exists or can be made; else a named error.

    Raises:
        ValueError: If ``value`` is not a path ending in ``.onnx`` with a name before the suffix.
        ExportPathError: If ``value``, or a file the export writes beside it (`.place.export_paths`), is an existing
            directory, or a file stands where one of its directories must.
        ExportPlaceError: If no file can be made in its directory (`unwritable`).

    Example:
        >>> check_export_path("exports/.onnx")
        Traceback (most recent call last):
        ...
        ValueError: `path` must be a path to a file ending in '.onnx', got 'exports/.onnx'.
    """
    if not isinstance(value, (str, os.PathLike)) or not str(value).endswith(".onnx") or Path(value).name == ".onnx":
        raise ValueError(f"`{name}` must be a path to a file ending in '.onnx', got {str(value)!r}.")
    path = Path(value).absolute()
    if path.is_dir() and not path.is_symlink():
        raise ExportPathError(f"`{name}` must be a path to a file, got {str(value)!r}: it is a directory.")
    for other in export_paths(path).values():  # the files written beside it: a directory there stops the switch
        if other.is_dir() and not other.is_symlink():
            raise ExportPathError(
                f"`{name}` must leave room for the export's files, got {str(value)!r}: {other} is a directory."
            )
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise ExportPathError(
            f"`{name}` must be a path in a directory, got {str(value)!r}: {parent} is a file, not a directory."
        )
    problem = unwritable(path.parent)
    if problem:
        raise ExportPlaceError(f"`{name}` must be a path in a writable directory, got {str(value)!r}: {problem}.")
    return path


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
    if values.get("reduce_range") is not None:
        check_bool("reduce_range", values["reduce_range"])
    activation_type = values.get("activation_type")
    if activation_type is not None and (isinstance(activation_type, bool) or activation_type not in ACTIVATION_TYPES):
        choices = ", ".join(map(repr, ACTIVATION_TYPES))
        raise ValueError(f"`activation_type` must be one of {choices} or None, got {activation_type!r}.")
    if values.get("symmetric") and activation_type == "uint8":
        raise ValueError("`activation_type` must be 'int8' or None with symmetric=True (zero points 0), got 'uint8'.")
    for name, low in (("latency_batch_size", 1), ("latency_repeats", 0), ("num_threads", 0)):
        value = values.get(name, low)
        if not is_int(value, low):
            raise ValueError(f"`{name}` must be an int >= {low}, got {value!r}.")
