"""The model's inputs for an INT8 export: named after ``forward``'s parameters, taken from batches, checked.

A model with one input takes a tensor; a text model's ``forward(input_ids, attention_mask)`` takes a tuple
(positional) or a dict (by name). Every form becomes an ordered ``{parameter name: tensor}``: those names become the
ONNX input names, the keys of the calibration and verification feeds, and what every batch is checked against.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

log = logging.getLogger(__name__)

__all__ = [
    "TARGET_KEYS",
    "InputsFromBatch",
    "batch_inputs",
    "batch_target",
    "check_runs",
    "dict_inputs",
    "dynamic_shapes",
    "feeds",
    "forward_names",
    "named_inputs",
    "with_batch_of_two",
]

InputsFromBatch = Callable[[Any], Any]
"""A user function: batch -> the model's inputs (a tensor, a tuple in ``forward`` order, or a dict by name)."""

TARGET_KEYS = ("labels", "label", "targets", "target", "y")
"""Keys read as the target of a dict batch (the first one present that is not an input)."""


def forward_names(model: nn.Module) -> tuple[list[str], int]:
    """``forward``'s parameter names that can take an input, and how many of them have no default.

    Example:
        >>> class Text(nn.Module):
        ...     def forward(self, input_ids, attention_mask=None, *, return_dict=False): ...
        >>> forward_names(Text())
        (['input_ids', 'attention_mask', 'return_dict'], 1)
    """
    names, required = [], 0
    for parameter in inspect.signature(model.forward).parameters.values():
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            continue
        names.append(parameter.name)
        required += parameter.default is parameter.empty
    return names, required


def _input_names(model: nn.Module) -> tuple[list[str], int]:
    """`forward_names`, or a ``ValueError`` naming ``model`` when forward names no input (``forward(*args, **kw)``)."""
    names, required = forward_names(model)
    if not names:  # the export feeds its inputs by name: a made-up one was refused as unknown, naming another argument
        given = ", ".join(
            str(p.replace(annotation=p.empty)) for p in inspect.signature(model.forward).parameters.values()
        )
        raise ValueError(
            f"`model` must name its inputs in forward() to be exported: forward({given}) of {type(model).__name__}"
            " names none. Give it named parameters (`forward(self, x)`), or export the module it wraps."
        )
    return names, required


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {str(value.dtype).removeprefix('torch.')} tensor of shape {tuple(value.shape)}"
    if isinstance(value, Mapping):
        return "a dict with keys (" + ", ".join(map(str, value)) + ")"
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)}: (" + ", ".join(type(v).__name__ for v in value) + ")"
    return f"a {type(value).__name__}"


def named_inputs(model: nn.Module, value: Any, argument: str = "example_input") -> dict[str, torch.Tensor]:
    """``value`` (a tensor, a tuple of positional inputs or a dict by name) as ``{forward parameter: tensor}``.

    Raises:
        ValueError: Naming ``argument``, if ``value`` does not fit ``forward``'s signature or holds a non-tensor.

    Example:
        >>> named_inputs(nn.Bilinear(2, 3, 4), (torch.zeros(1, 2), torch.zeros(1, 3))).keys()
        dict_keys(['input1', 'input2'])
        >>> named_inputs(nn.Linear(2, 2), {"x": torch.zeros(1, 2)})  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: `example_input` must match forward(input) of Linear: it has no parameter 'x', got a dict ...
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"`model` must be a torch.nn.Module, got {model!r}.")
    names, required = _input_names(model)
    signature = f"forward({', '.join(names[: max(required, 1)])}) of {type(model).__name__}"
    if isinstance(value, torch.Tensor):
        pairs = [(names[0] if names else "input", value)]
    elif isinstance(value, (tuple, list)):
        pairs = list(zip(names, value, strict=False))
        if len(value) > len(names) or not value:
            problem = f"it takes {len(names)} input{'s' * (len(names) != 1)}" if value else "it needs an input"
            raise ValueError(f"`{argument}` must match {signature}: {problem}, got {_describe(value)}.")
    elif isinstance(value, Mapping):
        unknown = [key for key in value if key not in names]
        if unknown:
            problem = f"it has no parameter {unknown[0]!r}"
            raise ValueError(f"`{argument}` must match {signature}: {problem}, got {_describe(value)}.")
        pairs = [(name, value[name]) for name in names if name in value]
    else:
        raise ValueError(f"`{argument}` must be a tensor, a tuple or a dict of tensors, got {_describe(value)}.")
    missing = [name for name in names[:required] if name not in dict(pairs)]
    if missing:
        problem = f"{missing[0]!r} is missing"
        raise ValueError(f"`{argument}` must match {signature}: {problem}, got {_describe(value)}.")
    for name, tensor in pairs:
        if not isinstance(tensor, torch.Tensor):
            problem = f"input {name!r} must be a tensor"
            raise ValueError(f"`{argument}` must match {signature}: {problem}, got {_describe(value)}.")
    return dict(pairs)


def dict_inputs(model: nn.Module, batch: Mapping[str, Any], argument: str = "calibration_data") -> dict[str, Any]:
    """The entries of a dict batch that are ``forward``'s parameters, by name; a target key stays out unless required.

    ``{"input_ids", "attention_mask", "labels"}`` for ``forward(input_ids, attention_mask)`` gives the first two;
    ``labels`` is then the target (`batch_target`). A `TARGET_KEYS` key that ``forward`` takes with a default (a
    Hugging Face model's ``labels=None``) is left out too, so that the ONNX model does not need labels.

    Raises:
        ValueError: Naming ``argument``, the batch's keys and ``forward``'s parameters, if no key is one of them.

    Example:
        >>> class Text(nn.Module):
        ...     def forward(self, input_ids, attention_mask=None, labels=None): ...
        >>> batch = {"input_ids": torch.zeros(2, 4), "labels": torch.zeros(2), "idx": torch.zeros(2)}
        >>> list(dict_inputs(Text(), batch))
        ['input_ids']
        >>> dict_inputs(Text(), {"ids": torch.zeros(2, 4)})  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: `calibration_data` must give dict batches whose keys are forward's parameters (input_ids, ...
    """
    required = {
        p.name
        for p in inspect.signature(model.forward).parameters.values()
        if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    }
    names, _ = forward_names(model)
    inputs = {name: batch[name] for name in names if name in batch and (name not in TARGET_KEYS or name in required)}
    if not inputs:
        raise ValueError(
            f"`{argument}` must give dict batches whose keys are forward's parameters ({', '.join(names)}) of"
            f" {type(model).__name__}, got {_describe(batch)}; or pass `inputs_from_batch`."
        )
    return inputs


def batch_inputs(
    batch: Any, inputs_from_batch: InputsFromBatch | None, model: nn.Module | None = None, argument: str = ""
) -> Any:
    """The model inputs of ``batch``: ``inputs_from_batch(batch)``, a tensor batch, a sequence's first item, or a dict.

    A dict batch (given ``model``) gives its entries named after ``forward``'s parameters (`dict_inputs`).

    Example:
        >>> batch_inputs((torch.zeros(2, 3), torch.tensor([0, 1])), None).shape
        torch.Size([2, 3])
        >>> sorted(batch_inputs({"ids": torch.zeros(2), "labels": torch.zeros(2)}, lambda b: {"ids": b["ids"]}))
        ['ids']
    """
    if inputs_from_batch is not None:
        return inputs_from_batch(batch)
    if isinstance(batch, torch.Tensor):
        return batch
    if isinstance(batch, Mapping) and model is not None:
        return dict_inputs(model, batch, argument or "calibration_data")
    if isinstance(batch, Sequence) and len(batch) > 0 and isinstance(batch[0], torch.Tensor):
        return batch[0]
    raise TypeError(
        "INT8 export takes batches that are a tensor, a sequence (input, target, ...) with a tensor input or a dict"
        " keyed by forward's parameters, or any batch with `inputs_from_batch` to pick the model's inputs out of"
        f" it, got {type(batch).__name__}."
    )


def batch_target(batch: Any, inputs_from_batch: InputsFromBatch | None, inputs: Iterable[str] = ()) -> Any:
    """The target of ``batch``, or None.

    A dict batch: the first of `TARGET_KEYS` present that is not one of the ``inputs``. A sequence: without
    ``inputs_from_batch`` its second item (``(input, target, ...)``); with it, the last item of a sequence of two or
    more (``(input_ids, attention_mask, labels)``).

    Example:
        >>> batch_target((torch.zeros(2, 3), torch.ones(2, 3), torch.tensor([0, 1])), lambda b: b[:2]).tolist()
        [0, 1]
        >>> batch_target({"input_ids": torch.zeros(2, 3), "labels": torch.tensor([1, 0])}, None, ["input_ids"])
        tensor([1, 0])
    """
    if isinstance(batch, Mapping):
        used = set(inputs)
        return next((batch[key] for key in TARGET_KEYS if key in batch and key not in used), None)
    if isinstance(batch, Sequence) and not isinstance(batch, torch.Tensor) and len(batch) > 1:
        return batch[-1] if inputs_from_batch is not None else batch[1]
    return None


def check_runs(model: nn.Module, example: Mapping[str, torch.Tensor], argument: str, value: Any) -> None:
    """Run ``forward`` once on ``example`` (eval mode, no grad): if it fails, ``argument`` is named as the cause.

    Raises:
        ValueError: ``"`example_input` must be inputs that forward(x) of Net accepts, got ...: forward raised
            RuntimeError: mat1 and mat2 shapes cannot be multiplied ..."``, with the model's error as the cause.
    """
    names, required = _input_names(model)
    signature = f"forward({', '.join(names[: max(required, 1)])}) of {type(model).__name__}"
    was_training = model.training
    device = next(iter(model.parameters()), torch.empty(0)).device
    try:
        model.eval()
        with torch.no_grad():
            model(**{k: v.to(device) for k, v in with_batch_of_two(example).items()})
    except Exception as error:
        lines = str(error).strip().splitlines()
        raise ValueError(
            f"`{argument}` must be inputs that {signature} accepts, got {_describe(value)}: forward raised"
            f" {type(error).__name__}: {lines[0] if lines else ''}"
        ) from error
    finally:
        model.train(was_training)


def feeds(
    model: nn.Module,
    batches: Iterable[Any],
    expected: Mapping[str, torch.Tensor],
    inputs_from_batch: InputsFromBatch | None = None,
    limit: int | None = None,
) -> Iterator[tuple[dict[str, np.ndarray], Any]]:
    """``(ONNX Runtime feed, target)`` for each batch (at most ``limit``), checked against the example inputs.

    Each batch must give the same inputs as ``expected`` (names and dtypes) with the same batch size in every input.

    Raises:
        ValueError: Naming ``inputs_from_batch`` (or ``calibration_data`` without one) for a batch that does not.
    """
    argument = "inputs_from_batch" if inputs_from_batch is not None else "calibration_data"
    for index, batch in enumerate(batches):
        if limit is not None and index >= limit:
            return
        named = named_inputs(model, batch_inputs(batch, inputs_from_batch, model, argument), argument)
        shown = ", ".join(f"{k}: {str(v.dtype).removeprefix('torch.')}" for k, v in named.items())
        wanted = ", ".join(f"{k}: {str(v.dtype).removeprefix('torch.')}" for k, v in expected.items())
        sizes = {len(v) if v.dim() else -1 for v in named.values()}
        if shown != wanted or len(sizes) != 1:
            problem = "inputs with one batch size" if shown == wanted else f"the inputs ({wanted})"
            raise ValueError(f"`{argument}` must give {problem} for every batch, got ({shown}) for batch {index}.")
        yield {k: v.detach().cpu().numpy() for k, v in named.items()}, batch_target(batch, inputs_from_batch, named)


def dynamic_shapes(named: Mapping[str, torch.Tensor]) -> dict[str, dict[int, Any]]:
    """``torch.export`` dynamic shapes: one shared batch dimension, and dimension 1 of 2-D and 3-D inputs automatic.

    Dimension 1 is a sequence in ``(batch, sequence)`` token inputs and ``(batch, sequence, features)``
    embeddings: ``Dim.AUTO`` keeps it dynamic where the model allows and static where it does not (the features of an
    MLP's ``(batch, features)`` input). Image dimensions stay static.

    Example:
        >>> shapes = dynamic_shapes({"input_ids": torch.zeros(2, 8), "pixels": torch.zeros(2, 3, 4, 4)})
        >>> sorted(shapes["input_ids"]), sorted(shapes["pixels"])
        ([0, 1], [0])
    """
    batch = torch.export.Dim("batch")
    shapes: dict[str, dict[int, Any]] = {}
    for name, tensor in named.items():
        axes: dict[int, Any] = {0: batch} if tensor.dim() >= 1 else {}
        if tensor.dim() in (2, 3):
            axes[1] = torch.export.Dim.AUTO
        shapes[name] = axes
    return shapes


def with_batch_of_two(named: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inputs, each doubled along the batch if the batch is 1 (``torch.export`` would fix a batch of 1)."""
    return {k: torch.cat([v, v]) if v.dim() and len(v) < 2 else v for k, v in named.items()}
