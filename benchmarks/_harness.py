"""What every benchmark repeats, written once: the timed step, interleaved rounds, the timed fit, the table and JSON.

- The timed step: `train_step` and `inference_step` build a closure that runs one step of a model on a fixed batch
  (`fixed_batch`) and, on CUDA, waits for it (`sync`), so timing the call times the step.
- Interleaved rounds: `interleaved_ms` times settings A, B, A, B ... (each from its own copy of the same weights on
  the same batch), so drift on a shared machine hits every setting alike; the figure is the median over the rounds.
  Whole fits take turns the same way: `alternated` (A B, B A, ...) and `rotated` (A B C, B C A, ...).
- The timed fit: `quiet_trainer` is a real `lightning.Trainer` without logger, checkpoints, progress bar or summary;
  `timed_fit` runs ``fit`` and returns its wall seconds, optimizer steps and final ``val_acc``. Every fit's levers
  decide afresh (`fresh_decisions`): a benchmark times probes, so no decision is remembered from an earlier fit, and
  nothing is written to the user's cache.
- The table and JSON: `Column` and `table` print fixed-width text; `print_and_write` prints it and writes the JSON
  atomically; `quick_args` reads the ``--quick``, ``--out`` and ``--threads`` a fit-by-fit benchmark takes.

A benchmark is a script loaded by path (``python benchmarks/<name>.py``, or a test's ``load_benchmark``); it puts its
own directory on ``sys.path`` before ``from _harness import ...``.
"""

from __future__ import annotations

import argparse
import atexit
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import lightning as L
import torch
from torch import nn

from lightning_speedkit.report import write_json_atomic
from lightning_speedkit.timing import median_ms

__all__ = [
    "QUIET",
    "Column",
    "Fit",
    "alternated",
    "cell",
    "fixed_batch",
    "fresh_decisions",
    "inference_step",
    "interleaved",
    "interleaved_ms",
    "print_and_write",
    "quiet_trainer",
    "rotated",
    "sync",
    "table",
    "timed_fit",
    "torch_threads",
    "train_step",
]

K = TypeVar("K")
T = TypeVar("T")

# ---------------------------------------------------------------------------------------------- the timed step


def sync(device: torch.device | str) -> None:
    """Wait for the device's queued work (CUDA); a CPU has none."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def fixed_batch(batch: int, crop: int, classes: int = 10, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch`` random 3 x ``crop`` x ``crop`` images and labels, the same for every setting that sees them."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 3, crop, crop, generator=generator)
    return x, torch.randint(0, classes, (batch,), generator=generator)


def train_step(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, autocast: torch.dtype | None = None
) -> Callable[[], None]:
    """One training step of ``model`` on ``(x, y)``: forward, cross-entropy, backward, AdamW (lr 1e-3).

    ``autocast``: the dtype of mixed precision (``torch.bfloat16``...) on ``x``'s device, or None for full precision.
    The step waits for the device before it returns.
    """
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.train()

    def step() -> None:
        with torch.autocast(x.device.type, dtype=autocast) if autocast is not None else nullcontext():
            loss = nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        sync(x.device)

    return step


def inference_step(model: nn.Module, x: torch.Tensor) -> Callable[[], None]:
    """One forward pass of ``model`` in eval mode under ``torch.inference_mode``; it waits for the device."""
    model.eval()

    def infer() -> None:
        with torch.inference_mode():
            model(x)
        sync(x.device)

    return infer


# ---------------------------------------------------------------------------------------------- interleaved rounds


def interleaved(
    runs: Mapping[K, Callable[[], object]], rounds: int, time_one: Callable[[Callable[[], object]], float]
) -> dict[K, list[float]]:
    """Each round times every run once, in order (A, B, A, B ...); every run's figures, one per round.

    Example:
        >>> calls = []
        >>> per_round = interleaved({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, 2,
        ...                         lambda run: float(run() or 1))
        >>> calls, per_round
        (['a', 'b', 'a', 'b'], {'a': [1.0, 1.0], 'b': [1.0, 1.0]})
    """
    figures: dict[K, list[float]] = {key: [] for key in runs}
    for _ in range(rounds):
        for key, run in runs.items():
            figures[key].append(time_one(run))
    return figures


def interleaved_ms(
    runs: Mapping[K, Callable[[], object]], rounds: int, repeats: int, warmup: int = 2
) -> dict[K, float]:
    """Median ms per call of each run over ``rounds`` interleaved rounds.

    In each round a run's figure is the median of ``repeats`` calls after ``warmup`` untimed ones; the result is the
    median of those figures over the rounds.
    """
    per_round = interleaved(runs, rounds, lambda run: median_ms(run, repeats=repeats, warmup=warmup))
    return {key: statistics.median(values) for key, values in per_round.items()}


def alternated(items: Sequence[T], index: int) -> tuple[T, ...]:
    """``items`` in order on even ``index``, reversed on odd: which runs first alternates.

    Example:
        >>> alternated(("plain", "preset"), 1)
        ('preset', 'plain')
    """
    return tuple(items) if index % 2 == 0 else tuple(reversed(items))


def rotated(items: Sequence[T], index: int) -> tuple[T, ...]:
    """``items`` rotated left by ``index``: each takes its turn first.

    Example:
        >>> rotated(("a", "b", "c"), 4)
        ('b', 'c', 'a')
    """
    shift = index % len(items)
    return tuple(items[shift:]) + tuple(items[:shift])


# ---------------------------------------------------------------------------------------------- the timed fit

QUIET: dict[str, Any] = {
    "logger": False,
    "enable_checkpointing": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
}
"""The Trainer options every benchmark fit shares: nothing written, nothing printed but the benchmark's own lines."""


_DECISIONS: Path | None = None
"""This process's decisions directory: one at a time, removed when the next is made and at exit."""


def _remove_decisions() -> None:
    if _DECISIONS is not None:
        shutil.rmtree(_DECISIONS, ignore_errors=True)


@contextmanager
def torch_threads(threads: int | None) -> Iterator[None]:
    """Torch's intra-op threads set to ``threads`` (None: as they are) inside, put back after."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads or previous)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def fresh_decisions() -> Path:
    """Point lever memory (``SPEEDKIT_DECISIONS_DIR``) at a new empty directory: the next fit's levers probe afresh.

    A benchmark compares probing with not probing, or times a lever's decision: a decision remembered from the fit
    before would stand in for the probe being measured (`lightning_speedkit.trials.memory`). The directory before is
    removed, and the last one at exit.
    """
    global _DECISIONS
    if _DECISIONS is not None:
        shutil.rmtree(_DECISIONS, ignore_errors=True)
    else:
        atexit.register(_remove_decisions)
    _DECISIONS = Path(tempfile.mkdtemp(prefix="speedkit-bench-decisions-"))
    os.environ["SPEEDKIT_DECISIONS_DIR"] = str(_DECISIONS)
    return _DECISIONS


def quiet_trainer(device: torch.device | str = "cpu", **kwargs: Any) -> L.Trainer:
    """A `lightning.Trainer` on ``device``'s accelerator with `QUIET`'s options; ``kwargs`` add to or override them.

    Its levers decide afresh (`fresh_decisions`).
    """
    fresh_decisions()
    accelerator = "gpu" if torch.device(device).type == "cuda" else "cpu"
    return L.Trainer(**{"accelerator": accelerator, **QUIET, **kwargs})


class StepTimes(L.Callback):
    """The seconds between consecutive training batch ends."""

    def __init__(self) -> None:
        self.ends: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        """Note the time."""
        self.ends.append(time.perf_counter())

    def median_ms(self) -> float | None:
        """The median step in milliseconds (None before two batches ended)."""
        gaps = [b - a for a, b in zip(self.ends, self.ends[1:], strict=False)]
        return round(1000 * statistics.median(gaps), 3) if gaps else None


@dataclass(frozen=True)
class Fit:
    """One timed ``Trainer.fit``: its wall seconds, the optimizer steps taken and the last ``val_acc`` logged."""

    seconds: float
    steps: int
    val_acc: float | None


def timed_fit(trainer: L.Trainer, model: L.LightningModule, data: Any = None) -> Fit:
    """``trainer.fit(model, data)`` (a DataModule, a DataLoader, or None for the model's own), timed from the call.

    Everything the fit does (setup, a lever's probe, validation) is in its seconds.
    """
    start = time.perf_counter()
    trainer.fit(model, data)
    seconds = time.perf_counter() - start
    val_acc = trainer.callback_metrics.get("val_acc")
    return Fit(seconds, trainer.global_step, None if val_acc is None else float(val_acc))


# ---------------------------------------------------------------------------------------------- the table and JSON


def cell(value: Any, spec: str = "", width: int = 0, align: str = ">", suffix: str = "") -> str:
    """``value`` formatted by ``spec`` with ``suffix``, aligned in ``width`` characters; None is ``-``.

    Example:
        >>> cell(1.234, ".2f", 7, suffix="x"), cell(None, ".2f", 7), cell("NCHW", width=6, align="<")
        ('  1.23x', '      -', 'NCHW  ')
    """
    text = "-" if value is None else f"{value:{spec}}{suffix}"
    return f"{text:{align}{width}}"


@dataclass(frozen=True)
class Column:
    """A table column: ``header``, ``width``, the row's ``value`` (a key or a function of the row), its format.

    ``spec`` is the format spec of the value (``".2f"``), ``suffix`` follows it (``"x"``, ``"%"``) inside the width,
    and ``align`` is ``">"`` (numbers) or ``"<"`` (names); header and cells align alike. A missing value is ``-``.
    """

    header: str
    width: int
    value: str | Callable[[Mapping[str, Any]], Any]
    spec: str = ""
    align: str = ">"
    suffix: str = ""

    def of(self, row: Mapping[str, Any]) -> str:
        """This column's cell of ``row``."""
        value = self.value(row) if callable(self.value) else row.get(self.value)
        return cell(value, self.spec, self.width, self.align, self.suffix)


def table(columns: Sequence[Column], rows: Iterable[Mapping[str, Any]], sep: str = "", rule: bool = False) -> str:
    """A header line and one line per row, the columns joined by ``sep``; ``rule`` draws dashes under the header.

    Example:
        >>> print(table([Column("model", 6, "model", align="<"), Column("ms", 6, "ms", ".1f")], [{"model": "mlp",
        ...             "ms": 2.25}, {"model": "cnn"}], rule=True))
        model     ms
        ------------
        mlp      2.2
        cnn        -
    """
    header = sep.join(f"{c.header:{c.align}{c.width}}" for c in columns)
    lines = [header, "-" * len(header)] if rule else [header]
    lines += [sep.join(c.of(row) for c in columns) for row in rows]
    return "\n".join(lines)


def print_and_write(text: str, result: Any, out: str | Path) -> Path:
    """Print ``text`` (the tables), write ``result`` as JSON to ``out`` atomically and say where; the path."""
    print(text)
    path = write_json_atomic(result, out)
    print(f"wrote {out}")
    return path


def quick_args(argv: list[str] | None, doc: str, default_out: Path, quick_help: str) -> tuple[bool, Path, int]:
    """``(quick, out, threads)`` from ``--quick``, ``--out`` and ``--threads`` (torch threads, 1 by default).

    ``out`` is ``--out``, else ``default_out``, but with ``--quick`` a new temporary directory, so a smoke run never
    writes over the committed result.
    """
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=quick_help)
    parser.add_argument("--out", default=None, help=f"the JSON (default {default_out}; with --quick a temp dir)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    args = parser.parse_args(argv)
    out = args.out or (Path(tempfile.mkdtemp()) / default_out.name if args.quick else default_out)
    return args.quick, Path(out), args.threads


class LossRecorder(L.Callback):
    """Every training step's loss, in ``values``."""

    def __init__(self) -> None:
        self.values: list[float] = []

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.values.append(float(loss.detach()))
