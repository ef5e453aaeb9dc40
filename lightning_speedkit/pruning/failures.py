"""Errors of the pruning surgery that name the layer: where a trace or a run failed, or the layer a cut failed on."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch import nn

__all__ = ["naming_failures", "naming_surgery"]


@contextlib.contextmanager
def naming_failures(model: nn.Module, what: str) -> Iterator[None]:
    """Re-raise an exception raised inside a forward of ``model`` as a ``RuntimeError`` that names the layer."""
    names = {m: n for n, m in model.named_modules()}
    stack: list[str] = []
    failed: list[str] = []

    def pre(module: nn.Module, args: Any) -> None:
        stack.append(names.get(module, "?"))

    def post(module: nn.Module, args: Any, output: Any) -> None:
        if stack:
            stack.pop()

    handles = [m.register_forward_pre_hook(pre) for m in model.modules()]
    handles += [m.register_forward_hook(post) for m in model.modules()]
    try:
        try:
            yield
        except Exception:
            failed.extend(stack[-1:])
            raise
        finally:
            for handle in handles:
                handle.remove()
    except Exception as exc:
        layer = failed[0] if failed and failed[0] else None
        where = f"at layer `{layer}` ({type(model.get_submodule(layer)).__name__})" if layer else "outside any layer"
        raise RuntimeError(
            f"StructuredPruning: could not {what} the model {where}: {type(exc).__name__}: {exc}. Pass that layer"
            " (or its parent) in `ignored_layers`, or give an `example_input` the model accepts."
        ) from exc


@contextlib.contextmanager
def naming_surgery(model: nn.Module) -> Iterator[None]:
    """Around torch-pruning's ``pruner.step()``: a failure names the layer it was cutting, and how to leave it whole.

    The layer is the innermost module of ``model`` among the locals of the failing frames (torch-pruning's pruning
    functions take it as ``layer``): an ``nn.LSTM``'s surgery fails with a bare ``IndexError`` inside them.
    """
    try:
        yield
    except Exception as exc:
        names = {m: n for n, m in model.named_modules() if n}
        layer, tb = None, exc.__traceback__
        while tb is not None:  # outermost to innermost: the last module found is the one being cut
            found = [names[v] for v in tb.tb_frame.f_locals.values() if isinstance(v, nn.Module) and v in names]
            layer, tb = (found[-1] if found else layer), tb.tb_next
        where = f"`{layer}` ({type(model.get_submodule(layer)).__name__})" if layer else "a layer it does not name"
        advice = f"pass `{layer}` in `ignored_layers`" if layer else "pass the layer in `ignored_layers`"
        raise RuntimeError(
            f"StructuredPruning: torch-pruning could not remove the channels of {where}: {type(exc).__name__}: {exc}."
            f" It cannot prune that kind of layer: {advice} to leave it whole."
        ) from exc
