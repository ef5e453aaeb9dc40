"""The checks of the pruning package's arguments, one message per argument: "`name` must be ..., got ...".

The kinds shared by `StructuredPruning`, `load_pruned_checkpoint` and the functions: a module (not its class, not
a name), an example input (a tensor with a batch dimension, or a tuple, list or dict holding one) and whether the
model accepts it, lists of layer names (a list, never one string split into its characters), pruning histories
and ratios. Each raises ``ValueError`` naming the argument and the value received.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy, Strategy
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher
from torch import nn

from lightning_speedkit.batch import first_tensor, forward_example, modes_kept
from lightning_speedkit.checks import check_choice, check_int, is_int, is_number

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = [
    "IMPORTANCES",
    "LATENCY_DEVICES",
    "TARGET_KINDS",
    "check_device",
    "check_example_fits",
    "check_example_input",
    "check_history",
    "check_layer_names",
    "check_module",
    "check_pruning_args",
    "check_ratio",
    "check_steps_reach",
    "check_strategy",
    "describe",
    "first_sample",
]

IMPORTANCES = ("l1", "magnitude")
"""Channel importance criteria: ``"magnitude"`` (group L2 norm of the weights) or ``"l1"`` (group L1 norm)."""

LATENCY_DEVICES = ("auto", "cpu")
"""Where ``target_latency`` times the pruned copy: ``"auto"`` (the training device) or ``"cpu"``."""

TARGET_KINDS = ("macs", "latency")
"""What a speedup target counts: ``"macs"`` (MACs before / after) or ``"latency"`` (timed latency before / after)."""

_EXAMPLE_KINDS = "a tensor with a batch dimension, or a tuple, list or dict (str keys) holding one"


def describe(value: Any) -> str:
    """A short account of ``value`` for a message: tensors by their shape, modules by their class, long reprs cut.

    Example:
        >>> describe(torch.zeros(3)), describe((torch.zeros(2, 4), 1)), describe({"x": torch.zeros(1)}), describe([3])
        ('a tensor of shape (3,)', '(Tensor[2, 4], 1)', "{'x': Tensor[1]}", '[3]')
    """
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}" + ("" if value.dtype == torch.float32 else f" ({value.dtype})")
    return _brief(value)


def _brief(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"Tensor{list(value.shape)}" + ("" if value.dtype == torch.float32 else f" {value.dtype}")
    if isinstance(value, nn.Module):
        return f"{type(value).__name__}(...)"
    if isinstance(value, list):
        return f"[{', '.join(map(_brief, value))}]"
    if isinstance(value, tuple):
        return f"({', '.join(map(_brief, value))}{',' if len(value) == 1 else ''})"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k!r}: {_brief(v)}" for k, v in value.items()) + "}"
    shown = repr(value)
    return shown if len(shown) <= 80 else f"{shown[:77]}..."


def check_module(name: str, value: Any) -> nn.Module:
    """Return ``value`` if it is an ``nn.Module`` instance; else raise a ``ValueError`` naming it.

    Example:
        >>> check_module("model", nn.Linear)
        Traceback (most recent call last):
        ...
        ValueError: `model` must be an nn.Module instance, got the class Linear: construct it first, e.g. Linear(...).
    """
    if isinstance(value, nn.Module):
        return value
    if isinstance(value, type) and issubclass(value, nn.Module):
        raise ValueError(
            f"`{name}` must be an nn.Module instance, got the class {value.__name__}: construct it first, e.g."
            f" {value.__name__}(...)."
        )
    raise ValueError(f"`{name}` must be an nn.Module instance, got {describe(value)}.")


def check_device(name: str, value: Any) -> torch.device:
    """Return ``value`` as a ``torch.device``; else raise a ``ValueError`` naming it (torch's own error names nothing).

    Example:
        >>> check_device("device", "cpu")
        device(type='cpu')
        >>> check_device("device", "gpu")
        Traceback (most recent call last):
        ...
        ValueError: `device` must be a torch.device or a device name such as 'cpu' or 'cuda:0', got 'gpu'.
    """
    try:
        if isinstance(value, (str, torch.device)):
            return torch.device(value)
    except RuntimeError:
        pass
    raise ValueError(f"`{name}` must be a torch.device or a device name such as 'cpu' or 'cuda:0', got {value!r}.")


def check_example_input(name: str, value: Any, *, optional: bool = False) -> Any:
    """Return ``value`` if it can be a model input for tracing; else raise a ``ValueError`` naming it.

    A tensor with a batch dimension, or a tuple/list (``*args``) or dict with str keys (``**kwargs``) holding one.

    Example:
        >>> check_example_input("example_input", torch.zeros(1, 4)).shape
        torch.Size([1, 4])
        >>> check_example_input("example_input", "x")
        Traceback (most recent call last):
        ...
        ValueError: `example_input` must be a tensor with a batch dimension, or a tuple, list or dict (str keys) \
holding one, got 'x'.
    """
    if optional and value is None:
        return None
    good = isinstance(value, torch.Tensor) and value.dim() >= 1
    if isinstance(value, (tuple, list, dict)):
        keys_ok = not isinstance(value, dict) or all(isinstance(k, str) for k in value)
        good = keys_ok and first_tensor(value, min_dim=1) is not None
    if not good:
        kinds = _EXAMPLE_KINDS + (" (or None)" if optional else "")
        raise ValueError(f"`{name}` must be {kinds}, got {describe(value)}.")
    return value


@contextlib.contextmanager
def _nothing() -> Iterator[None]:
    yield


def check_example_fits(
    model: nn.Module,
    example: Any,
    name: str = "example_input",
    convert: Any = None,
    context: contextlib.AbstractContextManager[Any] | None = None,
) -> None:
    """Run one eval, no-grad forward of ``model`` on ``example``; if it fails, raise a ``ValueError`` naming ``name``.

    The module's train/eval flags are kept. ``convert`` (e.g. a precision plugin's ``convert_input``) and
    ``context`` (its ``forward_context()``) make the call as the Trainer would. A ``torch.compile``'d ``__call__``
    is bypassed: this checks the shapes, it does not compile a graph for eval.

    Example:
        >>> check_example_fits(nn.Linear(4, 2), torch.zeros(1, 4))
        >>> check_example_fits(nn.Linear(4, 2), torch.zeros(3))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: `example_input` must be an input Linear accepts, got a tensor of shape (3,): its forward raised \
RuntimeError: ...
    """
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    x = move_data_to_device(example, device)
    x = convert(x) if convert is not None else x
    try:
        with torch.no_grad(), modes_kept(model), context or _nothing():
            model.eval()
            forward_example(model.forward, x)  # type: ignore[arg-type]
    except Exception as error:
        raise ValueError(
            f"`{name}` must be an input {type(model).__name__} accepts, got {describe(example)}: its forward raised"
            f" {type(error).__name__}: {error}"
        ) from error


def check_layer_names(name: str, value: Any, model: nn.Module | None = None) -> list[str]:
    """Return ``value`` as a list of submodule names (of ``model`` when given); else raise a ``ValueError``.

    One string is refused rather than read as its characters, or guessed to be one name. ``""`` is the model
    itself (`~lightning_speedkit.pruning.surgery.output_layer_names` of a bare ``nn.Linear``).

    Example:
        >>> check_layer_names("ignored_layers", ["2"], nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2)))
        ['2']
        >>> check_layer_names("ignored_layers", "net.0")
        Traceback (most recent call last):
        ...
        ValueError: `ignored_layers` must be a list of submodule names, got 'net.0': for one layer, write ['net.0'].
    """
    if isinstance(value, str):
        raise ValueError(
            f"`{name}` must be a list of submodule names, got {value!r}: for one layer, write [{value!r}]."
        )
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"`{name}` must be a list of submodule names, got {describe(value)}.")
    if model is not None:
        known = dict(model.named_modules())
        unknown = [v for v in value if v not in known]
        if unknown:
            raise ValueError(
                f"`{name}` must name submodules of {type(model).__name__}, got {list(value)!r}: no {unknown[0]!r}."
            )
    return list(value)


def check_ratio(name: str, value: Any) -> float:
    """Return a share of channels to remove, in [0, 1), as a float; else raise a ``ValueError`` naming it.

    Example:
        >>> check_ratio("ratio", 1.5)
        Traceback (most recent call last):
        ...
        ValueError: `ratio` must be a number in [0, 1) (a share of each layer's channels), got 1.5.
    """
    if not is_number(value, 0, 1, open_high=True):
        raise ValueError(f"`{name}` must be a number in [0, 1) (a share of each layer's channels), got {value!r}.")
    return float(value)


def check_history(name: str, value: Any) -> list[tuple[str, bool, list[int]]]:
    """Return ``value`` as a pruning history ``[(module name, out-channels?, [indices])]``; else raise.

    Records read back from a checkpoint hold lists for tuples; both are accepted.

    Example:
        >>> check_history("history", [["net.0", True, [3, 1]]])
        [('net.0', True, [3, 1])]
        >>> check_history("history", "abc")
        Traceback (most recent call last):
        ...
        ValueError: `history` must be a list of (module name, bool, [channel indices]) records, got 'abc'.
    """

    def record_ok(r: Any) -> bool:
        return (
            isinstance(r, (list, tuple))
            and len(r) == 3
            and isinstance(r[0], str)
            and isinstance(r[1], bool)
            and isinstance(r[2], (list, tuple))
            and all(is_int(i, low=0) for i in r[2])
        )

    if not isinstance(value, (list, tuple)) or not all(record_ok(r) for r in value):
        raise ValueError(
            f"`{name}` must be a list of (module name, bool, [channel indices]) records, got {describe(value)}."
        )
    return [(str(n), bool(out), [int(i) for i in idxs]) for n, out, idxs in value]


def first_sample(batch: Any) -> Any:
    """The model input of a batch (a tensor, or the first item of a tuple/list), cut to one sample, on the CPU.

    Example:
        >>> first_sample((torch.zeros(8, 4), torch.zeros(8))).shape
        torch.Size([1, 4])
    """
    if isinstance(batch, (tuple, list)) and batch:
        batch = batch[0]
    if not isinstance(batch, torch.Tensor) or batch.dim() < 1:
        raise ValueError(
            f"`example_input` must be given: the model has no `example_input_array` and the first batch"
            f" ({type(batch).__name__}) is not a tensor or a tuple starting with one."
        )
    return batch[:1].detach().cpu()


def check_pruning_args(
    amount: Any,
    target_speedup: Any,
    target_latency: Any,
    start_epoch: Any,
    iterative_steps: Any,
    finetune_epochs: Any,
    importance: Any,
    ignored_layers: Any,
    round_to: Any,
    example_input: Any,
    rewarm: Any,
    monitor: Any,
    latency_batch_sizes: Any,
    latency_device: Any,
) -> None:
    """Raise ``ValueError`` naming the first argument of `StructuredPruning` that is out of range.

    Example:
        >>> check_pruning_args(None, None, 1.0, 0, 1, 1, "magnitude", None, 8, None, 0.1, None, (1,), "cpu")
        Traceback (most recent call last):
        ...
        ValueError: `target_latency` must be a finite number > 1, got 1.0.
    """
    given = {"amount": amount, "target_speedup": target_speedup, "target_latency": target_latency}
    if sum(v is not None for v in given.values()) != 1:
        shown = ", ".join(f"{k}={v!r}" for k, v in given.items())
        raise ValueError(f"Exactly one of `amount`, `target_speedup` and `target_latency` must be given, got {shown}.")
    if amount is not None and not is_number(amount, 0, 1, open_low=True, open_high=True):
        raise ValueError(f"`amount` must be a float in (0, 1), got {amount!r}.")
    for name in ("target_speedup", "target_latency"):
        if given[name] is not None and not is_number(given[name], 1, open_low=True):
            raise ValueError(f"`{name}` must be a finite number > 1, got {given[name]!r}.")
    check_int("start_epoch", start_epoch, low=0)
    check_int("iterative_steps", iterative_steps)
    check_int("finetune_epochs", finetune_epochs, low=0)
    check_choice("importance", importance, IMPORTANCES)
    check_int("round_to", round_to, optional=True)
    if not is_int(rewarm, low=0) and not (isinstance(rewarm, float) and 0.0 < rewarm < 1.0):
        raise ValueError(f"`rewarm` must be an int >= 0 (steps) or a float in (0, 1), got {rewarm!r}.")
    if not isinstance(latency_batch_sizes, (list, tuple)) or any(not is_int(b, low=1) for b in latency_batch_sizes):
        raise ValueError(
            f"`latency_batch_sizes` must be a list of positive ints (empty: no latency), got {latency_batch_sizes!r}."
        )
    if monitor is not None and (not isinstance(monitor, str) or not monitor):
        raise ValueError(f"`monitor` must be a metric name or None, got {monitor!r}.")
    _check_ignored_layers(ignored_layers)
    check_example_input("example_input", example_input, optional=True)
    check_choice("latency_device", latency_device, LATENCY_DEVICES)


def _check_ignored_layers(value: Any) -> None:
    """`StructuredPruning`'s ``ignored_layers``: None, or a list of submodule names and submodules."""
    if value is None:
        return
    if isinstance(value, str):
        raise ValueError(
            f"`ignored_layers` must be a list of submodule names or modules, got {value!r}: for one layer, write"
            f" [{value!r}]."
        )
    items = value if isinstance(value, (list, tuple)) else None
    if items is None or not all(isinstance(x, nn.Module) or (isinstance(x, str) and x) for x in items):
        raise ValueError(f"`ignored_layers` must be a list of submodule names or modules, got {describe(value)}.")


def check_strategy(strategy: Strategy) -> None:
    """Raise a ``ValueError`` unless ``strategy`` is one pruning supports: single-device, or DDP launched by a script.

    Under a spawning launcher the main process loads the trained weights back into its unpruned module.
    """
    if not isinstance(strategy, (SingleDeviceStrategy, DDPStrategy)) or strategy.restore_checkpoint_after_setup:
        raise ValueError(
            f"StructuredPruning supports single-device and DDP strategies, got {type(strategy).__name__}:"
            " use strategy='auto' or 'ddp'."
        )
    if isinstance(getattr(strategy, "launcher", None), _MultiProcessingLauncher):
        raise ValueError(
            "StructuredPruning cannot run under 'ddp_spawn'/'ddp_fork'/'ddp_notebook': the main process loads the"
            " trained weights back into its unpruned module. Use strategy='ddp' (a script or torchrun)."
        )


def check_steps_reach(trainer: pl.Trainer, last_epoch: int) -> None:
    """Raise a ``ValueError`` when ``max_steps`` ends the fit before epoch ``last_epoch`` starts.

    A pruning step's epoch, or the fine-tune's last, would never run. The ``max_epochs`` check is
    `StructuredPruning.setup`'s.
    """
    batches, most = trainer.num_training_batches, trainer.max_steps
    if most < 0 or not math.isfinite(batches) or batches <= 0:
        return
    per_epoch = max(1, math.ceil(batches / trainer.accumulate_grad_batches))
    if most <= last_epoch * per_epoch:
        raise ValueError(
            f"StructuredPruning needs the fit to reach epoch {last_epoch} (start_epoch + iterative_steps +"
            f" finetune_epochs - 1), but `max_steps`={most} ends it in epoch {(most - 1) // per_epoch} ({per_epoch}"
            " optimizer steps an epoch): raise `max_steps` or lower those arguments."
        )
