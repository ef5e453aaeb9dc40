"""What speedkit decides from the hardware: accelerator and devices, starting precision, strategy and ``num_workers``.

Pure functions of the facts in `lightning_speedkit.hardware`; each decision is a `Choice`, a value and a one-line
reason. `lightning_speedkit.preset` builds its Trainer from them and ``speedkit doctor`` prints them, so the two
cannot disagree. There is one strategy rule, `strategy_choice`: DDP whenever the world (processes per node times
nodes, on GPUs or CPU processes) holds more than one process.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypedDict

from lightning_speedkit.checks import check_int, is_int
from lightning_speedkit.hardware import CpuInfo, GpuInfo

__all__ = [
    "ACCELERATORS",
    "PRECISIONS",
    "Choice",
    "Placement",
    "interactive_session",
    "num_workers_choice",
    "placement",
    "precision_choice",
    "recommend",
    "strategy_choice",
    "unified_precision",
]

ACCELERATORS = ("auto", "cpu", "gpu", "cuda")
"""The accelerators speedkit decides for: CPUs and CUDA GPUs."""

PRECISIONS = ("auto", "32-true", "16-mixed", "bf16-mixed", "64-true", "bf16-true", "16-true", "transformer-engine",
              "transformer-engine-float16")  # fmt: skip
"""Lightning's precision names, and ``"auto"`` for speedkit's choice."""

_PRECISION_ALIASES: dict[Any, str] = {16: "16-mixed", "16": "16-mixed", "bf16": "bf16-mixed", 32: "32-true",
                                      "32": "32-true", 64: "64-true", "64": "64-true"}  # fmt: skip
_MAX_WORKERS_PER_GPU = 8


class Choice(TypedDict):
    """One decision: its ``value`` and a one-line ``reason`` naming the fact that decided it."""

    value: Any
    reason: str


@dataclass(frozen=True)
class Placement:
    """Where a run goes: the accelerator and ``devices`` to give the Trainer, and what that selects.

    Args:
        accelerator: ``"gpu"`` or ``"cpu"`` (or ``"cuda"`` when asked so), for the Trainer.
        devices: For the Trainer: a count, or the GPU indices asked for.
        gpus: The GPUs the run trains on; empty on CPU.
        processes: Processes per node: one per GPU, or the CPU processes asked for.
        reasons: One line for ``accelerator`` and one for ``devices``.
    """

    accelerator: str
    devices: int | list[int]
    gpus: tuple[GpuInfo, ...]
    processes: int
    reasons: dict[str, str]


def placement(
    cpu: CpuInfo, gpus: Sequence[GpuInfo], accelerator: str = "auto", devices: Any = "auto", num_nodes: int = 1
) -> Placement:
    """The accelerator and devices for a run: every GPU with ``"auto"``, else one CPU process; or what is asked.

    Args:
        cpu: This machine's CPU facts.
        gpus: The CUDA devices torch sees.
        accelerator: One of `ACCELERATORS`; ``"auto"`` takes the GPUs when there are any.
        devices: ``"auto"``, a positive int (GPUs, or CPU processes), or on GPUs ``-1`` (every GPU) or a list of
            GPU indices.
        num_nodes: Nodes, each running ``devices``; only named in the reason.

    Raises:
        ValueError: If ``accelerator`` is not one of `ACCELERATORS` or asks for a GPU where torch sees none, or
            ``devices`` is malformed or asks for more than this machine has.

    Example:
        >>> cpu, a100 = CpuInfo(8, 8, "test CPU", ("avx2",), "AVX2"), GpuInfo(0, "NVIDIA A100", (8, 0), 40 * 2**30)
        >>> placement(cpu, [a100]).accelerator, placement(cpu, [a100], "cpu", 2).processes
        ('gpu', 2)
        >>> placement(cpu, [], "gpu")
        Traceback (most recent call last):
        ...
        ValueError: `accelerator`='gpu' asks for a CUDA GPU, but torch sees none; pass accelerator='cpu' or 'auto'.
    """
    if not (isinstance(accelerator, str) and accelerator in ACCELERATORS):
        raise ValueError(
            f"`accelerator` must be one of {', '.join(map(repr, ACCELERATORS))} (speedkit decides for CPUs and CUDA"
            f" GPUs; for another, build a lightning.Trainer yourself), got {accelerator!r}."
        )
    if accelerator in ("gpu", "cuda") and not gpus:
        raise ValueError(
            f"`accelerator`={accelerator!r} asks for a CUDA GPU, but torch sees none; pass accelerator='cpu' or 'auto'."
        )
    on_gpu = bool(gpus) and accelerator != "cpu"
    available = len(gpus) if on_gpu else cpu.available_cores
    unit = "GPU(s)" if on_gpu else "CPU core(s) (one process each)"
    chosen: tuple[GpuInfo, ...] = ()
    if devices == "auto" or (on_gpu and devices == -1):
        count = available if on_gpu else 1
    elif is_int(devices, 1):
        count = devices
    elif on_gpu and isinstance(devices, (list, tuple)) and _distinct_ints(devices):
        chosen = tuple(gpu for gpu in gpus if gpu.index in devices)
        if len(chosen) < len(devices):
            raise ValueError(f"`devices`={devices!r} names GPUs this machine lacks: it has {len(gpus)} {unit}.")
        count = len(devices)
    else:
        forms = (
            "'auto', a positive int, -1 (every GPU) or a list of GPU indices" if on_gpu else "'auto' or a positive int"
        )
        raise ValueError(f"`devices` must be {forms}, got {devices!r}.")
    if count > available:
        raise ValueError(f"`devices`={devices!r} asks for more than this machine has: {available} {unit}.")
    reasons = {
        "accelerator": "as asked" if accelerator != "auto" else "CUDA GPU found" if on_gpu else "no CUDA GPU: CPU",
        "devices": f"{count} of {available} {unit}" + (f" x {num_nodes} nodes" if num_nodes != 1 else ""),
    }
    return Placement(
        accelerator=accelerator if accelerator != "auto" else "gpu" if on_gpu else "cpu",
        devices=list(devices) if chosen else count,
        gpus=chosen or (tuple(gpus[:count]) if on_gpu else ()),
        processes=count,
        reasons=reasons,
    )


def precision_choice(cpu: CpuInfo, gpus: Sequence[GpuInfo]) -> Choice:
    """The precision to start from: ``"16-mixed"`` where every GPU has tensor cores, else ``"32-true"``.

    On a CPU with bf16 instructions, and on GPUs with bf16, `PrecisionTuner` measures ``"bf16-mixed"`` at fit start.

    Example:
        >>> precision_choice(CpuInfo(8, 8, "test CPU", ("avx2",), "AVX2"), [])["value"]
        '32-true'
    """
    if gpus:
        old = [gpu for gpu in gpus if not gpu.tensor_cores]
        if old:
            return _choice("32-true", f"{_describe(old)} predates Volta (compute < 7.0): no tensor cores for fp16")
        no_bf16 = [gpu for gpu in gpus if not gpu.bf16]
        bf16_note = (
            "'bf16-mixed' is also available (every GPU has compute >= 8.0), needs no loss scaling, and preset's"
            " PrecisionTuner times it against '16-mixed' at fit start"
            if not no_bf16
            else f"'bf16-mixed' is not: {_describe(no_bf16)} has compute < 8.0"
        )
        return _choice("16-mixed", f"to start on CUDA, tensor cores on every GPU; {bf16_note}")
    bf16_flags = cpu.bf16_instructions
    if bf16_flags:
        return _choice(
            "32-true",
            f"to start; the CPU has {' and '.join(bf16_flags)}, so preset's PrecisionTuner times 'bf16-mixed'"
            " against it on real training steps at fit start and keeps the faster (measured on one such CPU:"
            " benchmarks/results/precision.json)",
        )
    return _choice(
        "32-true",
        "no bf16 instructions: bf16 autocast would be emulated (about 10x slower than fp32 measured on an AVX2 CPU),"
        " so it is not tried; Lightning turns '16-mixed' into 'bf16-mixed' on CPU (with a warning)",
    )


def strategy_choice(processes: int, num_nodes: int = 1, accelerator: str = "cpu") -> Choice:
    """The one strategy rule: DDP when the world (``processes`` per node x ``num_nodes``) has more than one process.

    One process per GPU, or the CPU processes asked for; NCCL between GPUs, gloo between CPU processes.

    Raises:
        ValueError: If ``processes`` or ``num_nodes`` is not a positive int.

    Example:
        >>> [strategy_choice(n, nodes, "gpu")["value"] for n, nodes in ((1, 1), (4, 1), (1, 2))]
        ['auto', 'ddp', 'ddp']
        >>> strategy_choice(2)["reason"]
        '2 processes (devices=2): one per CPU process, DDP over gloo, gradient_as_bucket_view'
    """
    check_int("processes", processes)
    check_int("num_nodes", num_nodes)
    gpu = accelerator in ("gpu", "cuda")
    world = processes * num_nodes
    if world == 1:
        return _choice("auto", "one GPU: single device, no process group" if gpu else "CPU only: single process")
    layout = f"devices={processes}" + (f" x num_nodes={num_nodes}" if num_nodes > 1 else "")
    unit, backend = ("GPU", "nccl") if gpu else ("CPU process", "gloo")
    return _choice("ddp", f"{world} processes ({layout}): one per {unit}, DDP over {backend}, gradient_as_bucket_view")


def interactive_session() -> bool:
    """Whether Python runs interactively (a notebook, ``python -i``), as Lightning tells it.

    There, DDP cannot launch its processes by running the script again; Lightning refuses ``DDPStrategy`` with that
    launcher and picks ``"ddp_fork"`` for ``strategy="auto"``, and `~lightning_speedkit.preset` forks too.
    """
    from lightning.fabric.utilities import imports

    return bool(imports._IS_INTERACTIVE)


def num_workers_choice(cpu: CpuInfo, gpus: Sequence[GpuInfo], processes: int | None = None) -> Choice:
    """Loader workers per process: the cores this node's processes share, one kept for each training loop.

    Args:
        cpu: This machine's CPU facts.
        gpus: The GPUs trained on; empty on CPU.
        processes: Training processes on this node; default one per GPU, or one on CPU.

    Example:
        >>> cpu = CpuInfo(32, 32, "EPYC", ("avx2",), "AVX2")
        >>> num_workers_choice(cpu, [])["value"], num_workers_choice(cpu, [], processes=2)["value"]
        (8, 4)
    """
    cores = cpu.available_cores
    count = processes if processes is not None else max(1, len(gpus))
    if gpus:
        workers = min(_MAX_WORKERS_PER_GPU, max(1, cores // count - 1))
        return _choice(
            workers,
            f"{cores} cores / {count} GPU process(es), one core kept for the training loop, "
            f"at least 1 and at most {_MAX_WORKERS_PER_GPU} per process",
        )
    share = f"{cores} cores" if count == 1 else f"{cores} cores / {count} processes"
    return _choice(
        cores // count // 4,
        f"{share} // 4: on CPU the loader workers compete with the model for the same cores; DataLoaderTuner measures"
        " it",
    )


def recommend(
    cpu: CpuInfo, gpus: Sequence[GpuInfo], processes: int | None = None, num_nodes: int = 1
) -> dict[str, Choice]:
    """The precision, strategy and ``num_workers`` speedkit would choose here, each with a one-line reason.

    Args:
        cpu: This machine's CPU facts.
        gpus: The CUDA devices to train on; empty for a CPU-only run.
        processes: Training processes per node; default one per GPU, or one on CPU.
        num_nodes: Nodes, each running ``processes``.

    Returns:
        ``{"precision": {"value": ..., "reason": ...}, "strategy": {...}, "num_workers": {...}}``.

    Example:
        >>> cpu = CpuInfo(8, 8, "test CPU", ("avx2",), "AVX2")
        >>> {key: choice["value"] for key, choice in recommend(cpu, []).items()}
        {'precision': '32-true', 'strategy': 'auto', 'num_workers': 2}
        >>> recommend(cpu, [GpuInfo(0, "NVIDIA A100", (8, 0), 40 * 2**30)])["precision"]["value"]
        '16-mixed'
        >>> recommend(cpu, [], processes=2)["strategy"]["value"]
        'ddp'
    """
    count = processes if processes is not None else max(1, len(gpus))
    return {
        "precision": precision_choice(cpu, gpus),
        "strategy": strategy_choice(count, num_nodes, "gpu" if gpus else "cpu"),
        "num_workers": num_workers_choice(cpu, gpus, count),
    }


def unified_precision(precision: Any) -> str:
    """Lightning's unified name for ``precision`` (its legacy aliases ``16``, ``"bf16"``, ``32`` ... translated).

    Raises:
        ValueError: If ``precision`` is not one of `PRECISIONS` or an alias.

    Example:
        >>> unified_precision(16), unified_precision("bf16"), unified_precision("auto")
        ('16-mixed', 'bf16-mixed', 'auto')
    """
    if isinstance(precision, (str, int)) and not isinstance(precision, bool):
        name = _PRECISION_ALIASES.get(precision, precision)
        if name in PRECISIONS:
            return str(name)
    raise ValueError(f"`precision` must be one of {', '.join(PRECISIONS)}, got {precision!r}.")


def _choice(value: object, reason: str) -> Choice:
    return {"value": value, "reason": reason}


def _describe(gpus: Sequence[GpuInfo]) -> str:
    """``"cuda:0 (Tesla P100, 6.0)"``, comma-separated for several GPUs."""
    return ", ".join(f"cuda:{g.index} ({g.name}, {g.capability[0]}.{g.capability[1]})" for g in gpus)


def _distinct_ints(values: Sequence[Any]) -> bool:
    ints = [v for v in values if is_int(v, 0)]
    return bool(values) and len(ints) == len(values) == len(set(ints))
