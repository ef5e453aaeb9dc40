"""How much to prune: latency of a (pruned) copy, and the search for the smallest ratio that reaches a target.

``target_speedup`` counts MACs (exact, the same on every machine); ``target_latency`` times the pruned copy on a
device. Both search the channel ratio the same way: a coarse scan up to the first ratio that reaches the target,
then bisection below it.
"""

from __future__ import annotations

import copy
import logging
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from torch import nn

from lightning_speedkit.batch import forward_example
from lightning_speedkit.checks import check_choice, check_int, check_number
from lightning_speedkit.pruning.arguments import TARGET_KINDS, check_device, check_example_input, check_module
from lightning_speedkit.pruning.surgery import History, count_macs_params, pruned_copy
from lightning_speedkit.timing import median_ms

log = logging.getLogger(__name__)

__all__ = [
    "cpu_latency_ms",
    "device_latency_ms",
    "latency_speedup",
    "search_latency_ratio",
    "search_pruning_ratio",
    "search_ratio",
    "search_target",
]

Trial = tuple[float, History, float]
"""One point of a search: ``(ratio, plan, speedup)``."""


def _repeat_batch(example_input: Any, batch_size: int | None) -> Any:
    if batch_size is None:
        return example_input
    if isinstance(example_input, torch.Tensor):
        return example_input[:1].expand(batch_size, *example_input.shape[1:]).contiguous()
    if isinstance(example_input, (tuple, list)):
        return type(example_input)(_repeat_batch(v, batch_size) for v in example_input)
    if isinstance(example_input, dict):
        return {k: _repeat_batch(v, batch_size) for k, v in example_input.items()}
    return example_input


def _runner(model: nn.Module, example_input: Any, device: torch.device, batch_size: int | None) -> Callable[[], None]:
    """A call of one eval forward pass of a copy of ``model`` on ``device`` (synchronised on CUDA)."""
    check_example_input("example_input", example_input)
    twin = copy.deepcopy(model).to(device).eval()
    x = _repeat_batch(move_data_to_device(example_input, device), batch_size)

    def run() -> None:
        with torch.inference_mode():
            forward_example(twin, x)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    return run


def device_latency_ms(
    model: nn.Module,
    example_input: Any,
    device: str | torch.device = "cpu",
    batch_size: int | None = None,
    repeats: int = 20,
) -> float:
    """Median latency in ms of one eval forward pass of a copy of ``model`` on ``device``.

    ``batch_size`` repeats the example's first sample (None: the example as it is). On CUDA each pass is followed
    by a synchronisation, so the time is the device's.

    Example:
        >>> device_latency_ms(nn.Linear(4, 2), torch.zeros(1, 4), "cpu", batch_size=8, repeats=3) > 0
        True
    """
    check_module("model", model)
    batch_size = check_int("batch_size", batch_size, optional=True)
    run = _runner(model, example_input, check_device("device", device), batch_size)
    return median_ms(run, check_int("repeats", repeats), warmup=3)  # the first calls warm up allocators and kernels


def cpu_latency_ms(model: nn.Module, example_input: Any, batch_size: int = 1, repeats: int = 20) -> float:
    """Median CPU latency in ms of one eval forward pass of a copy of ``model`` at ``batch_size``.

    The example's first sample is repeated to ``batch_size``. Runs on the CPU with the current thread count.

    Example:
        >>> cpu_latency_ms(nn.Linear(4, 2), torch.zeros(1, 4), batch_size=8, repeats=3) > 0
        True
    """
    return device_latency_ms(model, example_input, "cpu", check_int("batch_size", batch_size), repeats)


def _fastest_ms(run: Callable[[], None], repeats: int) -> float:
    """The fastest of ``repeats`` timed calls, in ms: the one least disturbed by other processes."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append((time.perf_counter() - start) * 1000.0)
    return min(times)


def latency_speedup(
    reference: nn.Module,
    candidate: nn.Module,
    example_input: Any,
    device: str | torch.device = "cpu",
    rounds: int = 11,
    repeats: int = 5,
) -> float:
    """``reference`` latency / ``candidate`` latency on ``example_input``, timed in interleaved, paired rounds.

    Each round times ``repeats`` passes of one model, then of the other (alternating which goes first), and takes
    the ratio of the two fastest passes; the result is the median of those ratios. A burst of load from another
    process spoils a pass, not the fastest of five; a slow drift of the machine's speed hits both sides of a ratio
    alike; a round spoiled all the same is outvoted.

    Example:
        >>> net = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 2))
        >>> latency_speedup(net, net, torch.zeros(8, 64), rounds=2, repeats=2) > 0
        True
    """
    device = check_device("device", device)
    rounds, repeats = check_int("rounds", rounds), check_int("repeats", repeats)
    models = (check_module("reference", reference), check_module("candidate", candidate))
    runs = [_runner(model, example_input, device, None) for model in models]
    for run in runs:
        median_ms(run, 1, warmup=3)  # warm-up, not counted
    ratios = []
    for index in range(rounds):
        order = runs if index % 2 == 0 else runs[::-1]
        times = {id(run): _fastest_ms(run, repeats) for run in order}
        ratios.append(times[id(runs[0])] / max(times[id(runs[1])], 1e-9))
    return statistics.median(ratios)


def search_ratio(
    evaluate: Callable[[float], tuple[History, float]], target: float, max_ratio: float = 0.95, iterations: int = 6
) -> tuple[Trial, list[Trial]]:
    """The smallest channel ratio whose ``evaluate(ratio) = (plan, speedup)`` reaches ``target``, and all trials.

    A coarse scan of 8 ratios up to ``max_ratio`` stops at the first that reaches the target, then ``iterations``
    bisection steps below it. If none reaches it, the trial with the highest speedup is returned (rounding can
    make a large ratio prune less: a layer that would drop below ``round_to`` channels is left alone).

    Example:
        >>> (ratio, _, speedup), trials = search_ratio(lambda r: ([], 1.0 / (1.0 - r)), 2.0)
        >>> round(ratio, 2), speedup >= 2.0, len(trials)
        (0.5, True, 11)
    """
    check_number("max_ratio", max_ratio, 0, 1, open_low=True, open_high=True)
    iterations = check_int("iterations", iterations, low=0)
    tried: list[Trial] = []
    low, high = 0.0, None
    for k in range(1, 9):
        ratio = max_ratio * k / 8
        tried.append((ratio, *evaluate(ratio)))
        if tried[-1][2] >= target:
            high = ratio
            break
        low = ratio
    for _ in range(iterations if high is not None else 0):
        ratio = (low + high) / 2  # type: ignore[operator]
        tried.append((ratio, *evaluate(ratio)))
        low, high = (low, ratio) if tried[-1][2] >= target else (ratio, high)
    reached = [t for t in tried if t[2] >= target]
    best = min(reached, key=lambda t: t[0]) if reached else max(tried, key=lambda t: (t[2], -t[0]))
    return best, tried


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
    check_number("target_macs", target_macs, 0, open_low=True)

    def evaluate(ratio: float) -> tuple[History, float]:
        plan, twin = pruned_copy(model, example_input, ratio, ignored_layers, importance, round_to)
        return plan, 1.0 / max(count_macs_params(twin, example_input)[0], 1.0)

    (ratio, plan, inverse), _ = search_ratio(evaluate, 1.0 / max(target_macs, 1.0), max_ratio, iterations)
    return ratio, plan, 1.0 / inverse


def search_latency_ratio(
    model: nn.Module,
    example_input: Any,
    target_speedup: float,
    ignored_layers: Sequence[str] = (),
    importance: str = "magnitude",
    round_to: int | None = 8,
    device: str | torch.device = "cpu",
    max_ratio: float = 0.95,
    iterations: int = 6,
    measure: Callable[[nn.Module, nn.Module], float] | None = None,
) -> tuple[float, History, float, list[Trial]]:
    """The smallest channel ratio whose pruned copy runs ``target_speedup`` times faster than ``model``.

    Each candidate is pruned on a copy (`~lightning_speedkit.pruning.surgery.pruned_copy`) and timed against
    ``model`` on ``example_input`` on ``device`` (`latency_speedup`, interleaved rounds), so the speedup is what the
    kernels of that device give at those widths, not a MAC count. ``measure(reference, candidate)`` replaces the timing.

    Returns:
        ``(ratio, plan, speedup, trials)``; if no ratio reaches the target, the fastest trial.

    Example:
        >>> net = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 8))
        >>> x = torch.zeros(1, 8)
        >>> by_macs = lambda a, b: count_macs_params(a, x)[0] / count_macs_params(b, x)[0]
        >>> ratio, plan, speedup, _ = search_latency_ratio(net, x, 1.5, ["2"], measure=by_macs)
        >>> speedup >= 1.5, 0.0 < ratio < 1.0
        (True, True)
    """
    check_number("target_speedup", target_speedup, 0, open_low=True)
    device = check_device("device", device)
    if measure is not None and not callable(measure):
        raise ValueError(f"`measure` must be a function (reference, candidate) -> speedup, or None, got {measure!r}.")

    def timed(reference: nn.Module, candidate: nn.Module) -> float:
        return latency_speedup(reference, candidate, example_input, device)

    compare = measure or timed

    def evaluate(ratio: float) -> tuple[History, float]:
        plan, twin = pruned_copy(model, example_input, ratio, ignored_layers, importance, round_to)
        return plan, compare(model, twin)

    (ratio, plan, speedup), tried = search_ratio(evaluate, target_speedup, max_ratio, iterations)
    return ratio, plan, speedup, tried


def search_target(
    model: nn.Module,
    example_input: Any,
    target: float,
    kind: str = "macs",
    ignored_layers: Sequence[str] = (),
    importance: str = "magnitude",
    round_to: int | None = 8,
    device: str | torch.device = "cpu",
    iterations: int = 6,
) -> tuple[float, History, float]:
    """``(ratio, plan, speedup)``: the smallest ratio whose pruned copy is ``target`` times cheaper than ``model``.

    ``kind`` is one of `TARGET_KINDS`: ``"macs"`` counts (`search_pruning_ratio`), ``"latency"`` times on ``device``
    (`search_latency_ratio`). With ``iterations=0`` only the coarse scan runs: enough to tell whether any ratio
    reaches the target. If none does, the best trial is returned; compare its speedup with ``target``.

    Example:
        >>> net = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 8))
        >>> ratio, plan, speedup = search_target(net, torch.zeros(1, 8), 1.5, "macs", ["2"], round_to=None)
        >>> speedup >= 1.5
        True
    """
    check_number("target", target, 0, open_low=True)  # a later step's share can be <= 1: nothing more to gain
    check_choice("kind", kind, TARGET_KINDS)
    device = check_device("device", device)
    args = (ignored_layers, importance, round_to)
    if kind == "macs":
        macs = count_macs_params(model, example_input)[0]
        ratio, plan, reached = search_pruning_ratio(model, example_input, macs / target, *args, iterations=iterations)
        return ratio, plan, macs / max(reached, 1.0)
    ratio, plan, speedup, _ = search_latency_ratio(
        model, example_input, target, *args, device=device, iterations=iterations
    )
    return ratio, plan, speedup
