"""``speedkit bench`` runs the benchmark scripts and collects one report; ``benchmarks/gpu_check.py`` skips on CPU."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import ROOT, load_benchmark, refusing_files

from lightning_speedkit.bench import (
    BenchmarksNotFoundError,
    discover,
    find_benchmarks_dir,
    format_markdown,
    main,
    run_benchmarks,
)

# Stand-in benchmark scripts with the same command line as the real ones (--quick, --out PATH).
_OK = """
import argparse, json
p = argparse.ArgumentParser(); p.add_argument("--quick", action="store_true"); p.add_argument("--out")
a = p.parse_args()
print("name   value"); print("fast   {}".format(2.0 if a.quick else 1.0))
json.dump({"quick": a.quick, "speedup": 2.0}, open(a.out, "w")); print("wrote " + a.out)
"""
_FAILS = "import sys\nprint('half a table')\nsys.stderr.write('Traceback: boom\\n')\nsys.exit(3)\n"
_NO_JSON = "print('a table but no JSON')\n"
_SKIPS = _OK.replace('{"quick": a.quick, "speedup": 2.0}', '{"skipped": "no CUDA device"}')
_HANGS = "import time\nprint('started', flush=True)\ntime.sleep(60)\n"
_SPAWNS = """
import pathlib, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], stdout=-3, stderr=-3)  # DEVNULL
pathlib.Path(__file__).with_name("child.pid").write_text(str(child.pid))
print("started", flush=True)
time.sleep(60)
"""


@pytest.fixture
def scripts(tmp_path: Path) -> Path:
    directory = tmp_path / "repo" / "benchmarks"
    directory.mkdir(parents=True)
    texts = {"ok": _OK, "fails": _FAILS, "no_json": _NO_JSON, "skips": _SKIPS, "hangs": _HANGS, "spawns": _SPAWNS}
    for name, text in texts.items():
        (directory / f"{name}.py").write_text(text)
    (directory / "_shared.py").write_text("")
    return directory


def test_the_repository_benchmarks_are_found() -> None:
    """From a checkout the default is the repository's benchmarks/, with every benchmark and the GPU check."""
    directory = find_benchmarks_dir()
    assert directory.resolve() == (ROOT / "benchmarks").resolve()
    expected = {"batch_size", "channels_last", "dataloader", "gpu_check", "int8", "monitor", "pruning"}
    assert expected <= set(discover(directory))


def test_missing_benchmarks_directory_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Without benchmark scripts (an installed package without the repository) the command explains it, exit 2."""
    with pytest.raises(BenchmarksNotFoundError, match="not part of the installed package"):
        find_benchmarks_dir(tmp_path)
    assert main(["--benchmarks-dir", str(tmp_path), "--out", str(tmp_path / "out")]) == 2
    assert "run `speedkit bench` from a checkout" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_environment_variable_names_the_directory(scripts: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``$SPEEDKIT_BENCHMARKS_DIR`` points the command at another directory of scripts."""
    monkeypatch.setenv("SPEEDKIT_BENCHMARKS_DIR", str(scripts))
    assert find_benchmarks_dir() == scripts
    assert discover(scripts) == ["fails", "hangs", "no_json", "ok", "skips", "spawns"]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"names": ["ok", "nope"]}, "`names`"),
        ({"names": ["ok"], "timeout_s": 0}, "`timeout_s`"),
        ({"names": ["ok"], "timeout_s": float("inf")}, "`timeout_s` must be a positive number of seconds, finite"),
        ({"names": ["ok"], "timeout_s": float("nan")}, "`timeout_s`"),
    ],
)
def test_bad_arguments_are_refused(scripts: Path, tmp_path: Path, kwargs: dict[str, Any], match: str) -> None:
    """An unknown benchmark or a non-positive timeout is a ValueError naming the argument."""
    with pytest.raises(ValueError, match=match):
        run_benchmarks(benchmarks_dir=scripts, out_dir=tmp_path / "out", verbose=False, **kwargs)


def test_report_collects_tables_json_and_failures(scripts: Path, tmp_path: Path) -> None:
    """Each script runs in its own process; its table, JSON, status and stderr tail land in report.json/.md."""
    out = tmp_path / "out"
    report = run_benchmarks(
        ["ok", "fails", "no_json", "skips"], quick=True, out_dir=out, benchmarks_dir=scripts, verbose=False
    )
    entries = report["benchmarks"]
    assert {name: e["status"] for name, e in entries.items()} == {
        "ok": "ok",
        "fails": "failed",
        "no_json": "failed",
        "skips": "skipped",
    }
    assert entries["ok"]["result"] == {"quick": True, "speedup": 2.0}
    assert entries["ok"]["table"] == "name   value\nfast   2.0"  # the "wrote ..." line is dropped
    assert "--quick" in entries["ok"]["command"]
    assert entries["fails"]["returncode"] == 3
    assert "boom" in entries["fails"]["error_tail"]
    assert "wrote no JSON" in entries["no_json"]["error_tail"]
    assert json.loads((out / "report.json").read_text())["benchmarks"]["ok"]["result"]["speedup"] == 2.0
    markdown = (out / "report.md").read_text()
    assert "| ok | ok |" in markdown
    assert "fast   2.0" in markdown
    assert "Traceback: boom" in markdown
    assert (out / "fails.log").read_text().count("boom") == 1
    assert not list(out.glob(".*.tmp"))  # atomic writes leave no temporary files


def test_a_stale_result_does_not_pass_for_a_new_run(scripts: Path, tmp_path: Path) -> None:
    """A JSON left by an earlier run is removed first, so a script that writes none now counts as failed."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "no_json.json").write_text('{"old": true}')
    report = run_benchmarks(["no_json"], out_dir=out, benchmarks_dir=scripts, verbose=False)
    assert report["benchmarks"]["no_json"]["status"] == "failed"


def test_timeout_stops_a_benchmark(scripts: Path, tmp_path: Path) -> None:
    """A benchmark past ``timeout_s`` is killed and marked ``timeout``; the report is still written."""
    report = run_benchmarks(["hangs"], out_dir=tmp_path / "out", benchmarks_dir=scripts, timeout_s=2, verbose=False)
    entry = report["benchmarks"]["hangs"]
    assert entry["status"] == "timeout"
    assert entry["seconds"] < 60
    assert entry["table"] == "started"
    assert (tmp_path / "out" / "report.md").is_file()


def test_timeout_stops_the_processes_a_benchmark_started(scripts: Path, tmp_path: Path) -> None:
    """The processes a benchmark started stop with it (the whole process group is killed), not only the script.

    Killing the script alone left its children running; those holding its output pipes kept the run waiting for
    them, long past ``timeout_s``.
    """
    report = run_benchmarks(["spawns"], out_dir=tmp_path / "out", benchmarks_dir=scripts, timeout_s=2, verbose=False)
    assert report["benchmarks"]["spawns"]["status"] == "timeout"
    stat = Path(f"/proc/{(scripts / 'child.pid').read_text()}/stat")
    for _ in range(300):  # the kill was sent to the group; a loaded machine may take a moment to deliver it
        if not stat.exists() or stat.read_text().split()[2] == "Z":  # gone, or dead and not yet reaped
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the benchmark's child process ({stat.parent.name}) is still running")


def test_relative_directories_are_read_from_where_the_command_runs(
    scripts: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A relative ``--out`` and ``--benchmarks-dir`` name paths from the caller's directory, not the scripts' parent.

    The scripts run from the benchmarks directory's parent: a relative ``--out`` put their JSON there (the benchmark
    then counted as failed, "wrote no JSON"), and a relative ``--benchmarks-dir`` doubled in the script path.
    """
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    relative = Path("..") / scripts.relative_to(tmp_path)
    report = run_benchmarks(["ok"], out_dir="out", benchmarks_dir=relative, verbose=False)
    assert report["benchmarks"]["ok"]["status"] == "ok"
    assert (elsewhere / "out" / "ok.json").is_file()
    assert not (scripts.parent / "out").exists()


_INTERRUPT = """
import os, pathlib, signal, sys, threading, time
from lightning_speedkit.bench import main
signal.signal(signal.SIGINT, signal.default_int_handler)  # as from a terminal (a background job ignores Ctrl-C)
def interrupt():  # Ctrl-C once the benchmark has started its child
    while not pathlib.Path(sys.argv[1], "child.pid").exists():
        time.sleep(0.1)
    os.kill(os.getpid(), signal.SIGINT)
threading.Thread(target=interrupt, daemon=True).start()
sys.exit(main(["spawns", "--benchmarks-dir", sys.argv[1], "--out", sys.argv[2]]))
"""


def test_ctrl_c_stops_the_running_benchmark_and_its_processes(scripts: Path, tmp_path: Path) -> None:
    """Ctrl-C stops the benchmark (in a session of its own, out of the terminal's reach) and says so in one line.

    The benchmark and its children ran on after the command had exited, with a traceback, and wrote their results
    into ``--out`` later.
    """
    done = subprocess.run(
        [sys.executable, "-c", _INTERRUPT, str(scripts), str(tmp_path / "out")], capture_output=True, text=True
    )
    assert done.returncode == 130
    assert "speedkit bench: interrupted" in done.stderr
    assert "Traceback" not in done.stderr
    stat = Path(f"/proc/{(scripts / 'child.pid').read_text()}/stat")
    for _ in range(300):
        if not stat.exists() or stat.read_text().split()[2] == "Z":
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the benchmark's child process ({stat.parent.name}) is still running")


def test_main_exit_code_and_listing(scripts: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``main`` returns 0 when every benchmark passed or skipped, 1 when one failed; ``--list`` names them."""
    common = ["--benchmarks-dir", str(scripts), "--out", str(tmp_path / "out")]
    assert main(["ok", "skips", "--quick", *common]) == 0
    assert "wrote" in capsys.readouterr().out
    assert main(["ok", "fails", *common]) == 1
    capsys.readouterr()
    assert main(["--list", *common]) == 0
    assert capsys.readouterr().out.split() == ["fails", "hangs", "no_json", "ok", "skips", "spawns"]
    assert main(["ok", "--timeout", "0", *common]) == 2
    assert "--timeout must be a positive number" in capsys.readouterr().err  # the flag, not the parameter
    (tmp_path / "a_file").write_text("")
    assert main(["ok", "--benchmarks-dir", str(scripts), "--out", str(tmp_path / "a_file")]) == 2  # no traceback
    assert "--out must be a directory this user can write to" in capsys.readouterr().err


def test_an_out_dir_that_takes_no_file_is_refused_before_any_benchmark_runs(
    scripts: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An existing directory where no file can be made, or an empty ``--out``: exit 2 at once, nothing run.

    The existing directory passed ``mkdir``, every benchmark ran, then writing its log ended the command with a
    traceback; an empty ``--out`` wrote the report into the working directory.
    """
    read_only = tmp_path / "read_only"
    read_only.mkdir(mode=0o555)
    place = refusing_files(read_only, Path("/proc"), why="every directory here takes this process's files")
    for out in (str(place), "", " "):
        assert main(["ok", "--benchmarks-dir", str(scripts), "--out", out]) == 2
        err = capsys.readouterr().err
        assert f"--out must be a directory{' this user can write to' if out.strip() else ''}, got {out!r}" in err
        assert "Traceback" not in err
    assert not (scripts.parent / "report.md").exists()


def test_markdown_shows_a_benchmark_that_printed_nothing() -> None:
    """An empty table is shown as such rather than as an empty code block."""
    entry = {"status": "failed", "seconds": 0.1, "table": "", "json": None, "error_tail": "x", "returncode": 1}
    text = format_markdown({"quick": False, "benchmarks": {"a": entry}})
    assert "(printed nothing)" in text
    assert "| a | failed | 0.1 | - |" in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")
def test_gpu_check_skips_cleanly_without_cuda(tmp_path: Path) -> None:
    """``benchmarks/gpu_check.py`` exits 0 on a CPU with one clear line and a JSON that says it skipped."""
    out = tmp_path / "gpu_check.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "skipped: no CUDA device"
    assert json.loads(out.read_text())["skipped"] == "no CUDA device"


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_check_runs_on_a_gpu(tmp_path: Path) -> None:
    """On a GPU the quick check passes its parts: precision rows with MFU, NVML readings, both finders OOM, INT8."""
    out = str(tmp_path / "gpu_check.json")
    result = load_benchmark("gpu_check").main(["--quick", "--out", out, "--budget", "900"])  # no os._exit in pytest
    parts = result["parts"]
    assert all(p["status"] == "ok" or p["status"].startswith("skipped") for p in parts.values()), parts
    rows = {row["precision"]: row for row in parts["precision"]["rows"]}
    assert rows["32-true"]["peak_key"] == "tf32"  # torch's default lets cuDNN run the convolutions in TF32
    assert 0 < rows["32-true"]["mfu"] < 1
    assert parts["precision"]["memory_allocated_after_gib"] < 0.05  # the resident batches are gone
    assert parts["monitor"]["rows"][0]["nvml"]["sampler"] == "NvmlSampler"
    assert parts["monitor"]["rows"][0]["gpu_utilization"] is not None
    assert all(row["hit_oom"] for row in parts["batch_size"]["rows"])
    assert parts["int8"]["report"]["size_ratio"] > 1.0


@pytest.mark.slow
def test_bench_runs_real_benchmarks_quick(tmp_path: Path, demo_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``speedkit bench batch_size gpu_check --quick`` runs the real scripts and reports both (one skips on CPU)."""
    monkeypatch.setenv("SPEEDKIT_CACHE_DIR", str(demo_cache))
    report = run_benchmarks(["batch_size", "gpu_check"], quick=True, out_dir=tmp_path, verbose=False)
    entries = report["benchmarks"]
    assert entries["batch_size"]["status"] == "ok", entries["batch_size"].get("error_tail")
    assert {row["finder"] for row in entries["batch_size"]["result"]["rows"]} == {"lightning", "speedkit"}
    assert "scenario" in entries["batch_size"]["table"]
    assert entries["gpu_check"]["status"] == ("ok" if torch.cuda.is_available() else "skipped")
    assert "## batch_size" in (tmp_path / "report.md").read_text()
