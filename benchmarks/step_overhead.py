"""What preset()'s callbacks cost a training step: instructions per step, counted, on a step of little else.

The workload is a fit of one 4x2 linear layer on 64-sample batches of an in-memory tensor dataset, so a step is
Lightning's loop, the loader and the callbacks. Wall time on a shared 2-core machine moves by 20-30% from fit to fit,
more than the callbacks cost; Valgrind's callgrind counts the instructions the process executes instead, which the
machine's load does not move. Each variant is fitted for 200 and for 1,200 steps in its own process under callgrind;
the difference over the 1,000 extra steps is its instructions per step (imports, setup and teardown cancel out).

Variants: ``plain`` (a plain Trainer, logger, checkpointing, progress bar and summary off) and ``preset``
(``speedkit.preset()`` with the same options and ``tune_data=False``: the loader probe's workers are other processes,
and their start-up is a one-off cost, not a per-step one). ``--code LABEL=DIR`` adds ``preset`` as run by another
checkout of the package (for example a worktree of an earlier commit), for a before-and-after.

    python benchmarks/step_overhead.py                     # about 20 minutes (Valgrind); 2 variants
    python benchmarks/step_overhead.py --code before=/tmp/old   # and preset from the checkout in /tmp/old
    python benchmarks/step_overhead.py --quick             # one short wall-clock fit of each, for the tests
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if str(Path(__file__).resolve().parent) not in sys.path:  # _harness, also when a test loads this file by path
    sys.path.append(str(Path(__file__).resolve().parent))

from _harness import print_and_write

DEFAULT_OUT = Path(__file__).parent / "results" / "step_overhead.json"
STEPS = (200, 1200)


def fit(kind: str, steps: int) -> float:
    """One fit of ``steps`` steps (``kind`` plain or preset); its wall seconds (the child process's work)."""
    import warnings

    warnings.filterwarnings("ignore")
    import lightning as L
    import torch
    from _harness import QUIET, fresh_decisions, quiet_trainer
    from torch.utils.data import DataLoader, TensorDataset

    import lightning_speedkit as speedkit

    class Linear(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 2)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return torch.nn.functional.cross_entropy(self.layer(batch[0]), batch[1])

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64 * steps, 4, generator=generator), torch.randint(0, 2, (64 * steps,)))
    loader = DataLoader(data, batch_size=64, shuffle=True)
    options: dict[str, Any] = {"max_epochs": 1, "num_sanity_val_steps": 0, "limit_val_batches": 0}
    with tempfile.TemporaryDirectory(prefix="speedkit-step-overhead-") as root:
        options["default_root_dir"] = root
        if kind == "plain":
            trainer = quiet_trainer("cpu", devices=1, **options)
        else:
            fresh_decisions()
            trainer = speedkit.preset(verbose=False, tune_data=False, **QUIET, **options)
        started = time.perf_counter()
        trainer.fit(Linear(), loader)
        return time.perf_counter() - started


def _child(kind: str, steps: int, code: str | None, valgrind: bool) -> dict[str, Any]:
    env = dict(os.environ)  # the child's levers decide afresh: `fit` points their memory at a new directory
    if code:
        env["PYTHONPATH"] = code
    command = [sys.executable, __file__, "--child", kind, str(steps)]
    if valgrind:
        command = ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", *command]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    counted = re.search(r"Collected\s*:\s*(\d+)", done.stderr)
    seconds = re.search(r"fit_s=([0-9.]+)", done.stdout)
    return {
        "instructions": int(counted.group(1)) if counted else None,
        "fit_s": float(seconds.group(1)) if seconds else None,
    }


def run(quick: bool = False, codes: dict[str, str] | None = None, out: str | Path = DEFAULT_OUT) -> dict[str, Any]:
    """Fit every variant at both lengths, print the instructions per step, write the JSON."""
    valgrind = not quick and shutil.which("valgrind") is not None
    if not quick and not valgrind:
        raise SystemExit("step_overhead: needs valgrind (callgrind) to count instructions; --quick runs without it")
    variants: list[tuple[str, str, str | None]] = [("plain", "plain", None), ("preset", "preset", None)]
    variants += [(f"preset ({label})", "preset", path) for label, path in (codes or {}).items()]
    lengths = (8, 16) if quick else STEPS
    rows = []
    for name, kind, code in variants:
        runs = {steps: _child(kind, steps, code, valgrind) for steps in lengths}
        row: dict[str, Any] = {"variant": name, "code": code or "this checkout", "runs": runs}
        if valgrind:
            short, long = (runs[s]["instructions"] for s in lengths)
            row["instructions_per_step"] = (long - short) / (lengths[1] - lengths[0])
        rows.append(row)
        print(f"{name:<24} " + "  ".join(f"{s} steps: {r}" for s, r in runs.items()), flush=True)
    result: dict[str, Any] = {"settings": {"quick": quick, "valgrind": valgrind, "steps": list(lengths)}, "rows": rows}
    lines = []
    if valgrind:
        plain = rows[0]["instructions_per_step"]
        for row in rows:
            row["over_plain"] = row["instructions_per_step"] - plain
            lines.append(
                f"{row['variant']:<24} {row['instructions_per_step'] / 1e3:8.0f}k instructions a step"
                f"  ({row['over_plain'] / 1e3:+.0f}k, {row['over_plain'] / plain:+.1%} over plain)"
            )
    print_and_write("\n".join(lines) or "quick: no counts", result, out)
    return result


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short wall-clock fits, no valgrind (for the tests)")
    parser.add_argument("--code", action="append", default=[], help="LABEL=DIR: also preset from this checkout")
    parser.add_argument("--out", default=str(DEFAULT_OUT), help="where to write the JSON results")
    parser.add_argument("--child", nargs=2, metavar=("KIND", "STEPS"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(f"fit_s={fit(args.child[0], int(args.child[1]))}")
        return None
    codes = dict(item.split("=", 1) for item in args.code)
    return run(quick=args.quick, codes=codes, out=args.out)


if __name__ == "__main__":
    main()
