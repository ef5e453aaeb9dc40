"""Channel removal with torch-pruning's dependency graph: plan on a copy, replay on the model, count the cost."""

from __future__ import annotations

import contextlib
import copy
import io
import logging
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn

from lightning_speedkit.batch import forward_example, modes_kept
from lightning_speedkit.checks import check_choice, check_int, check_number, is_int
from lightning_speedkit.hardware import cpu_info
from lightning_speedkit.layout import is_channels_last, nhwc_unsafe_convs, to_channels_last, to_default_layout
from lightning_speedkit.pruning.arguments import (
    IMPORTANCES,
    check_example_input,
    check_history,
    check_layer_names,
    check_module,
    check_ratio,
)
from lightning_speedkit.pruning.attention import (
    find_attention,
    pruner_arguments,
    unprunable_attention,
    update_head_counts,
)
from lightning_speedkit.pruning.failures import naming_failures, naming_surgery
from lightning_speedkit.pruning.ties import retie, ties

log = logging.getLogger(__name__)

__all__ = [
    "History",
    "apply_pruning_history",
    "channel_step_ratio",
    "count_macs_params",
    "normalised_history",
    "output_layer_names",
    "plan_pruning",
    "pruned_copy",
    "pruning_history",
    "replay_pruning_history",
    "unsupported_layer_names",
]

History = list[tuple[str, bool, list[int]]]
"""torch-pruning's pruning history: ``(module name, out-channel pruning?, removed indices)`` in the order applied."""

_HISTORY_ATTR = "_speedkit_pruning_history"  # on a pruned module: the history that gave it its architecture
_ROOT_TYPES = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear)  # layers whose output channels torch-pruning removes


@contextlib.contextmanager
def _quiet_torch_pruning() -> Iterator[None]:
    """Silence torch-pruning's notes on bare parameters and keyword inputs.

    It warns about bare ``nn.Parameter`` objects such as a ``cls_token`` (it prunes their last dimension, which is
    right for them), and its counter prints "no positional inputs" for a dict example input.
    """
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.filterwarnings("ignore", message="Unwrapped parameters detected")
        yield


def _device(model: nn.Module) -> torch.device:
    return next((p.device for p in model.parameters()), torch.device("cpu"))


def pruning_history(model: nn.Module) -> History:
    """The pruning history applied to ``model`` by this module's functions (empty for an unpruned model)."""
    return list(getattr(check_module("model", model), _HISTORY_ATTR, []))


def normalised_history(history: Any) -> History:
    """``history`` (e.g. read back from a checkpoint, with lists for tuples) as a `History`."""
    return [(str(name), bool(out), [int(i) for i in idxs]) for name, out, idxs in history]


def channel_step_ratio(amount: float, step: int, steps: int) -> float:
    """Share of the *current* channels to remove at ``step`` (0-based) so ``steps`` steps remove ``amount`` in all.

    Example:
        >>> [round(channel_step_ratio(0.5, k, 2), 4) for k in range(2)]
        [0.25, 0.3333]
    """
    check_number("amount", amount, 0, 1, open_low=True, open_high=True)
    steps = check_int("steps", steps)
    if not is_int(step, low=0) or step >= steps:
        raise ValueError(f"`step` must be an int in [0, {steps}) (0-based, below `steps`), got {step!r}.")
    kept_before = 1.0 - amount * step / steps
    kept_after = 1.0 - amount * (step + 1) / steps
    return 1.0 - kept_after / kept_before


def count_macs_params(model: nn.Module, example_input: Any) -> tuple[float, int]:
    """(MACs, parameters) of one forward pass on ``example_input``, by torch-pruning's counter (on a copy).

    Example:
        >>> count_macs_params(nn.Linear(4, 2), torch.zeros(1, 4))
        (10.0, 10)
    """
    import torch_pruning as tp

    check_module("model", model)
    check_example_input("example_input", example_input)
    x = example_input if isinstance(example_input, (tuple, list, dict)) else (example_input,)
    with _quiet_torch_pruning():
        macs, params = tp.utils.count_ops_and_params(model, move_data_to_device(x, _device(model)))
    return float(macs), int(params)


def unsupported_layer_names(model: nn.Module) -> list[str]:
    """Names of submodules torch-pruning cannot shrink correctly, left whole by `StructuredPruning`.

    ``nn.MultiheadAttention`` with ``kdim``/``vdim``, and ``nn.LSTM`` (torch-pruning 1.6's surgery of it fails,
    ``batch_first`` or not, one layer or two).

    Example:
        >>> unsupported_layer_names(nn.Sequential(nn.Linear(4, 8), nn.MultiheadAttention(8, 2), nn.LSTM(8, 8)))
        ['2']
    """
    lstms = [name for name, module in check_module("model", model).named_modules() if isinstance(module, nn.LSTM)]
    return [*unprunable_attention(model), *lstms]


def _build_graph(model: nn.Module, example_input: Any, what: str) -> Any:
    import torch_pruning as tp

    with torch.enable_grad(), modes_kept(model), naming_failures(model, what), _quiet_torch_pruning():
        return tp.DependencyGraph().build_dependency(
            model, move_data_to_device(example_input, _device(model)), forward_fn=forward_example, verbose=False
        )


def output_layer_names(model: nn.Module, example_input: Any) -> list[str]:
    """Conv/Linear layers whose output channels reach a model output without passing another Conv/Linear.

    Removing their channels would change the output's shape (e.g. the classifier), so they are never pruned.

    Example:
        >>> output_layer_names(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)), torch.zeros(1, 4))
        ['2']
    """
    check_module("model", model)
    check_example_input("example_input", example_input)
    graph = _build_graph(model, example_input, "trace")
    names = {m: n for n, m in model.named_modules()}
    found = []
    for module, node in graph.module2node.items():
        if not isinstance(module, _ROOT_TYPES):
            continue
        stack, seen = list(node.outputs), set()
        reaches_output = not node.outputs
        while stack and not reaches_output:
            current = stack.pop()
            if current in seen or isinstance(current.module, _ROOT_TYPES):
                continue
            seen.add(current)
            reaches_output = not current.outputs
            stack.extend(current.outputs)
        if reaches_output:
            found.append(names[module])
    return sorted(found)


def _importance(name: str) -> Any:
    import torch_pruning as tp

    return tp.importance.GroupMagnitudeImportance(p=1 if name == "l1" else 2)


def plan_pruning(
    model: nn.Module,
    example_input: Any,
    ratio: float,
    ignored_layers: Sequence[str] = (),
    importance: str = "magnitude",
    round_to: int | None = 8,
) -> History:
    """Prune a copy of ``model`` by ``ratio`` of the channels of every layer; return what was removed.

    ``model`` itself is not changed: apply the plan with `apply_pruning_history`. The pruned copy is run once, so a
    model that breaks after pruning fails here, with the layer named. Attention layers that
    `~lightning_speedkit.pruning.attention.find_attention` recognises lose whole heads (the nearest count to
    ``ratio``, at least one head kept) and their head-count fields are updated.

    Args:
        model: The model (its names are the history's names).
        example_input: A tensor, tuple (``*args``) or dict (``**kwargs``) the model accepts.
        ratio: Share of each layer's channels to remove, in [0, 1).
        ignored_layers: Names of submodules left whole (their outputs are never pruned).
        importance: One of `IMPORTANCES`.
        round_to: Keep channel counts a multiple of this (None: any count).

    Raises:
        ValueError: For an argument of the wrong kind or out of range (the message names it).
        RuntimeError: If the model cannot be traced or fails after pruning (the message names the layer).

    Example:
        >>> net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2))
        >>> [(name, len(idxs)) for name, _, idxs in plan_pruning(net, torch.zeros(1, 4), 0.5, ["2"], round_to=None)]
        [('0', 8)]
    """
    return pruned_copy(model, example_input, ratio, ignored_layers, importance, round_to)[0]


def pruned_copy(
    model: nn.Module,
    example_input: Any,
    ratio: float,
    ignored_layers: Sequence[str] = (),
    importance: str = "magnitude",
    round_to: int | None = 8,
) -> tuple[History, nn.Module]:
    """`plan_pruning`'s plan and the pruned copy it made (in eval mode, channels-last if ``model`` is).

    Example:
        >>> net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2))
        >>> plan, twin = pruned_copy(net, torch.zeros(1, 4), 0.5, ["2"], round_to=None)
        >>> twin[0].out_features, net[0].out_features
        (8, 16)
    """
    import torch_pruning as tp

    check_module("model", model)
    check_example_input("example_input", example_input)
    ratio = check_ratio("ratio", ratio)
    ignored_layers = check_layer_names("ignored_layers", ignored_layers, model)
    check_choice("importance", importance, IMPORTANCES)
    round_to = check_int("round_to", round_to, optional=True)
    twin = copy.deepcopy(model)
    if ratio <= 0.0:
        return [], twin.eval()
    ignored = [twin.get_submodule(name) for name in ignored_layers]
    attention = find_attention(twin)
    x = move_data_to_device(example_input, _device(twin))
    with torch.enable_grad(), naming_failures(twin, "trace"), _quiet_torch_pruning():
        pruner = tp.pruner.BasePruner(
            twin,
            x,
            importance=_importance(importance),
            pruning_ratio=ratio,
            ignored_layers=ignored,
            forward_fn=forward_example,
            **pruner_arguments(twin, attention, ratio, round_to),
        )
    tied = ties(twin)
    with torch.no_grad(), naming_surgery(twin):
        pruner.step()
    retie(twin, tied, pruner.pruning_history())
    with torch.no_grad(), naming_failures(twin, "run the pruned copy of"):
        update_head_counts(twin, attention)
        twin.eval()
        forward_example(twin, x)
    _keep_layout(twin, is_channels_last(model))
    return normalised_history(pruner.pruning_history()), twin


def _keep_layout(model: nn.Module, channels_last: bool) -> None:
    """Put a pruned ``model`` back in NHWC when it was, unless pruning left a layer oneDNN cannot train that way.

    Pruning can leave a strided 1x1 convolution with fewer input channels than oneDNN's block on a CPU
    (`lightning_speedkit.layout.nhwc_unsafe_convs`); the model then stays in the default layout, with a warning.
    """
    if not channels_last:
        return
    weight = next(model.parameters(), None)
    on_cpu = weight is not None and weight.device.type == "cpu"
    unsafe = nhwc_unsafe_convs(model, cpu_info()) if on_cpu else []
    if unsafe:
        to_default_layout(model)
        rank_zero_warn(
            f"StructuredPruning: the pruned model is back in the default layout: oneDNN cannot train {unsafe[0]!r}"
            f" ({len(unsafe)} such layer(s)) channels-last on this CPU (lightning_speedkit.layout.nhwc_unsafe_convs)."
        )
        return
    to_channels_last(model)


def apply_pruning_history(model: nn.Module, example_input: Any, history: History) -> None:
    """Remove the channels listed in ``history`` from ``model`` in place (new, smaller ``nn.Parameter`` objects).

    Optimizers built before this point refer to the old parameters: rebuild them. Tied parameters stay tied
    (`lightning_speedkit.pruning.ties`), a channels-last model stays channels-last, and attention layers get their head
    counts from their pruned projections.

    Example:
        >>> net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2))
        >>> apply_pruning_history(net, torch.zeros(1, 4), [("0", True, [0, 1, 2, 3])])
        >>> net[0].out_features, net[2].in_features, len(pruning_history(net))
        (12, 12, 1)

    Raises:
        ValueError: If ``history`` is malformed or names layers ``model`` lacks, or ``example_input`` is not an input.
    """
    check_module("model", model)
    history = check_history("history", history)
    if not history:
        return
    check_example_input("example_input", example_input)
    _check_history_names(model, history)
    channels_last = is_channels_last(model)
    attention = find_attention(model)
    graph, tied = _build_graph(model, example_input, "trace"), ties(model)
    with torch.no_grad():
        graph.load_pruning_history([list(record) for record in history])
    retie(model, tied, history)
    update_head_counts(model, attention)
    _keep_layout(model, channels_last)
    setattr(model, _HISTORY_ATTR, [*pruning_history(model), *history])


def replay_pruning_history(model: nn.Module, example_input: Any, history: History) -> None:
    """Bring ``model`` to the architecture ``history`` describes, applying only what it lacks.

    Raises:
        ValueError: If ``history`` is malformed, or not empty and ``example_input`` is None or not an input.
        RuntimeError: If ``model`` was pruned along a different history (load into a fresh module instead).
    """
    history, current = check_history("history", history), pruning_history(model)
    if history == current:
        return
    if history[: len(current)] != current:
        raise RuntimeError(
            f"StructuredPruning: the module was pruned differently ({len(current)} records) from the checkpoint"
            f" ({len(history)} records): load the checkpoint into a freshly constructed module."
        )
    if example_input is None:
        raise ValueError(
            "`example_input` must be given to rebuild the pruned architecture: the checkpoint holds none and the"
            " model has no `example_input_array`."
        )
    apply_pruning_history(model, example_input, history[len(current) :])


def _check_history_names(model: nn.Module, history: History) -> None:
    layers = dict(model.named_modules())
    missing = sorted({name for name, _, _ in history if name not in layers})
    if missing:
        raise ValueError(
            f"`history` must name submodules of {type(model).__name__}, got records for {missing[0]!r}, which it"
            " lacks: apply a history to the model class it was taken from."
        )
