"""An INT8 export is switched into place as a whole: a real process killed at any point leaves one complete export."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
import torch
from torch import nn

from lightning_speedkit.int8 import export_int8
from lightning_speedkit.int8.place import pointer_of, sha256_of, switch_into_place


def _data(batches: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(64, 128, generator=g) for _ in range(batches)]


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(128, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))


def export_variant(path: str, variant: str) -> None:
    """Export A (asymmetric, FP32 kept) or B (symmetric, no FP32) to ``path``, replacing what is there."""
    torch.set_num_threads(1)
    export_int8(
        _net(),
        _data(2),
        path,
        symmetric=variant == "B",
        keep_fp32=variant == "A",
        validation_data=_data(24),  # a verification long enough to kill the process during it
        overwrite=True,
        latency_repeats=0,
        num_threads=1,
    )


def complete_export(path: Path) -> str:
    """Which export is at ``path`` ("A" or "B"), after checking it is complete and not mixed with another."""
    report = json.loads(path.with_suffix(".json").read_text())
    for name, entry in report["manifest"].items():  # the report is the manifest: every file, its size and SHA-256
        assert sha256_of(path.parent / name) == entry["sha256"], f"{name} is not the file the report lists"
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    assert session.run(None, {"input": np.zeros((3, 128), np.float32)})[0].shape == (3, 10)
    fp32 = path.with_name(f"{path.stem}.fp32.onnx")
    assert fp32.exists() is (report["fp32_path"] is not None)
    return "B" if report["quantization"]["activation_symmetric"] else "A"


def leftovers(path: Path) -> list[str]:
    """Hidden staging and export directories beside ``path`` other than the one its pointer names."""
    pointer = pointer_of(path)
    current = os.readlink(pointer) if pointer.is_symlink() else None
    prefixes = (f".{path.name}.tmp-", f".{path.name}.v-")
    return sorted(p.name for p in path.parent.iterdir() if p.name.startswith(prefixes) and p.name != current)


def as_plain_files(path: Path) -> None:
    """Turn the export at ``path`` into plain files, as an older version of the library wrote them."""
    pointer = pointer_of(path)
    if not pointer.is_symlink():  # plain files already
        return
    home = Path(os.path.realpath(pointer))
    for link in [p for p in path.parent.iterdir() if p.is_symlink() and not p.name.startswith(".")]:
        if link.exists():
            data = link.read_bytes()
            link.unlink()
            link.write_bytes(data)
        else:
            link.unlink()
    pointer.unlink()
    for file in home.iterdir():
        file.unlink()
    home.rmdir()


def _staged(path: Path, name: str, old: set[str]) -> bool:
    """Whether a staging directory made by this run (not one in ``old``) holds ``name``."""
    return any((d / name).exists() for d in path.parent.glob(f".{path.name}.tmp-*") if d.name not in old)


# when to kill: a condition on the directory seen from outside (ignoring what earlier runs left), polled as it runs
KILL_POINTS: dict[str, Any] = {
    "staging made": lambda p, old: any(d.name not in old for d in p.parent.glob(f".{p.name}.tmp-*")),
    "FP32 written": lambda p, old: _staged(p, f"{p.stem}.fp32.onnx", old),
    "INT8 written": lambda p, old: _staged(p, p.name, old),
    "report staged": lambda p, old: _staged(p, f"{p.stem}.json", old),
    "renamed, not switched": lambda p, old: any(".v-" in name for name in set(leftovers(p)) - old),
}


def _kill_when(process: Any, path: Path, condition: Any, deadline_s: float = 300.0) -> bool:
    """SIGKILL ``process`` as soon as ``condition(path, what earlier runs left)`` holds; False if it ended first."""
    old = set(leftovers(path))
    end = time.monotonic() + deadline_s
    while process.is_alive() and time.monotonic() < end:
        if condition(path, old):
            try:
                os.kill(process.pid, signal.SIGKILL)
            except ProcessLookupError:  # it ended (and was reaped) while a delayed condition waited
                break
            process.join()
            return True
        time.sleep(0.001)
    process.join()
    return False


def _after(delay: float) -> Any:
    """A kill condition: the report is staged, then ``delay`` seconds more (to land in or after the switch)."""

    def condition(path: Path, old: set[str]) -> bool:
        if not _staged(path, f"{path.stem}.json", old):
            return False
        time.sleep(delay)
        return True

    return condition


@pytest.mark.skipif(not hasattr(os, "fork") or not hasattr(signal, "SIGKILL"), reason="needs fork and SIGKILL")
def test_an_export_killed_at_any_point_leaves_the_old_or_the_new_one_complete(tmp_path: Path) -> None:
    """SIGKILL at each step of an overwriting export: the old export or the new one is complete; the next cleans up."""
    context = multiprocessing.get_context("forkserver")  # one import of torch and ORT, then a fork per export
    context.set_forkserver_preload(["torch", "onnxruntime", "onnx", "onnxscript", "lightning_speedkit.int8"])
    path = tmp_path / "m.onnx"

    def start(variant: str) -> Any:
        process = context.Process(target=export_variant, args=(str(path), variant))
        process.start()
        return process

    first = start("A")
    first.join()
    assert first.exitcode == 0
    assert complete_export(path) == "A"
    conditions = [*KILL_POINTS.items(), ("plain files, report staged", _after(0.0))]
    conditions += [(f"plain files, report staged + {d * 1000:.0f} ms", _after(d)) for d in (0.003, 0.01, 0.03)]
    killed_before_switch, left = 0, list[str]()
    for point, condition in conditions:
        if point.startswith("plain files"):
            as_plain_files(path)  # an export as an older version wrote it: plain files, no pointer
        old = complete_export(path)
        killed = _kill_when(start("B" if old == "A" else "A"), path, condition)
        found = complete_export(path)  # whichever it is, it is whole
        assert found in ("A", "B")
        assert not set(left) & set(leftovers(path)), "the next export removes what a killed one left"
        if killed and point in list(KILL_POINTS)[:4]:
            assert found == old, f"killed at {point!r}, before its switch: the old export stays in place"
            assert leftovers(path), "a killed export leaves its staging behind"
            killed_before_switch += 1
        left = leftovers(path)
    assert killed_before_switch >= 3
    last = start("B" if complete_export(path) == "A" else "A")
    last.join()
    assert last.exitcode == 0
    assert leftovers(path) == []
    assert {p.name for p in tmp_path.iterdir() if not p.name.startswith(".")} <= {"m.json", "m.onnx", "m.fp32.onnx"}


def test_the_old_export_stays_whole_until_the_switch(tmp_path: Path) -> None:
    """Staged files change nothing a reader sees; after the switch every name reads the new export."""
    path = tmp_path / "m.onnx"
    export_variant(str(path), "A")
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir() if not p.name.startswith(".")}
    staged = tmp_path / ".m.onnx.tmp-manual"
    staged.mkdir()
    (staged / "m.onnx").write_bytes(b"new int8")
    (staged / "m.json").write_text(json.dumps({"new": True}))
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if not p.name.startswith(".")} == before
    switch_into_place(staged, path)
    assert path.read_bytes() == b"new int8"
    umask = os.umask(0o022)
    os.umask(umask)
    assert path.resolve().parent.stat().st_mode & 0o777 == 0o777 & ~umask  # not mkdtemp's 0700: others can read
    assert json.loads(path.with_suffix(".json").read_text()) == {"new": True}
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == ["m.json", "m.onnx"]
    assert leftovers(path) == []


def test_without_symbolic_links_the_files_are_moved_one_by_one(tmp_path: Path) -> None:
    """Where links cannot be made, the staged files replace the old ones as plain files and old extras go."""
    path = tmp_path / "m.onnx"
    for name in ("m.onnx", "m.fp32.onnx", "m.json"):
        (tmp_path / name).write_text("old")
    staged = tmp_path / ".m.onnx.tmp-manual"
    staged.mkdir()
    for name in ("m.onnx", "m.json"):
        (staged / name).write_text("new")
    switch_into_place(staged, path, links=False)
    assert {p.name: p.read_text() for p in tmp_path.iterdir() if not p.name.startswith(".")} == {
        "m.onnx": "new",
        "m.json": "new",
    }
    assert not any(p.is_symlink() for p in tmp_path.iterdir())
