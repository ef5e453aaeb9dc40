"""Channel removal with torch-pruning's dependency graph: plan on a copy, replay on the model, reload a checkpoint."""

from __future__ import annotations

import contextlib
import copy
import logging
import os
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from torch import nn

from lightning_speedkit.batch import forward_example, modes_kept
from lightning_speedkit.layout import is_channels_last, to_channels_last
from lightning_speedkit.timing import median_ms

log = logging.getLogger(__name__)

__all__ = [
    "IMPORTANCES",
    "History",
    "apply_pruning_history",
    "channel_step_ratio",
    "count_macs_params",
    "cpu_latency_ms",
    "load_pruned_checkpoint",
    "output_layer_names",
    "plan_pruning",
    "pruning_history",
    "replay_pruning_history",
    "search_pruning_ratio",
    "unsupported_layer_names",
]

IMPORTANCES = ("l1", "magnitude")
"""Channel importance criteria: ``"magnitude"`` (group L2 norm of the weights) or ``"l1"`` (group L1 norm)."""

History = list[tuple[str, bool, list[int]]]
"""torch-pruning's pruning history: ``(module name, out-channel pruning?, removed indices)`` in the order applied."""

_HISTORY_ATTR = "_speedkit_pruning_history"  # on a pruned module: the history that gave it its architecture
_ROOT_TYPES = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear)  # layers whose output channels torch-pruning removes
_UNSUPPORTED = (nn.MultiheadAttention,)  # torch-pruning shrinks embed dims but not heads: left out


def _device(model: nn.Module) -> torch.device:
    return next((p.device for p in model.parameters()), torch.device("cpu"))


@contextlib.contextmanager
def _naming_failures(model: nn.Module, what: str) -> Iterator[None]:
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


def pruning_history(model: nn.Module) -> History:
    """The pruning history applied to ``model`` by this module's functions (empty for an unpruned model)."""
    return list(getattr(model, _HISTORY_ATTR, []))


def _normalised(history: Any) -> History:
    return [(str(name), bool(out), [int(i) for i in idxs]) for name, out, idxs in history]


def channel_step_ratio(amount: float, step: int, steps: int) -> float:
    """Share of the *current* channels to remove at ``step`` (0-based) so ``steps`` steps remove ``amount`` in all.

    Example:
        >>> [round(channel_step_ratio(0.5, k, 2), 4) for k in range(2)]
        [0.25, 0.3333]
    """
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

    x = example_input if isinstance(example_input, (tuple, list, dict)) else (example_input,)
    macs, params = tp.utils.count_ops_and_params(model, move_data_to_device(x, _device(model)))
    return float(macs), int(params)


def unsupported_layer_names(model: nn.Module) -> list[str]:
    """Names of submodules torch-pruning cannot shrink correctly (``nn.MultiheadAttention``)."""
    return [name for name, m in model.named_modules() if isinstance(m, _UNSUPPORTED)]


def _build_graph(model: nn.Module, example_input: Any, what: str) -> Any:
    import torch_pruning as tp

    with torch.enable_grad(), modes_kept(model), _naming_failures(model, what):
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
    model that breaks after pruning fails here, with the layer named.

    Args:
        model: The model (its names are the history's names).
        example_input: A tensor, tuple (``*args``) or dict (``**kwargs``) the model accepts.
        ratio: Share of each layer's channels to remove, in [0, 1).
        ignored_layers: Names of submodules left whole (their outputs are never pruned).
        importance: One of `IMPORTANCES`.
        round_to: Keep channel counts a multiple of this (None: any count).

    Raises:
        RuntimeError: If the model cannot be traced or fails after pruning (the message names the layer).

    Example:
        >>> net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2))
        >>> [(name, len(idxs)) for name, _, idxs in plan_pruning(net, torch.zeros(1, 4), 0.5, ["2"], round_to=None)]
        [('0', 8)]
    """
    import torch_pruning as tp

    if ratio <= 0.0:
        return []
    twin = copy.deepcopy(model)
    ignored = [twin.get_submodule(name) for name in ignored_layers]
    x = move_data_to_device(example_input, _device(twin))
    with torch.enable_grad(), _naming_failures(twin, "trace"):
        pruner = tp.pruner.BasePruner(
            twin,
            x,
            importance=_importance(importance),
            pruning_ratio=ratio,
            ignored_layers=ignored,
            round_to=round_to,
            forward_fn=forward_example,
        )
    with torch.no_grad(), _naming_failures(twin, "run the pruned copy of"):
        pruner.step()
        twin.eval()
        forward_example(twin, x)
    return _normalised(pruner.pruning_history())


def apply_pruning_history(model: nn.Module, example_input: Any, history: History) -> None:
    """Remove the channels listed in ``history`` from ``model`` in place (new, smaller ``nn.Parameter`` objects).

    Optimizers built before this point refer to the old parameters: rebuild them. A channels-last model stays
    channels-last.

    Example:
        >>> net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2))
        >>> apply_pruning_history(net, torch.zeros(1, 4), [("0", True, [0, 1, 2, 3])])
        >>> net[0].out_features, net[2].in_features, len(pruning_history(net))
        (12, 12, 1)
    """
    if not history:
        return
    history = _normalised(history)
    channels_last = is_channels_last(model)
    graph = _build_graph(model, example_input, "trace")
    with torch.no_grad():
        graph.load_pruning_history([list(record) for record in history])
    if channels_last:
        to_channels_last(model)
    setattr(model, _HISTORY_ATTR, [*pruning_history(model), *history])


def replay_pruning_history(model: nn.Module, example_input: Any, history: History) -> None:
    """Bring ``model`` to the architecture ``history`` describes, applying only what it lacks.

    Raises:
        ValueError: If ``history`` is not empty and ``example_input`` is None.
        RuntimeError: If ``model`` was pruned along a different history (load into a fresh module instead).
    """
    history, current = _normalised(history), pruning_history(model)
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


def search_pruning_ratio(
    model: nn.Module,
    example_input: Any,
    target_macs: float,
    ignored_layers: Sequence[str] = (),
    importance: str = "magnitude",
    round_to: int | None = 8,
    max_ratio: float = 0.95,
    iterations: int = 6,
) -> tuple[float, History, float]:
    """The smallest channel ratio whose pruned copy has at most ``target_macs`` MACs (a scan, then bisection).

    Returns:
        ``(ratio, plan, macs)``; if no ratio tried reaches the target, the one with the fewest MACs.

    Example:
        >>> net = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 8))
        >>> ratio, plan, macs = search_pruning_ratio(net, torch.zeros(1, 8), 600, ["2"], round_to=None)
        >>> macs <= 600, 0.0 < ratio < 1.0
        (True, True)
    """

    def trial(ratio: float) -> tuple[History, float]:
        plan = plan_pruning(model, example_input, ratio, ignored_layers, importance, round_to)
        twin = copy.deepcopy(model)
        apply_pruning_history(twin, example_input, plan)
        return plan, count_macs_params(twin, example_input)[0]

    # A coarse scan up to the first ratio that reaches the target, then bisection below it. (Rounding can make a
    # large ratio prune less: a layer that would drop below `round_to` channels is left alone.)
    tried: list[tuple[float, History, float]] = []
    low, high = 0.0, None
    for k in range(1, 9):
        ratio = max_ratio * k / 8
        plan, macs = trial(ratio)
        tried.append((ratio, plan, macs))
        if macs <= target_macs:
            high = ratio
            break
        low = ratio
    for _ in range(iterations if high is not None else 0):
        ratio = (low + high) / 2  # type: ignore[operator]
        plan, macs = trial(ratio)
        tried.append((ratio, plan, macs))
        low, high = (low, ratio) if macs <= target_macs else (ratio, high)
    reached = [t for t in tried if t[2] <= target_macs]
    if reached:
        return min(reached, key=lambda t: t[0])
    return min(tried, key=lambda t: (t[2], t[0]))


def _repeat_batch(example_input: Any, batch_size: int) -> Any:
    if isinstance(example_input, torch.Tensor):
        return example_input[:1].expand(batch_size, *example_input.shape[1:]).contiguous()
    if isinstance(example_input, (tuple, list)):
        return type(example_input)(_repeat_batch(v, batch_size) for v in example_input)
    if isinstance(example_input, dict):
        return {k: _repeat_batch(v, batch_size) for k, v in example_input.items()}
    return example_input


def cpu_latency_ms(model: nn.Module, example_input: Any, batch_size: int = 1, repeats: int = 20) -> float:
    """Median CPU latency in milliseconds of one eval forward pass of a copy of ``model`` at ``batch_size``.

    The example's first sample is repeated to ``batch_size``. Runs on the CPU with the current thread count.

    Example:
        >>> cpu_latency_ms(nn.Linear(4, 2), torch.zeros(1, 4), batch_size=8, repeats=3) > 0
        True
    """
    twin = copy.deepcopy(model).cpu().eval()
    x = _repeat_batch(move_data_to_device(example_input, torch.device("cpu")), batch_size)
    with torch.inference_mode():  # the first calls warm up allocators and kernels
        return median_ms(lambda: forward_example(twin, x), repeats, warmup=3)


def _find_pruning_state(checkpoint: dict[str, Any]) -> dict[str, Any] | None:
    states = [v for k, v in checkpoint.get("callbacks", {}).items() if str(k).startswith("StructuredPruning")]
    if len(states) > 1:
        raise ValueError(f"The checkpoint holds {len(states)} StructuredPruning states; expected one.")
    return states[0] if states else None


def load_pruned_checkpoint(
    model: nn.Module, checkpoint_path: str | os.PathLike[str], example_input: Any = None, strict: bool = True
) -> nn.Module:
    """Load a checkpoint of a `StructuredPruning` run into a fresh, unpruned ``model`` (e.g. for inference).

    Replays the pruning history saved in the checkpoint's callback state on ``model`` (so its layers take the
    pruned shapes), then loads the weights. The file is read with ``torch.load(weights_only=True)``.

    Args:
        model: A freshly constructed module of the class that was trained (e.g. ``MyModule(**hparams)``).
        checkpoint_path: A Lightning checkpoint written during or after the pruning run.
        example_input: An input the model accepts; default: the one saved in the checkpoint, else
            ``model.example_input_array``.
        strict: Passed to ``load_state_dict``.

    Returns:
        ``model``, pruned and loaded, in eval mode.

    Raises:
        ValueError: If the file is truncated, corrupted or not a Lightning checkpoint, no example input is
            available, or the checkpoint holds several pruning states.

    Example:
        >>> # model = load_pruned_checkpoint(MyModule(), "best.ckpt")
    """
    try:
        checkpoint = torch.load(checkpoint_path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise
    except Exception as error:  # truncated (OSError), corrupted (UnpicklingError, RuntimeError) or not torch's
        raise ValueError(
            f"`checkpoint_path` must be a readable Lightning checkpoint, got {str(checkpoint_path)!r}, which is"
            f" truncated, corrupted or not a checkpoint ({type(error).__name__}; see the cause above)."
        ) from error
    if not isinstance(checkpoint, dict) or not isinstance(checkpoint.get("state_dict"), dict):
        raise ValueError(
            f"`checkpoint_path` must be a Lightning checkpoint with a state_dict, got {str(checkpoint_path)!r}."
        )
    state = _find_pruning_state(checkpoint) or {}
    history = _normalised(state.get("history", []))
    if example_input is None:
        example_input = state.get("example_input")
    if example_input is None:
        example_input = getattr(model, "example_input_array", None)
    replay_pruning_history(model, example_input, history)
    model.load_state_dict(checkpoint["state_dict"], strict=strict)
    return model.eval()
