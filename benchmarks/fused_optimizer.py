"""FusedOptimizer: the whole fit with and without it, beside the training step with torch's default and fused update.

End to end, for each ``lr_tasks`` workload at its right LR (an SGD MLP, an Adam conv net, an AdamW transformer and the
demo's AdamW ResNet): a plain Trainer against the same Trainer with ``FusedOptimizer()`` added (its probe included,
deciding afresh each time), five times in alternating order, on the same data, seed and epochs (the ``lr_tasks``
budgets: the demo's 420 steps are the fewest that repay the lever's probe); the fit's
seconds, its final ``val_acc`` and what the lever decided. Narrower, for the same models: the median milliseconds of a
training step (forward, backward, update) with torch's default update and with ``fused=True``, interleaved rounds
from the same weights on one batch.

    python benchmarks/fused_optimizer.py --threads 1          # about 8 minutes on 2 CPU cores
    python benchmarks/fused_optimizer.py --quick              # seconds: a smoke run for the tests
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import torch

from lightning_speedkit import FusedOptimizer
from lightning_speedkit.demo.run import Timeline
from lightning_speedkit.fused import set_fused
from lightning_speedkit.report import machine_and_load

if str(Path(__file__).resolve().parent) not in sys.path:  # _harness, also when a test loads this file by path
    sys.path.append(str(Path(__file__).resolve().parent))

from _harness import Column, alternated, interleaved_ms, print_and_write, quiet_trainer, table, torch_threads
from lr_tasks import QUICK_SIZES, TASKS, Task, peak_acc

DEFAULT_OUT = Path(__file__).parent / "results" / "fused_optimizer.json"


WORKLOADS = ("mlp", "conv", "transformer", "demo")
"""The ``lr_tasks`` workloads timed here (those of the committed results; ``lr_tasks``' later ``conv_bn`` is not)."""


def _settings(quick: bool) -> tuple[dict[str, Task], dict[str, Any]]:
    if quick:
        tasks = {n: dataclasses.replace(TASKS[n], max_epochs=1, samples=QUICK_SIZES[n][1]) for n in WORKLOADS}
        return tasks, {"quick": True, "repeats": 1, "rounds": 1, "step_repeats": 3}
    return {n: TASKS[n] for n in WORKLOADS}, {"quick": False, "repeats": 5, "rounds": 5, "step_repeats": 20}


# ---------------------------------------------------------------------------------------------- the step alone


def _optimizer(model: L.LightningModule, fused: bool) -> torch.optim.Optimizer:
    """The model's own optimizer (its ``configure_optimizers``), switched to the fused update as the lever does."""
    optimizer = model.configure_optimizers()
    set_fused(optimizer.param_groups, fused)
    return optimizer  # type: ignore[no-any-return]


def _step(model: L.LightningModule, optimizer: torch.optim.Optimizer, batch: list[torch.Tensor]) -> Callable[[], None]:
    def step() -> None:
        loss = model.training_step(batch, 0)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    return step


def step_times(task: Task, root: Path, rounds: int, repeats: int) -> dict[str, Any]:
    """Median ms of one training step of ``task``'s model with the default and the fused update (same batch)."""
    data = task.make_data(task, 0, root)
    data.prepare_data()
    data.setup("fit")
    batch = list(next(iter(data.train_dataloader())))
    L.seed_everything(0, verbose=False)
    default = task.make_model(task, task.right_lr)
    fused = copy.deepcopy(default)
    default.log = fused.log = lambda *args, **kwargs: None  # type: ignore[method-assign]  # no Trainer attached
    runs = {
        "default": _step(default, _optimizer(default, False), batch),
        "fused": _step(fused, _optimizer(fused, True), batch),
    }
    ms = interleaved_ms(runs, rounds, repeats)
    tensors = sum(1 for p in default.parameters() if p.requires_grad)
    row = {"task": task.name, "optimizer": task.optimizer, "param_tensors": tensors}
    return row | {f"{k}_ms": v for k, v in ms.items()} | {"speedup": ms["default"] / ms["fused"]}


# ---------------------------------------------------------------------------------------------- the whole fit


def fit_once(task: Task, variant: str, root: Path) -> dict[str, Any]:
    """One fit of ``task`` at its right LR, plain or with ``FusedOptimizer()``; its seconds, val_acc and decision."""
    data = task.make_data(task, 0, root)
    L.seed_everything(0, verbose=False)
    model = task.make_model(task, task.right_lr)
    timeline, lever = Timeline(verbose=False), FusedOptimizer(remember=False)
    callbacks: list[L.Callback] = [timeline] + ([lever] if variant == "fused_optimizer" else [])
    trainer = quiet_trainer(max_epochs=task.max_epochs, num_sanity_val_steps=0, callbacks=callbacks,
                            default_root_dir=str(root / "fits"))  # fmt: skip
    timeline.start()
    start = time.perf_counter()
    trainer.fit(model, data)
    seconds = time.perf_counter() - start
    record: dict[str, Any] = {"task": task.name, "variant": variant, "fit_s": seconds, "steps": trainer.global_step}
    record["final_val_acc"] = timeline.points[-1]["val_acc"] if timeline.points else None
    record["peak_val_acc"] = peak_acc(timeline.points)
    if variant == "fused_optimizer":
        report = lever.report()
        keys = ("decision", "reason", "probe_s", "step_ms", "fused_groups")
        record["lever"] = {k: report.get(k) for k in keys}
    return record


def summarise(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per task: the median fit seconds of each variant, their ratio, and the decisions the lever made."""
    rows = []
    for name in dict.fromkeys(r["task"] for r in runs):
        plain = [r["fit_s"] for r in runs if r["task"] == name and r["variant"] == "plain"]
        fused = [r for r in runs if r["task"] == name and r["variant"] == "fused_optimizer"]
        row: dict[str, Any] = {"task": name, "plain_s": statistics.median(plain)}
        row["fused_optimizer_s"] = statistics.median(r["fit_s"] for r in fused)
        row["speedup"] = row["plain_s"] / row["fused_optimizer_s"]
        row["decisions"] = "/".join(str(r["lever"]["decision"]) for r in fused)
        rows.append(row)
    return rows


def run(quick: bool = False, out: str | Path = DEFAULT_OUT, threads: int | None = None) -> dict[str, Any]:
    """Time every step and fit, print the tables and write the JSON."""
    with torch_threads(threads):
        tasks, settings = _settings(quick)
        settings["torch_threads"] = torch.get_num_threads()
        root = Path(tempfile.mkdtemp(prefix="speedkit-fused-"))
        load_before, started = os.getloadavg(), time.perf_counter()
        try:
            steps = [step_times(task, root, settings["rounds"], settings["step_repeats"]) for task in tasks.values()]
            runs = [fit_once(task, variant, root)
                    for task in tasks.values() for index in range(settings["repeats"])
                    for variant in alternated(("plain", "fused_optimizer"), index)]  # fmt: skip
        finally:
            shutil.rmtree(root, ignore_errors=True)
    result: dict[str, Any] = {"settings": settings, **machine_and_load(load_before)}
    result |= {"wall_s": time.perf_counter() - started, "steps": steps, "runs": runs, "fits": summarise(runs)}
    print_and_write(format_tables(result), result, out)
    return result


def format_tables(result: dict[str, Any]) -> str:
    """The whole fits with and without the lever, then the step alone."""
    fits = [
        Column("task", 12, "task", align="<"),
        Column("plain s", 9, "plain_s", ".2f"),
        Column("+lever s", 9, "fused_optimizer_s", ".2f"),
        Column("speed-up", 9, "speedup", ".2f", suffix="x"),
        Column("decided", 28, "decisions", align="<"),
    ]
    steps = [
        Column("task", 12, "task", align="<"),
        Column("optimizer", 10, "optimizer", align="<"),
        Column("tensors", 8, "param_tensors"),
        Column("default ms", 11, "default_ms", ".2f"),
        Column("fused ms", 9, "fused_ms", ".2f"),
        Column("speed-up", 9, "speedup", ".2f", suffix="x"),
    ]
    lines = ["whole fit, median of the repeats (the lever's probe included):", table(fits, result["fits"], sep=" ")]
    lines += ["", "one training step (forward, backward, update), median:", table(steps, result["steps"], sep=" ")]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tiny run for smoke tests")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (1 on a busy shared machine)")
    parser.add_argument("--out", default=str(DEFAULT_OUT), help="where to write the JSON results")
    args = parser.parse_args(argv)
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)  # no device banner for each fit
    return run(quick=args.quick, out=args.out, threads=args.threads)


if __name__ == "__main__":
    main()
