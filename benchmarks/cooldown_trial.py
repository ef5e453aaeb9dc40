"""Can a short trial at the cool-down's start tell a run limited by its LR from one limited by its noise?

For each task of `benchmarks/lr_tasks.py` at its user LRs of 10x too low, right and 10x too high (the demo task at
the right LR only), and each seed, a plain fit at a constant LR (the trajectory `preset()` trains at the user's LR
until the cool-down) stops where a 20% cool-down would begin. From that state, on the same `TRIAL_STEPS` batches:

- **the trial**: the held LR against the cool-down's mean LR (`lightning_speedkit.cooldown.TRIAL_COOLED`, a third of
  the peak: the mean of the `1 - sqrt` cool-down), each batch's loss taken before its update; the verdict is
  `lightning_speedkit.cooldown.trial_holds`: **hold** when, over the second half, the paired differences (held
  minus cooled, `paired_gap`) put the held LR's loss lower by more than 3 standard errors, else **cool down**.
- **the outcome**: the rest of the budget run twice on the same batches, once at the held LR and once under the
  cool-down `lightning_speedkit.WarmupScheduler` applies (`lightning_speedkit.schedule.warmup_factor`, ``"wsd"``),
  then ``val_acc`` on the validation set. The cool-down helped when its ``val_acc`` is the higher.

Beside the trial, the verdict of the cool-down check `WarmupScheduler(cooldown_check=True)` takes from the loss over
the steps before the cool-down (`lightning_speedkit.schedule.still_falling`), on the same fit. The continuations and
the trial are plain PyTorch loops over the model's forward (no Lightning hooks), so this measures the signal, not a
callback: research for a trial-based cool-down, not a decision the pack makes.

    python benchmarks/cooldown_trial.py --out benchmarks/results/avx512/cooldown_trial.json  # 30 cases, ~5 min
    python benchmarks/cooldown_trial.py --quick    # a smoke run for the tests (JSON to a temp dir)
"""

from __future__ import annotations

import copy
import dataclasses
import statistics
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F

from lightning_speedkit.cooldown import TRIAL_COOLED, TRIAL_Z, check_window, paired_gap, trial_holds
from lightning_speedkit.hardware import cpu_info
from lightning_speedkit.schedule import cooldown_start, still_falling, warmup_factor

if str(Path(__file__).resolve().parent) not in sys.path:  # _harness and lr_tasks, also when loaded by path
    sys.path.append(str(Path(__file__).resolve().parent))

from _harness import LossRecorder, print_and_write, quick_args, quiet_trainer
from lr_tasks import QUICK_SIZES, TASKS, Task

DEFAULT_OUT = Path(__file__).parent / "results" / "cooldown_trial.json"
FACTORS = (0.1, 1.0, 10.0)
COOLDOWN = 0.2
TRIAL_STEPS = 32


def _batches(dataset: Any, batch_size: int, count: int, seed: int) -> list[Any]:
    """``count`` batches of ``dataset`` in a seeded shuffled order over as many epochs as needed (augmentation too)."""
    torch.manual_seed(seed)  # a dataset's random augmentation draws from the global RNG
    loader = torch.utils.data.DataLoader(
        dataset, batch_size=batch_size, shuffle=True, generator=torch.Generator().manual_seed(seed)
    )

    def endless() -> Iterator[Any]:
        while True:
            yield from loader

    stream = endless()
    return [next(stream) for _ in range(count)]


def _train(
    model: L.LightningModule, state: dict[str, Any], batches: Sequence[Any], lrs: Sequence[float]
) -> list[float]:
    """From ``state`` (weights, optimizer), one step per batch at ``lrs[i]``: each batch's loss before its update."""
    model.load_state_dict(copy.deepcopy(state["model"]))
    model.train()
    optimizer = model.configure_optimizers()
    optimizer.load_state_dict(copy.deepcopy(state["optimizer"]))  # type: ignore[union-attr]
    losses = []
    for batch, lr in zip(batches, lrs, strict=True):
        for group in optimizer.param_groups:  # type: ignore[union-attr]
            group["lr"] = lr
        loss = F.cross_entropy(model(*batch[:-1]), batch[-1])
        losses.append(float(loss.detach()))
        optimizer.zero_grad()  # type: ignore[union-attr]
        loss.backward()
        optimizer.step()  # type: ignore[union-attr]
    return losses


@torch.no_grad()
def _val_acc(model: L.LightningModule, data: L.LightningDataModule) -> float:
    model.eval()
    right = total = 0
    for batch in data.val_dataloader():
        right += int((model(*batch[:-1]).argmax(-1) == batch[-1]).sum())
        total += len(batch[-1])
    return right / total


def run_case(task: Task, factor: float, seed: int, root: Path) -> dict[str, Any]:
    """One (task, user LR, seed): the plain fit to the cool-down, the trial, both continuations."""
    data = task.make_data(task, seed, root)
    data.prepare_data()
    data.setup("fit")
    L.seed_everything(seed, verbose=False)  # the weights and batch order lr_tasks' fits get
    lr = task.right_lr * factor
    model = task.make_model(task, lr)
    total = len(data.train_dataloader()) * task.max_epochs
    start = cooldown_start(0, total, COOLDOWN)
    losses = LossRecorder()
    options = {"devices": 1, "max_epochs": task.max_epochs, "max_steps": start, "num_sanity_val_steps": 0}
    quiet_trainer("cpu", callbacks=[losses], limit_val_batches=0, **options).fit(model, data)
    state = {
        "model": copy.deepcopy(model.state_dict()),
        "optimizer": copy.deepcopy(model.trainer.optimizers[0].state_dict()),
    }
    window = check_window(0, total, COOLDOWN)
    check = still_falling(losses.values[window[0] : window[1]])[0] if window is not None else False

    trial = _batches(data.train_set, task.batch_size, TRIAL_STEPS, seed + 1000)  # type: ignore[attr-defined]
    held = _train(model, state, trial, [lr] * len(trial))
    cooled = _train(model, state, trial, [lr * TRIAL_COOLED] * len(trial))
    mean, z = paired_gap(held, cooled)

    rest = _batches(data.train_set, task.batch_size, total - start, seed + 2000)  # type: ignore[attr-defined]
    _train(model, state, rest, [lr] * len(rest))
    held_acc = _val_acc(model, data)
    schedule = [lr * warmup_factor(step, 0, total, "wsd", cooldown=COOLDOWN) for step in range(start, total)]
    _train(model, state, rest, schedule)
    cooled_acc = _val_acc(model, data)
    verdict = "hold" if trial_holds(held, cooled) else "cool down"
    helped = cooled_acc > held_acc
    return {
        "task": task.name,
        "factor": factor,
        "seed": seed,
        "steps": total,
        "cooldown_start": start,
        "trial": {"held_minus_cooled": mean, "z": z, "verdict": verdict},
        "loss_check_holds": check,
        "outcome": {"held_val_acc": held_acc, "cooled_val_acc": cooled_acc, "cooldown_helped": helped},
    }


def summarise(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """How often each policy picked the better continuation, and the ``val_acc`` its verdicts lost against it.

    The policies: the trial, the loss check, always cooling down (`WarmupScheduler`'s default) and always holding;
    what a verdict lost is the gap to the better continuation (at most, and the mean over the cases).
    """
    verdicts = {
        "trial": [r["trial"]["verdict"] == "hold" for r in rows],
        "loss check": [bool(r["loss_check_holds"]) for r in rows],
        "always cool": [False for _ in rows],
        "always hold": [True for _ in rows],
    }
    policies = {}
    for policy, holds in verdicts.items():
        lost = []
        for row, hold in zip(rows, holds, strict=True):
            held, cooled = row["outcome"]["held_val_acc"], row["outcome"]["cooled_val_acc"]
            lost.append(max(held, cooled) - (held if hold else cooled))
        policies[policy] = {
            "agrees": sum(v == 0 for v in lost),
            "lost_max": round(max(lost), 4),
            "lost_mean": round(statistics.fmean(lost), 4),
        }
    return {"cases": len(rows), "policies": policies}


def run(quick: bool = False, out: str | Path = DEFAULT_OUT, threads: int = 1) -> dict[str, Any]:
    torch.set_num_threads(threads)
    root = Path(tempfile.mkdtemp(prefix="cooldown_trial-"))
    plan = [(name, factor) for name in ("mlp", "conv", "transformer") for factor in FACTORS] + [("demo", 1.0)]
    rows: list[dict[str, Any]] = []
    for name, factor in [("mlp", 1.0)] if quick else plan:
        task = TASKS[name]
        if quick:
            task = dataclasses.replace(task, max_epochs=QUICK_SIZES[name][0], samples=QUICK_SIZES[name][1])
        for seed in (0,) if quick else (0, 1, 2):
            rows.append(run_case(task, factor, seed, root))
    head = f"{'task':<12}{'user LR':>8}{'seed':>5}{'held-cooled':>13}{'z':>7}  {'trial':<10}{'loss check':<11}"
    lines = [head + f"{'val_acc held':>13}{'cooled':>8}  helped"]
    for r in rows:
        t, o = r["trial"], r["outcome"]
        check = "hold" if r["loss_check_holds"] else "cool down"
        cells = f"{r['task']:<12}{r['factor']:>7g}x{r['seed']:>5}{t['held_minus_cooled']:>+13.4f}{t['z']:>7.1f}"
        accs = f"{o['held_val_acc']:>13.3f}{o['cooled_val_acc']:>8.3f}"
        lines.append(f"{cells}  {t['verdict']:<10}{check:<11}{accs}  {o['cooldown_helped']}")
    summary = summarise(rows)
    for policy, figures in summary["policies"].items():
        lines.append(
            f"{policy:<12} agrees with the outcome in {figures['agrees']} of {len(rows)}; val_acc lost to it:"
            f" at most {figures['lost_max']:.3f}, mean {figures['lost_mean']:.4f}"
        )
    settings = {"quick": quick, "cooldown": COOLDOWN, "cooled": TRIAL_COOLED, "trial_steps": TRIAL_STEPS, "z": TRIAL_Z}
    result = {
        "settings": settings | {"threads": threads},
        "machine": cpu_info().machine(),
        "rows": rows,
        "summary": summary,
    }
    print_and_write("\n".join(lines), result, out)
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    quick, out, threads = quick_args(argv, __doc__, DEFAULT_OUT, "one seed of the MLP, a tiny budget: a smoke run")
    return run(quick=quick, out=out, threads=threads)


if __name__ == "__main__":
    main()
