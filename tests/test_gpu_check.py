"""``benchmarks/gpu_check.py`` works the first time a GPU is lent: rehearsed on the CPU, part by part, within budget."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import time
import weakref
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from conftest import ROOT, load_benchmark

from lightning_speedkit.demo import DemoDataModule

SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
FAKE_NVML = """
class NVMLError(Exception):
    pass


def nvmlInit():
    raise NVMLError("fake: libnvidia-ml.so.1 cannot be opened")


def nvmlShutdown():
    pass
"""


@pytest.fixture(scope="module")
def gpu_check() -> ModuleType:
    """The script, imported as a module."""
    return load_benchmark("gpu_check")


@pytest.fixture(scope="module")
def parts(gpu_check: ModuleType) -> dict[str, ModuleType]:
    """The modules beside the script that hold its parts (importable once the script is loaded)."""
    return {name: importlib.import_module(f"_gpu_{name}") for name in ("record", "resident", "parts", "oom")}


def _env(tmp_path: Path, demo_cache: Path) -> dict[str, str]:
    """No CUDA, an NVML that fails to load (a fake ``pynvml`` first on the path), the tests' demo-image cache."""
    fake = tmp_path / "fake_nvml"
    fake.mkdir(exist_ok=True)
    (fake / "pynvml.py").write_text(FAKE_NVML)
    path = os.pathsep.join([str(fake), str(ROOT), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": path, "SPEEDKIT_CACHE_DIR": str(demo_cache)}


# ---------------------------------------------------------------------------------------------- pure helpers


@pytest.mark.parametrize(
    ("cores", "shm_free", "batch_bytes", "expected"),
    [
        (16, 64 * 2**30, 180 * 2**20, 8),  # the full run's largest batch on a roomy /dev/shm: as many as allowed
        (2, 64 * 2**30, 180 * 2**20, 2),  # the cores bound it
        (16, 2 * 2**30, 180 * 2**20, 2),  # half of 2 GiB holds two workers' 2 x 180 MiB
        (16, 64 * 2**20, 180 * 2**20, 0),  # Docker's 64 MiB /dev/shm: no workers, no bus error
        (16, None, 180 * 2**20, 0),  # no /dev/shm at all
    ],
)
def test_choose_workers_checks_dev_shm(
    parts: dict[str, ModuleType], cores: int, shm_free: int | None, batch_bytes: int, expected: int
) -> None:
    """The worker count is capped by the cores and by what /dev/shm can hold of the batches in flight."""
    count, why = parts["oom"].choose_workers(cores, shm_free, batch_bytes)
    assert count == expected
    assert f"num_workers={expected}" in why
    assert "/dev/shm" in why


@pytest.mark.parametrize(("fixed", "per_sample", "train_len"), [(50e6, 1e6, 1600), (2e9, 3e4, 4800), (0.0, 1.0, 160)])
def test_memory_cap_binds_well_below_the_dataset(
    parts: dict[str, ModuleType], fixed: float, per_sample: float, train_len: int
) -> None:
    """Under the cap a quarter of the dataset fits and the whole dataset cannot: both searches must run out."""
    reserved, target = 3e8, train_len // 4
    cap = parts["oom"].memory_cap(reserved, fixed, per_sample, target)
    assert reserved + fixed + per_sample * target <= cap < reserved + fixed + per_sample * train_len


def test_throughput_counts_the_samples_that_ran(
    gpu_check: ModuleType, parts: dict[str, ModuleType], tmp_path: Path, one_thread: None
) -> None:
    """A partial batch among the resident ones is counted as what it holds, not as a whole batch (no overstatement)."""
    s = {**gpu_check.settings(True, cpu=True), "warmup": 2, "steps": 6}
    whole, partial = (
        (torch.randn(16, 3, 28, 28), torch.randint(0, 10, (16,))),
        (torch.randn(5, 3, 28, 28), torch.arange(5)),
    )
    resident = parts["resident"]
    row, _ = resident.resident_fit(s, torch.device("cpu"), tmp_path, 28, [whole, partial], "32-true", [])
    assert (row["timed_steps"], row["timed_samples"]) == (6, 3 * 16 + 3 * 5)
    assert row["samples_per_s"] == pytest.approx(row["timed_samples"] / (row["step_ms"] * 6 / 1000))
    assert resident.full_batches([whole, partial, whole], 16) == [whole, whole]


def test_precision_part_releases_its_resident_batches(
    gpu_check: ModuleType,
    parts: dict[str, ModuleType],
    tmp_path: Path,
    demo_cache: Path,
    one_thread: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """After part 1 no tensor of its resident batches is alive (trainer, loader, lists dropped); its model is kept."""
    alive: list[weakref.ref[torch.Tensor]] = []
    on_device = parts["resident"].on_device

    def watched(*args: Any, **kwargs: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
        batches = on_device(*args, **kwargs)
        alive.extend(weakref.ref(t) for batch in batches for t in batch)
        return batches  # type: ignore[no-any-return]

    monkeypatch.setattr(parts["parts"], "on_device", watched)
    s = gpu_check.settings(True, cpu=True)
    data = DemoDataModule(s["num_images"], s["image_size"], batch_size=s["batch"], cache=True, root=demo_cache)
    data.prepare_data()
    data.setup("fit")
    record = parts["record"].RunRecord({"parts": {}}, tmp_path / "gpu_check.json", budget_s=600)
    entry: dict[str, Any] = {"status": "running"}
    keep: dict[str, Any] = {}
    parts["parts"].precision_part(entry, record, s, torch.device("cpu"), tmp_path, data, keep)
    assert [row["status"] for row in entry["rows"]] == ["ok", "ok", "ok", "skipped: needs a CUDA GPU with bf16", "ok"]
    assert alive
    assert not [ref for ref in alive if ref() is not None]
    assert keep["int8_model"]._trainer is None  # the 16-mixed model, kept for part 4, holds no trainer
    for row in entry["rows"][:3]:
        assert row["flops_per_sample"] > 0
        assert (row["mfu"], row["peak_flops"], row["peak_key"]) == (None, None, None)  # a CPU has no peak
        assert row["nvml"]["sampler"] == "ProcessSampler"
    assert entry["rows"][4]["decision"]["decision"] in ("32-true", "bf16-mixed")  # PrecisionTuner measured


# ---------------------------------------------------------------------------------------------- the run record


def test_a_failing_part_leaves_the_others_in_the_file(parts: dict[str, ModuleType], tmp_path: Path) -> None:
    """A part that raises is recorded with its error and traceback; the parts before and after keep their results."""
    out = tmp_path / "gpu_check.json"
    result: dict[str, Any] = {"parts": {name: {"status": "pending"} for name in ("a", "b", "c")}}
    record = parts["record"].RunRecord(result, out, budget_s=600)
    seen: list[str] = []

    def part_a(entry: dict[str, Any]) -> None:
        entry["rows"] = [{"status": "ok", "x": 1}]

    def part_b(entry: dict[str, Any]) -> None:
        seen.append(json.loads(out.read_text())["parts"]["a"]["status"])  # a's result is on disk before b runs
        raise ValueError("boom in b")

    record.part("a", part_a)
    record.part("b", part_b)
    record.part("c", lambda entry: entry.update(rows=[{"status": "failed: a row"}]))
    written = json.loads(out.read_text())["parts"]
    assert seen == ["ok"]
    assert [written[name]["status"] for name in "abc"] == ["ok", "failed", "partial"]
    assert written["a"]["rows"] == [{"status": "ok", "x": 1}]
    assert written["b"]["error"] == "ValueError: boom in b"
    assert "part_b" in written["b"]["traceback"]
    assert not list(tmp_path.glob(".*.tmp"))  # atomic writes leave no temporary files


def test_the_watchdog_records_the_timeout_and_exits(parts: dict[str, ModuleType], tmp_path: Path) -> None:
    """When the budget runs out the part running is marked timeout, the rest skipped, the file written, exit 3."""
    out = tmp_path / "gpu_check.json"
    statuses = {"a": {"status": "ok"}, "b": {"status": "running"}, "c": {"status": "pending"}}
    exits: list[int] = []
    record = parts["record"].RunRecord({"status": "running", "parts": statuses}, out, 0.5, exit_fn=exits.append)
    record.current = "b"
    record.expire()
    written = json.loads(out.read_text())
    assert exits == [parts["record"].EXIT_TIMEOUT]
    assert written["status"] == "timeout"
    assert [written["parts"][name]["status"] for name in "abc"] == ["ok", "timeout", "skipped: the time budget ran out"]


def test_a_hung_part_cannot_outlast_the_budget(tmp_path: Path) -> None:
    """In a real process the watchdog ends a part that never returns, within the budget, with exit 3 and the JSON."""
    out = tmp_path / "gpu_check.json"
    code = (
        f"import sys, time; sys.path.insert(0, {str(SCRIPT.parent)!r}); import _gpu_record as g\n"
        f"result = {{'status': 'running', 'parts': {{'hangs': {{'status': 'pending'}}}}}}\n"
        f"r = g.RunRecord(result, g.Path({str(out)!r}), budget_s=2.0)\n"
        "r.timer.start(); r.part('hangs', lambda entry: time.sleep(120), min_s=0)\n"
    )
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=110, check=False)
    assert done.returncode == 3, done.stderr
    assert json.loads(out.read_text())["parts"]["hangs"]["status"] == "timeout"
    assert time.monotonic() - start < 100  # the sleep alone would take 120 s


@pytest.mark.parametrize(
    ("result", "code"),
    [({"skipped": "no CUDA device"}, 0), ({"status": "ok"}, 0), ({"status": "failed"}, 1), ({"status": "timeout"}, 3)],
)
def test_exit_code(gpu_check: ModuleType, result: dict[str, Any], code: int) -> None:
    """The process status says whether every part passed (or the check skipped), one failed, or time ran out."""
    assert gpu_check.exit_code(result) == code


# ---------------------------------------------------------------------------------------------- the whole rehearsal


@pytest.mark.slow
def test_rehearsal_runs_every_part_and_survives_an_injected_failure(tmp_path: Path, demo_cache: Path) -> None:
    """``--allow-cpu --quick`` runs every part on the CPU; a part made to fail leaves every other part's results.

    The NVML here fails to load (a fake ``pynvml``): every row records that, with NVML's reason.
    """
    out = tmp_path / "out" / "gpu_check.json"
    command = [sys.executable, str(SCRIPT), "--allow-cpu", "--quick", "--out", str(out), "--inject-failure", "monitor"]
    done = subprocess.run(
        command, capture_output=True, text=True, env=_env(tmp_path, demo_cache), timeout=600, check=False
    )
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    assert "NVML UNAVAILABLE (nvmlInit failed: fake: libnvidia-ml.so.1 cannot be opened)" in done.stdout
    result = json.loads(out.read_text())
    parts = result["parts"]
    assert {name: part["status"] for name, part in parts.items()} == {
        "data": "ok",
        "precision": "ok",
        "monitor": "failed",
        "batch_size": "ok",
        "int8": "ok",
        "compile": "ok",
    }
    assert parts["monitor"]["error"] == "RuntimeError: injected failure (--inject-failure monitor)"
    assert [row["status"] for row in parts["monitor"]["rows"]] == ["ok", "ok"]  # it ran, then failed: rows kept
    assert (result["status"], result["rehearsal"], result["nvml"]["ok"]) == ("failed", True, False)
    assert result["cuda_only_skipped"]
    rows = [row for part in parts.values() for row in part.get("rows", []) if "nvml" in row]
    assert len(rows) >= 10
    assert all(row["nvml"] == {**row["nvml"], "ok": False, "detail": result["nvml"]["detail"]} for row in rows)
    precision = {row["precision"]: row for row in parts["precision"]["rows"]}
    assert precision["bf16-mixed"]["status"] == "skipped: needs a CUDA GPU with bf16"
    assert all("mfu" in row and "peak_flops" in row for name, row in precision.items() if name != "bf16-mixed")
    finders = {row["finder"]: row for row in parts["batch_size"]["rows"]}
    assert set(finders) == {"speedkit", "lightning"}
    for row in finders.values():  # both searches hit the cap, with the message, and training at the size found fits
        assert row["hit_oom"], row
        assert row["first_oom"]["message"].startswith("CUDA out of memory")
        assert row["found"] <= parts["batch_size"]["memory"]["target_batch"]
        assert row["after_search"] == "trained + validated"
    assert "/dev/shm" in parts["batch_size"]["workers"]["reason"]
    assert parts["int8"]["report"]["size_ratio"] > 1
    assert [row["status"] for row in parts["compile"]["rows"]] == ["ok", "ok"]
