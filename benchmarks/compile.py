"""torch.compile on this CPU: eager against compiled for the demo model, per step and end to end, compile included.

- ``per step``: median milliseconds of a full training step (forward, loss, backward, AdamW) of the demo ResNet at
  batch 32, eager and compiled in place (inductor), from the same weights on the same batch, in interleaved rounds,
  and the seconds of the first compiled call (the compile, cold in this process);
- ``end to end``: whole fits of the demo (DemoClassifier, packed-cache DemoDataModule, batch 32) for a short and a
  long budget: plain eager, plain compiled (``model.compile()``, every compile paid), twice each in alternating order
  (the faster of the two counts: another job on a shared machine only slows a fit down), and once with `Compile()`
  deciding (its probe paid). Each fit runs in a fresh process with an empty inductor cache, as a user's first run
  would, so the compiler's start-up is paid where it is paid in real life. Beside each budget: which plain fit was
  faster, what `Compile()` decided and why, whether the two agree, and from how many steps left the callback's own
  probe would have kept the compiled module. The load average is recorded: on a busy 2-core machine two OpenMP
  threads that wait for each other make single steps 10x slower, and such a run says little.

    python benchmarks/compile.py            # about five minutes on 2 idle CPU cores (more on a busy machine)
    python benchmarks/compile.py --quick    # seconds: a smoke run for the tests (in process, dynamo's eager backend)
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch

from lightning_speedkit import Compile
from lightning_speedkit.demo import DemoClassifier, DemoDataModule, DemoResNet
from lightning_speedkit.hardware import cpu_info
from lightning_speedkit.report import write_json_atomic

if str(Path(__file__).resolve().parent) not in sys.path:  # _harness, also when a test loads this file by path
    sys.path.append(str(Path(__file__).resolve().parent))

from _harness import Column, fixed_batch, interleaved_ms, print_and_write, quiet_trainer, table, timed_fit, train_step

DEFAULT_OUT = Path(__file__).parent / "results" / "compile.json"
KINDS = ("eager", "compiled", "Compile")


def _settings(quick: bool) -> dict[str, Any]:
    if quick:
        return {"rounds": 1, "repeats": 2, "batch": 8, "width": 4, "image": 18, "images": 40, "backend": "eager",
                "budgets": {"short": 1, "long": 2}, "isolated": False, "repeat": False}  # fmt: skip
    return {"rounds": 3, "repeats": 8, "batch": 32, "width": 16, "image": 64, "images": 960, "backend": "inductor",
            "budgets": {"short": 2, "long": 30}, "isolated": True, "repeat": True}  # fmt: skip


def per_step(s: dict[str, Any]) -> dict[str, Any]:
    """Median ms per training step eager and compiled (interleaved rounds), and the first compiled call's seconds."""
    x, y = fixed_batch(s["batch"], s["image"] * 7 // 8)
    torch.manual_seed(0)
    eager = DemoResNet(width=s["width"])
    compiled = copy.deepcopy(eager)
    compiled.compile(backend=s["backend"])
    runs = {"eager": train_step(eager, x, y), "compiled": train_step(compiled, x, y)}
    start = time.perf_counter()
    runs["compiled"]()
    first_call_s = time.perf_counter() - start
    ms = interleaved_ms(runs, s["rounds"], s["repeats"])
    return {
        "eager_ms": ms["eager"],
        "compiled_ms": ms["compiled"],
        "speedup": ms["eager"] / ms["compiled"],
        "first_compiled_call_s": first_call_s,
    }


class _CompileSeconds(L.Callback):
    """Seconds dynamo spends compiling during the fit (its compile start/end callbacks)."""

    def __init__(self) -> None:
        self.seconds, self._started = 0.0, 0.0
        from torch._dynamo.callback import callback_handler

        callback_handler.register_start_callback(self._start)
        callback_handler.register_end_callback(self._end)

    def _start(self, args: Any) -> None:
        self._started = time.perf_counter()

    def _end(self, args: Any) -> None:
        self.seconds += time.perf_counter() - self._started

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        from torch._dynamo.callback import callback_handler

        callback_handler.remove_start_callback(self._start)
        callback_handler.remove_end_callback(self._end)


def fit_once(kind: str, epochs: int, s: dict[str, Any], root: str) -> dict[str, Any]:
    """One whole fit of the demo: ``eager``, ``compiled`` (compiled in place before fit) or under ``Compile()``."""
    L.seed_everything(0, verbose=False)
    datamodule = DemoDataModule(
        num_images=s["images"], image_size=s["image"], batch_size=s["batch"], root=root, cache=True
    )
    model = DemoClassifier(width=s["width"], crop_size=datamodule.crop_size)
    watch = _CompileSeconds()
    callbacks: list[L.Callback] = [watch]
    tuner = Compile(backend=s["backend"]) if kind == "Compile" else None
    if tuner is not None:
        callbacks.append(tuner)
    if kind == "compiled":
        model.compile(backend=s["backend"])
    fit = timed_fit(quiet_trainer(max_epochs=epochs, callbacks=callbacks), model, datamodule)
    row: dict[str, Any] = {"kind": kind, "epochs": epochs, "fit_s": fit.seconds}
    row.update(steps=fit.steps, compile_s=watch.seconds, val_acc=fit.val_acc)
    if tuner is not None:
        report = tuner.report()
        row["report"] = {k: v for k, v in report.items() if k != "trials"}
    return row


def _isolated(kind: str, epochs: int, s: dict[str, Any], root: str) -> dict[str, Any]:
    """`fit_once` in a fresh Python process with an empty inductor cache (a user's first run)."""
    with tempfile.TemporaryDirectory(prefix="speedkit-inductor-") as cache, tempfile.TemporaryDirectory() as out:
        path = Path(out) / "row.json"
        command = [sys.executable, __file__, "--fit", kind, "--epochs", str(epochs), "--cache-dir", root]
        command += ["--row-out", str(path), "--settings", json.dumps(s)]
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
        subprocess.run(command, check=True, env=env, cwd=Path(__file__).parents[1], timeout=1800)
        return dict(json.loads(path.read_text()))


def end_to_end(s: dict[str, Any], root: str) -> list[dict[str, Any]]:
    """For each budget: plain eager and compiled fits twice each (alternating), one under `Compile()`; what they show.

    A plain fit's time is the faster of its two (another job on a shared machine only ever slows a fit down); the
    faster plain choice is the truth the callback's decision is set beside.
    """
    DemoDataModule(num_images=s["images"], image_size=s["image"], root=root, cache=True).setup("fit")  # build once
    fit = _isolated if s["isolated"] else fit_once
    rows = []
    for budget, epochs in s["budgets"].items():
        fits: dict[str, list[dict[str, Any]]] = {kind: [] for kind in KINDS}
        for kind in ("eager", "compiled", "Compile", "compiled", "eager")[: 5 if s["repeat"] else 3]:
            fits[kind].append(fit(kind, epochs, s, root))
        best = {kind: min(fits[kind], key=lambda row: row["fit_s"]) for kind in KINDS}
        faster = min(("eager", "compiled"), key=lambda kind: best[kind]["fit_s"])
        report = best["Compile"]["report"]
        ms = report.get("step_ms") or {}
        saved_ms = (ms.get("eager") or 0.0) - (ms.get("compiled") or math.inf)
        rows.append(
            {
                "budget": budget,
                "epochs": epochs,
                "steps": best["eager"]["steps"],
                "eager_fit_s": best["eager"]["fit_s"],
                "compiled_fit_s": best["compiled"]["fit_s"],
                "compiled_compile_s": best["compiled"]["compile_s"],
                "all_fit_s": {kind: [row["fit_s"] for row in rows_] for kind, rows_ in fits.items()},
                "faster": faster,
                "callback_fit_s": best["Compile"]["fit_s"],
                "decision": report["decision"],
                "reason": report["reason"],
                "decision_matches": report["decision"] == faster,
                # From the callback's own probe: the steps left from which it would keep the compiled module.
                "break_even_steps": report["cost_s"] / (saved_ms / 1e3)
                if saved_ms > 0 and "cost_s" in report
                else None,
                "callback": report,
                "val_acc": {kind: best[kind]["val_acc"] for kind in KINDS},
            }
        )
    return rows


def run(quick: bool = False, out: str | Path = DEFAULT_OUT, cache_dir: str | None = None) -> dict[str, Any]:
    """Measure, print the tables and write the JSON."""
    s = _settings(quick)
    root = cache_dir or tempfile.mkdtemp(prefix="speedkit-compile-")
    started, load_before = time.perf_counter(), os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="speedkit-inductor-") as cache:
        previous = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache  # the per-step compile is cold too
        try:
            steps = per_step(s)
        finally:
            if previous is None:
                os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
            else:
                os.environ["TORCHINDUCTOR_CACHE_DIR"] = previous
    budgets = end_to_end(s, root)
    cpu = cpu_info()
    result = {
        "settings": {"quick": quick, **s, "torch": torch.__version__, "torch_threads": torch.get_num_threads()},
        "cpu": {"model": cpu.model, "cores": cpu.available_cores},
        "per_step": steps,
        "budgets": budgets,
        "decisions_match": all(row["decision_matches"] for row in budgets),
        "benchmark_s": time.perf_counter() - started,
        # Other jobs on a shared machine slow every step (OpenMP threads wait for descheduled peers): judge by these.
        "load_average_1min": {"before": load_before[0], "after": os.getloadavg()[0]},
    }
    print_and_write(format_tables(result), result, out)
    return result


def format_tables(result: dict[str, Any]) -> str:
    """The per-step line and the end-to-end table as fixed-width text."""
    p, s = result["per_step"], result["settings"]
    lines = [
        f"per step (demo ResNet width {s['width']}, {s['image'] * 7 // 8} px, batch {s['batch']}): eager"
        f" {p['eager_ms']:.1f} ms, compiled {p['compiled_ms']:.1f} ms ({p['speedup']:.2f}x);"
        f" first compiled call {p['first_compiled_call_s']:.1f} s",
    ]
    columns = [
        Column("budget", 7, "budget", align="<"),
        Column("epochs", 7, "epochs"),
        Column("steps", 7, "steps"),
        Column("eager s", 9, "eager_fit_s", ".1f"),
        Column("compiled s", 12, "compiled_fit_s", ".1f"),
        Column("compile s", 11, "compiled_compile_s", ".1f"),
        Column("faster", 10, "faster"),
        Column("Compile() s", 13, "callback_fit_s", ".1f"),
        Column("decision", 10, "decision"),
        Column("agrees", 8, lambda r: "yes" if r["decision_matches"] else "NO"),
    ]
    lines += ["", table(columns, result["budgets"])]
    for r in result["budgets"]:
        lines.append(f"  {r['budget']}: Compile() {r['reason']}")
        if r["break_even_steps"] is not None:
            lines.append(f"    by its own probe it would compile with more than {r['break_even_steps']:.0f} steps left")
    load = result["load_average_1min"]
    lines.append(f"load average (1 min) before/after: {load['before']:.1f}/{load['after']:.1f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tiny run for smoke tests")
    parser.add_argument("--out", default=str(DEFAULT_OUT), help="where to write the JSON results")
    parser.add_argument("--cache-dir", default=None, help="where the demo images go (default: a temp dir)")
    parser.add_argument("--fit", choices=KINDS, help=argparse.SUPPRESS)  # one isolated fit (run by the benchmark)
    parser.add_argument("--epochs", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--settings", help=argparse.SUPPRESS)
    parser.add_argument("--row-out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.fit is not None:
        row = fit_once(args.fit, args.epochs, json.loads(args.settings), args.cache_dir)
        write_json_atomic(row, args.row_out)
        return row
    return run(quick=args.quick, out=args.out, cache_dir=args.cache_dir)


if __name__ == "__main__":
    main()
