"""GPU check: AMP vs fp32 with MFU, NVML readings, both batch-size finders against real CUDA OOM, INT8, compile.

One command; its parts run in order on one CUDA device with the embedded demo workload (DemoClassifier,
DemoDataModule):

0. data: the demo images, generated and packed (every part uses them).
1. precision: the same model trained for the same steps in ``32-true``, ``16-mixed``, ``16-mixed`` with
   `ChannelsLast`, ``bf16-mixed``, and `PrecisionTuner` choosing between ``16-mixed`` and ``bf16-mixed`` by timing
   them, on real demo batches kept on the GPU (whole batches only), so the rows measure compute, not decoding. Each
   row: samples/s between two ``torch.cuda.synchronize()`` after warm-up steps, peak memory, val_acc, MFU with the
   peak it divides by (TF32's for this conv net in ``32-true``: cuDNN runs its convolutions in TF32), and NVML's
   utilisation and power over the timed steps. The resident batches are released before part 2.
2. monitor: UtilizationMonitor with NVML readings on the naive pipeline (a JPEG decoded per sample, no workers), then
   on the decoded-image cache with `DataLoaderTuner`. A GPU whose NVML does not answer fails this part, saying why.
3. batch_size: speedkit's finder and Lightning's under a CUDA memory cap (``set_per_process_memory_fraction``) sized
   from one measured training step so that about a quarter of the dataset fits: both searches must run out of
   memory. Each row says whether its search did, with the first message, then trains and validates at the size found
   under the same cap. The loader workers are chosen after checking the free space in ``/dev/shm``.
4. int8: the ``16-mixed`` model of part 1 exported with `export_int8` (ONNX Runtime on the CPU).
5. compile: ``16-mixed`` eager, then compiled by `Compile` (inductor); last, as the slowest and least certain step.

Every part and row has a ``status`` (``ok``, ``partial``, ``failed``, ``timeout`` or ``skipped: <why>``) in the JSON,
which is written atomically when the run starts and after every row and part; an error is recorded with its
traceback and the next part runs. A watchdog ends the run within its time budget (8 minutes, 3 with ``--quick``),
marking the part it interrupted ``timeout``. Exit status: 0 when every part is ``ok`` or skipped, 1 when one is
not, 3 when the budget ran out.

    python benchmarks/gpu_check.py --out gpu_check.json              # one GPU: about 4-5 minutes, at most 8
    python benchmarks/gpu_check.py --quick --out gpu_check.json      # at most 3 minutes
    python3 benchmarks/gpu_check.py --out "$OUT/gpu_check.json"      # a lent machine brings back only $OUT
    python benchmarks/gpu_check.py --allow-cpu --quick --out /tmp/gpu_check.json   # rehearsal, no GPU needed

Without a CUDA device it prints ``skipped: no CUDA device``, writes that to the JSON and exits 0. ``--allow-cpu``
rehearses every part on the CPU instead, tiny and on one thread, with the CUDA-only steps marked skipped (the memory
cap becomes `MemoryLimit`, which raises a real ``torch.OutOfMemoryError``; compile uses ``aot_eager``).

The parts live beside this script: `_gpu_record` (statuses, the JSON, the watchdog), `_gpu_device`, `_gpu_resident`
(fits on resident batches), `_gpu_parts` (parts 1, 2, 4, 5) and `_gpu_oom` (part 3); the Trainer, the synchronised
step and the tables come from `_harness`, which every benchmark shares.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__":  # a lent machine has the checkout, not an installed package
    sys.path.insert(1, str(Path(__file__).resolve().parents[1]))
if str(Path(__file__).resolve().parent) not in sys.path:  # _harness and the parts, also when loaded by path
    sys.path.append(str(Path(__file__).resolve().parent))

import argparse
import tempfile
from collections.abc import Callable
from typing import Any

import torch
from _gpu_device import describe
from _gpu_oom import oom_part
from _gpu_parts import compile_part, int8_part, monitor_part, precision_part
from _gpu_record import MIN_PART_S, RunRecord, error_line, exit_code, passed
from _harness import Column, cell, table

from lightning_speedkit.demo import DemoDataModule
from lightning_speedkit.hardware import nvml_status
from lightning_speedkit.report import write_json_atomic

DEFAULT_OUT = Path(__file__).parent / "results" / "gpu_check.json"
SKIP_LINE = "skipped: no CUDA device"
PARTS = ("data", "precision", "monitor", "batch_size", "int8", "compile")
BUDGET_S = {"full": 480.0, "quick": 180.0}
MIN_COMPILE_S = 60.0  # inductor's first compile of the demo model's training step
CUDA_ONLY = [
    "bf16-mixed row",
    "peak memory",
    "NVML readings",
    "MFU (no peak for a CPU)",
    "memory cap (MemoryLimit stands in)",
    "per-sample memory measurement",
    "inductor (aot_eager stands in)",
]


def settings(quick: bool, cpu: bool = False) -> dict[str, Any]:
    """Sizes of each part; ``cpu`` is the rehearsal's (``--allow-cpu``): the same code, tiny."""
    if cpu:
        return {"num_images": 200, "image_size": 32, "width": 8, "batch": 16, "warmup": 2, "steps": 6,
                "monitor_steps": 12, "window": 4, "max_val": 128, "oom_epochs": 1, "calibration": 2,
                "max_workers": 1}  # fmt: skip
    if quick:
        return {"num_images": 2000, "image_size": 64, "width": 32, "batch": 128, "warmup": 10, "steps": 50,
                "monitor_steps": 30, "window": 10, "max_val": 16384, "oom_epochs": 1, "calibration": 8,
                "max_workers": 4}  # fmt: skip
    return {"num_images": 6000, "image_size": 64, "width": 64, "batch": 256, "warmup": 30, "steps": 180,
            "monitor_steps": 60, "window": 10, "max_val": 16384, "oom_epochs": 2, "calibration": 16,
            "max_workers": 8}  # fmt: skip


def run(
    quick: bool = False,
    out: str | Path = DEFAULT_OUT,
    allow_cpu: bool = False,
    budget_s: float | None = None,
    inject: str | None = None,
) -> dict[str, Any]:
    """Every part in order (or skip without CUDA), the JSON written as it goes; print the tables, return the result."""
    out, cuda = Path(out), torch.cuda.is_available()
    if not cuda and not allow_cpu:
        print(SKIP_LINE)
        write_json_atomic({"skipped": "no CUDA device", "torch": torch.__version__}, out)
        return {"skipped": "no CUDA device", "torch": torch.__version__}
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    s = settings(quick, cpu=not cuda)
    if not cuda:  # the rehearsal checks code paths, not speed: one thread cannot stall on busy shared cores
        torch.set_num_threads(1)
    budget = budget_s if budget_s is not None else BUDGET_S["quick" if quick else "full"]
    ok, detail = nvml_status()
    result: dict[str, Any] = {
        "status": "running",
        "quick": quick,
        "rehearsal": not cuda,
        "budget_s": budget,
        "device": describe(device),
        "nvml": {"ok": ok, "detail": detail},
        "settings": s,
        "cuda_only_skipped": [] if cuda else CUDA_ONLY,
        "parts": {name: {"status": "pending"} for name in PARTS},
    }
    print(f"gpu_check on {result['device'].get('name', 'the CPU (rehearsal)')}: budget {budget:.0f} s, JSON {out}")
    print(f"NVML: {detail}" if ok else f"NVML UNAVAILABLE: {detail}", flush=True)
    record, keep = RunRecord(result, out, budget, table=format_table), {}
    record.save()
    record.timer.start()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp)
            data = DemoDataModule(s["num_images"], s["image_size"], batch_size=s["batch"], cache=True)
            parts: list[tuple[str, Callable[[dict[str, Any]], None], float]] = [
                ("data", lambda e: _data_part(e, data), MIN_PART_S),
                ("precision", lambda e: precision_part(e, record, s, device, root, data, keep), MIN_PART_S),
                ("monitor", lambda e: monitor_part(e, record, s, device, root), MIN_PART_S),
                ("batch_size", lambda e: oom_part(e, record, s, device, root), MIN_PART_S),
                ("int8", lambda e: int8_part(e, s, data, root / "int8", keep), MIN_PART_S),
                ("compile", lambda e: compile_part(e, record, s, device, root, data), MIN_COMPILE_S if cuda else 0),
            ]
            for name, body, min_s in parts:
                if name != "data" and result["parts"]["data"]["status"] != "ok":
                    result["parts"][name]["status"] = "skipped: no data"
                    continue
                record.part(name, body, inject, min_s)
    finally:
        record.timer.cancel()
    result["status"] = "ok" if all(passed(p["status"]) for p in result["parts"].values()) else "failed"
    record.save()
    try:
        print(format_table(result))
    except Exception as exc:  # the JSON is written: a table that cannot be printed must not hide it
        print(f"(no table: {error_line(exc)})")
    print(f"gpu_check: {result['status']}; wrote {out}", flush=True)
    return result


def _data_part(entry: dict[str, Any], data: DemoDataModule) -> None:
    """Part 0: the demo images generated (once per cache directory) and split; every later part needs them."""
    data.prepare_data()
    data.setup("fit")
    entry.update(num_images=data.num_images, image_size=data.image_size, crop_size=data.crop_size)


# ---------------------------------------------------------------------------------------------- the tables


def _pct(key: str) -> Callable[[dict[str, Any]], float | None]:
    return lambda row: None if row.get(key) is None else 100 * row[key]


def _nvml_cell(row: dict[str, Any]) -> str:
    nvml = row.get("nvml") or {}
    return "nvml" if nvml.get("sampler", "NvmlSampler") == "NvmlSampler" and nvml.get("ok") else "no-nvml"


def _first_oom(row: dict[str, Any]) -> str:
    return f"  {(row['first_oom'] or {}).get('message', 'none')[:60]}; {row['after_search']}"


TIMED = [
    Column("samples/s", 11, "samples_per_s", ",.0f"),
    Column("step ms", 9, "step_ms", ".2f"),
    Column("vs fp32", 9, "speedup_vs_fp32", ".2f"),
    Column("peak GiB", 10, "peak_memory_gib", ".2f"),
    Column("val_acc", 9, "val_acc", ".3f"),
    Column("MFU", 6, "mfu", ".2f"),
    Column("peak", 6, "peak_key", "s"),
    Column("util%", 7, _pct("gpu_utilization"), ".0f"),
    Column("NVML", 9, _nvml_cell, "s"),
]
MONITOR = [
    Column("workers", 8, "num_workers", "d"),
    Column("diagnosis", 15, "diagnosis", "s"),
    Column("wait%", 7, _pct("data_wait_fraction"), ".0f"),
    Column("samples/s", 11, "samples_per_s", ",.0f"),
    Column("util%", 7, _pct("gpu_utilization"), ".0f"),
    Column("mem GB", 8, "gpu_memory_used_gb", ".1f"),
    Column("power W", 9, "gpu_power_w", ".0f"),
    Column("temp C", 8, "gpu_temperature_c", ".0f"),
    Column("SM MHz", 8, "gpu_sm_clock_mhz", ".0f"),
    Column("MFU", 6, "mfu", ".2f"),
    Column("NVML", 9, _nvml_cell, "s"),
]
FINDERS = [
    Column("found", 7, "found", "d"),
    Column("search s", 10, "search_s", ".1f"),
    Column("peak GiB", 10, "peak_memory_gib", ".2f"),
    Column("OOMs", 6, "oom_count", "d"),
    Column("  first OOM in the search; after it", 0, _first_oom, "s"),
]


def _part_table(title: str, part: dict[str, Any], label: str, width: int, columns: list[Column]) -> list[str]:
    """A part's rows under its title and status; a row that did not finish shows its status instead of figures."""
    columns = [Column(label, width, label, align="<"), *columns]
    lines = ["", f"{title} [{part['status']}]", table(columns, [])]
    for row in part.get("rows", []):
        if "found" not in row and "samples_per_s" not in row:
            lines.append(f"{row[label]:<{width}}{row['status']}")
            continue
        lines.append("".join(column.of(row) for column in columns))
        if row.get("decision"):
            lines.append(f"    decision: {row['decision'].get('decision')} ({row['decision'].get('reason')})")
    return lines


def format_table(r: dict[str, Any]) -> str:
    """Every part as a plain-text table under its status, in the order they ran, then the parts' errors."""
    d, s, parts = r["device"], r["settings"], r["parts"]
    name = f"{d.get('name', 'CPU rehearsal')} ({d.get('memory_gib', 0):.0f} GiB, cc {d.get('capability', '-')})"
    nvml = "ok" if r["nvml"]["ok"] else f"UNAVAILABLE ({r['nvml']['detail']})"
    lines = [f"gpu_check on {name}, torch {d['torch']}, lightning {d['lightning']}, {r.get('seconds', 0):.0f} s"]
    lines.append(f"NVML {nvml}; budget {r['budget_s']:.0f} s; data [{parts['data']['status']}]")
    title = f"1. precision: width {s['width']}, batch {s['batch']}, {s['steps']} timed steps on resident batches"
    lines += _part_table(title, parts["precision"], "precision", 34, TIMED)
    lines += _part_table(f"2. UtilizationMonitor, batch {s['batch']}", parts["monitor"], "run", 26, MONITOR)
    part, memory = parts["batch_size"], parts["batch_size"].get("memory", {})
    title = (
        f"3. batch-size finders, memory cap {cell(memory.get('cap_gib'), '.2f')} GiB (about"
        f" {memory.get('target_batch', '-')} of {memory.get('train_samples', '-')} samples fit);"
        f" {part.get('workers', {}).get('reason', '')}"
    )
    lines += _part_table(title, part, "finder", 11, FINDERS)
    part = parts["int8"]
    lines += ["", f"4. INT8 export of {part.get('model', 'the 16-mixed model')} [{part['status']}]"]
    if part.get("report"):
        q = part["report"]
        v, lat = q.get("verification") or {}, q.get("latency") or {}
        lines.append(f"size {q['fp32_bytes'] / 1e6:.2f} MB -> {q['int8_bytes'] / 1e6:.2f} MB ({q['size_ratio']:.2f}x)")
        lines += [
            f"latency {key}: {t['fp32_ms']:.2f} ms -> {t['int8_ms']:.2f} ms ({t['speedup']:.2f}x)"
            for key, t in lat.items()
            if key.startswith("batch_")
        ]
        agree, fp32, int8 = (v.get(k) for k in ("top1_agreement", "metric_fp32", "metric_int8"))
        lines.append(f"top-1 agreement {cell(agree, '.3f')}, accuracy {cell(fp32, '.3f')} -> {cell(int8, '.3f')}")
    title = f"5. compile ({parts['compile'].get('backend', '-')})"
    lines += _part_table(title, parts["compile"], "precision", 34, TIMED)
    errors = [f"error in {name}: {p['error']}" for name, p in parts.items() if p.get("error")]
    return "\n".join(lines + (["", *errors] if errors else []))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller run (at most 3 minutes)")
    parser.add_argument("--out", default=str(DEFAULT_OUT), help='the JSON; on a lent machine "$OUT/gpu_check.json"')
    parser.add_argument("--allow-cpu", action="store_true", help="without CUDA, rehearse every part on the CPU")
    parser.add_argument("--budget", type=float, help="seconds before the run stops itself (default 480, quick 180)")
    parser.add_argument("--inject-failure", choices=PARTS, help=argparse.SUPPRESS)  # tests: make one part fail
    args = parser.parse_args(argv)
    return run(args.quick, args.out, args.allow_cpu, args.budget, args.inject_failure)


if __name__ == "__main__":
    sys.exit(exit_code(main(sys.argv[1:])))
