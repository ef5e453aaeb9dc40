"""What the warmup's cool-down check sees: the training loss before the cool-down, on lr_tasks' small tasks.

For each task of `benchmarks/lr_tasks.py` (the MLP, the conv net, the transformer) at its user LRs of 10x too low,
right and 10x too high, and each seed, a plain fit at a constant LR (the trajectory `preset()` trains at the
user's LR until the cool-down) records every step's training loss. The window the check of
`lightning_speedkit.WarmupScheduler` would watch before a 20% cool-down (`lightning_speedkit.cooldown.check_window`)
is then judged by `lightning_speedkit.schedule.still_falling`: held (the loss still falls: the LR stays at its
peak) or cooled down. A run limited by its LR should be held; one limited by its noise (too high an LR) cooled down.

    python benchmarks/cooldown_check.py            # 27 fits, about 2 minutes on 2 cores
    python benchmarks/cooldown_check.py --quick    # a smoke run for the tests
"""

from __future__ import annotations

import dataclasses
import sys
import tempfile
from pathlib import Path
from typing import Any

import lightning as L
import torch

from lightning_speedkit.cooldown import check_window
from lightning_speedkit.hardware import cpu_info
from lightning_speedkit.schedule import fall, still_falling

if str(Path(__file__).resolve().parent) not in sys.path:  # _harness and lr_tasks, also when loaded by path
    sys.path.append(str(Path(__file__).resolve().parent))

from _harness import LossRecorder, print_and_write, quick_args, quiet_trainer
from lr_tasks import QUICK_SIZES, TASKS, Task

DEFAULT_OUT = Path(__file__).parent / "results" / "cooldown_check.json"
FACTORS = (0.1, 1.0, 10.0)
COOLDOWN = 0.2


def judge(losses: list[float]) -> dict[str, Any]:
    """The check's window of ``losses`` (a whole run's), and its verdict."""
    window = check_window(0, len(losses), COOLDOWN)
    if window is None:
        return {"steps": len(losses), "window": None, "held": False, "drop": 0.0, "z": 0.0}
    watched = losses[window[0] : window[1]]
    held, drop = still_falling(watched)
    return {"steps": len(losses), "window": list(window), "held": held, "drop": drop, "z": round(fall(watched)[0], 2)}


def _fit(task: Task, factor: float, seed: int, root: Path) -> list[float]:
    """Every training loss of a plain fit of ``task`` at ``factor`` x its right LR, as lr_tasks runs it."""
    data = task.make_data(task, seed, root)
    L.seed_everything(seed, verbose=False)  # the weights and batch order lr_tasks' fits get
    model = task.make_model(task, task.right_lr * factor)
    losses = LossRecorder()
    options = {"devices": 1, "max_epochs": task.max_epochs, "num_sanity_val_steps": 0}
    quiet_trainer("cpu", callbacks=[losses], **options).fit(model, data)
    return losses.values


def run(quick: bool = False, out: str | Path = DEFAULT_OUT, threads: int = 1) -> dict[str, Any]:
    torch.set_num_threads(threads)
    root = Path(tempfile.mkdtemp(prefix="cooldown_check-"))
    rows: list[dict[str, Any]] = []
    for name in ("mlp", "conv", "transformer"):
        task = TASKS[name]
        if quick:
            task = dataclasses.replace(task, max_epochs=QUICK_SIZES[name][0], samples=QUICK_SIZES[name][1])
        for factor in (1.0,) if quick else FACTORS:
            for seed in (0,) if quick else (0, 1, 2):
                rows.append({"task": name, "factor": factor, "seed": seed, **judge(_fit(task, factor, seed, root))})
    lines = [f"{'task':<12}{'user LR':>9}{'seed':>6}{'steps':>7}{'drop':>9}{'z':>8}  verdict"]
    for r in rows:
        verdict = "held" if r["held"] else "cooled down"
        cells = f"{r['task']:<12}{r['factor']:>8g}x{r['seed']:>6}{r['steps']:>7}{r['drop']:>+9.1%}{r['z']:>8.2f}"
        lines.append(f"{cells}  {verdict}")
    settings = {"quick": quick, "cooldown": COOLDOWN, "threads": threads}
    result = {"settings": settings, "machine": cpu_info().machine(), "rows": rows}
    print_and_write("\n".join(lines), result, out)
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    quick, out, threads = quick_args(argv, __doc__, DEFAULT_OUT, "one seed at the right LR, tiny budgets: a smoke run")
    return run(quick=quick, out=out, threads=threads)


if __name__ == "__main__":
    main()
