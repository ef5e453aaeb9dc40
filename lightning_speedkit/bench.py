"""``speedkit bench``: run the repository's ``benchmarks/*.py`` scripts and collect their tables into one report."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning_speedkit.__about__ import __version__
from lightning_speedkit.checks import unwritable
from lightning_speedkit.report import write_json_atomic, write_text_atomic

__all__ = [
    "BenchmarksNotFoundError",
    "add_arguments",
    "discover",
    "find_benchmarks_dir",
    "format_markdown",
    "main",
    "run_benchmarks",
    "run_from_args",
]

ENV_DIR = "SPEEDKIT_BENCHMARKS_DIR"
"""Environment variable naming the benchmarks directory (else the checkout this package runs from, else ./)."""

_NOT_FOUND = (
    "speedkit bench: no benchmarks directory found. The benchmarks are scripts in the lightning_speedkit repository"
    " (benchmarks/*.py), not part of the installed package: run `speedkit bench` from a checkout of the repository,"
    " or pass --benchmarks-dir PATH (or set ${env})."
)


class BenchmarksNotFoundError(FileNotFoundError):
    """There is no ``benchmarks/`` directory: the package is installed without the repository."""


def discover(directory: str | os.PathLike[str]) -> list[str]:
    """The benchmark names in ``directory``: its ``*.py`` files that do not start with ``_``, sorted.

    Example:
        >>> import tempfile
        >>> d = Path(tempfile.mkdtemp())
        >>> for name in ("pruning.py", "int8.py", "_helpers.py", "notes.md"):
        ...     _ = (d / name).write_text("")
        >>> discover(d)
        ['int8', 'pruning']
    """
    return sorted(p.stem for p in Path(directory).glob("*.py") if not p.name.startswith("_"))


def find_benchmarks_dir(directory: str | os.PathLike[str] | None = None) -> Path:
    """The directory of benchmark scripts: given, from the environment, in the checkout, or in the working directory.

    In that order: ``directory``, else ``$SPEEDKIT_BENCHMARKS_DIR``, else the repository checkout this package runs
    from (``<repo>/benchmarks`` beside ``<repo>/pyproject.toml``), else ``./benchmarks``.

    Raises:
        BenchmarksNotFoundError: If the chosen (or every candidate) directory holds no benchmark script.
    """
    if directory is not None or os.environ.get(ENV_DIR):
        chosen = Path(directory if directory is not None else os.environ[ENV_DIR])
        if not (chosen.is_dir() and discover(chosen)):
            raise BenchmarksNotFoundError(f"{_NOT_FOUND.format(env=ENV_DIR)} {chosen} holds no benchmark script.")
        return chosen
    repo = Path(__file__).resolve().parents[1]
    candidates = [repo / "benchmarks"] if (repo / "pyproject.toml").is_file() else []
    candidates.append(Path.cwd() / "benchmarks")
    for candidate in candidates:
        if candidate.is_dir() and discover(candidate):
            return candidate
    raise BenchmarksNotFoundError(_NOT_FOUND.format(env=ENV_DIR))


def run_benchmarks(
    names: Sequence[str] | None = None,
    quick: bool = False,
    out_dir: str | os.PathLike[str] = "speedkit_out/bench",
    benchmarks_dir: str | os.PathLike[str] | None = None,
    timeout_s: float | None = None,
    verbose: bool = True,
) -> dict[str, Any]:
    """Run each benchmark script in its own process and collect what it printed and the JSON it wrote.

    Each runs as ``python benchmarks/<name>.py [--quick] --out <out_dir>/<name>.json`` from the repository root;
    its stdout (the table) and stderr go to ``<out_dir>/<name>.log``. The report is written to
    ``<out_dir>/report.json`` and ``<out_dir>/report.md`` after every benchmark (atomically), so an interrupted run
    still leaves a complete report of what finished.

    Args:
        names: Benchmarks to run (default: every script in the directory, sorted).
        quick: Pass ``--quick`` (small sizes: seconds to a minute each, for smoke tests).
        out_dir: Where the JSON files, logs and the report go.
        benchmarks_dir: The directory of scripts (default: see `find_benchmarks_dir`).
        timeout_s: Stop a benchmark after this many seconds and mark it ``timeout`` (None: no limit).
        verbose: Echo each benchmark's output as it runs.

    Returns:
        The report: ``quick``, ``environment``, ``benchmarks_dir``, ``out_dir``, ``seconds`` and ``benchmarks``
        (name -> ``status`` (``ok``, ``skipped``, ``failed``, ``timeout``), ``returncode``, ``seconds``,
        ``table`` (the printed text), ``result`` (the JSON it wrote, or None), ``json``, ``log``).

    Raises:
        BenchmarksNotFoundError: If there is no benchmarks directory.
        ValueError: If ``names`` holds a benchmark that does not exist, ``timeout_s`` is not positive, or ``out_dir``
            cannot be made a directory (a file is there, no permission).
    """
    directory = find_benchmarks_dir(benchmarks_dir).resolve()  # the scripts run from its parent: no relative paths
    available = discover(directory)
    chosen = list(names) if names else available
    unknown = [name for name in chosen if name not in available]
    if unknown:
        raise ValueError(f"`names` must be among {', '.join(available)}, got {', '.join(map(repr, unknown))}.")
    if timeout_s is not None and not 0 < timeout_s < math.inf:  # inf: the timer thread crashed, the limit was gone
        raise ValueError(f"`timeout_s` must be a positive number of seconds, finite, or None, got {timeout_s!r}.")
    out = Path(out_dir)
    if not os.fspath(out_dir).strip():  # Path("") is the working directory
        raise ValueError(f"`out_dir` must be a directory, got {os.fspath(out_dir)!r}.")
    try:
        out.mkdir(parents=True, exist_ok=True)
        problem = unwritable(out)  # an existing directory no file can be made in: before any benchmark runs
    except OSError as err:  # a file there, or no permission
        problem = err.strerror or str(err)
    if problem:
        shown = f"{os.fspath(out_dir)!r} ({problem})"
        raise ValueError(f"`out_dir` must be a directory this user can write to, got {shown}.") from None
    out = out.resolve()
    report: dict[str, Any] = {
        "speedkit_version": __version__,
        "quick": quick,
        "environment": _environment(),
        "benchmarks_dir": str(directory.resolve()),
        "out_dir": str(out.resolve()),
        "seconds": 0.0,
        "benchmarks": {},
    }
    start = time.perf_counter()
    for index, name in enumerate(chosen, 1):
        if verbose:
            print(f"speedkit bench [{index}/{len(chosen)}] {name} ...", flush=True)
        entry = _run_one(directory, name, quick, out, timeout_s, verbose)
        report["benchmarks"][name] = entry
        report["seconds"] = time.perf_counter() - start
        _write_report(report, out)
        if verbose:
            print(f"speedkit bench [{index}/{len(chosen)}] {name}: {entry['status']} in {entry['seconds']:.1f} s")
    return report


def _run_one(
    directory: Path, name: str, quick: bool, out: Path, timeout_s: float | None, verbose: bool
) -> dict[str, Any]:
    json_path, log_path = out / f"{name}.json", out / f"{name}.log"
    json_path.unlink(missing_ok=True)  # a stale result must not pass for this run's
    command = [sys.executable, str(directory / f"{name}.py"), *(["--quick"] if quick else []), "--out", str(json_path)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    start = time.perf_counter()
    process = subprocess.Popen(  # a session of its own: a timeout stops the processes it started too
        command, cwd=directory.parent, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    timed_out = threading.Event()

    def stop() -> None:
        timed_out.set()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)  # its children hold the output pipes open: reading never ended

    timer = threading.Timer(timeout_s, stop) if timeout_s is not None else None
    if timer is not None:
        timer.start()
    stderr: list[str] = []
    reader = threading.Thread(target=lambda: stderr.extend(process.stderr or ()), daemon=True)
    reader.start()
    stdout: list[str] = []
    try:
        for line in process.stdout or ():
            stdout.append(line)
            if verbose:
                print(f"  {line}", end="", flush=True)
        returncode = process.wait()
    except BaseException:  # Ctrl-C reaches this process only (the benchmark has a session of its own): stop it too
        stop()
        process.wait()
        raise
    finally:
        if timer is not None:
            timer.cancel()
    reader.join()
    seconds = time.perf_counter() - start
    log_path.write_text(f"$ {' '.join(command)}\n--- stdout\n{''.join(stdout)}--- stderr\n{''.join(stderr)}")
    result = _read_json(json_path)
    table = "".join(line for line in stdout if not line.startswith("wrote ")).strip("\n")
    if timed_out.is_set():
        status = "timeout"
    elif returncode != 0:
        status = "failed"
    elif isinstance(result, dict) and result.get("skipped"):
        status = "skipped"
    else:
        status = "ok" if result is not None else "failed"
    entry: dict[str, Any] = {
        "status": status,
        "returncode": returncode,
        "seconds": seconds,
        "command": command,
        "table": table,
        "result": result,
        "json": str(json_path) if result is not None else None,
        "log": str(log_path),
    }
    if status in ("failed", "timeout"):
        entry["error_tail"] = "".join(stderr[-20:]) or "(no output on stderr)"
        if result is None and returncode == 0:
            entry["error_tail"] = f"exited 0 but wrote no JSON to {json_path}"
    return entry


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _environment() -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "cuda": torch.cuda.is_available(),
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "cpu_cores": os.cpu_count(),
    }
    try:
        import lightning

        info["lightning"] = lightning.__version__
    except ImportError:  # pragma: no cover - lightning is a dependency
        pass
    return info


def format_markdown(report: dict[str, Any]) -> str:
    """The report as Markdown: a summary table, then each benchmark's printed table.

    Example:
        >>> entry = {"status": "ok", "seconds": 1.5, "table": "a  b", "json": "x.json", "result": {}}
        >>> print(format_markdown({"quick": True, "environment": {}, "benchmarks": {"int8": entry}}))
        ... # doctest: +NORMALIZE_WHITESPACE
        # speedkit bench (quick)
        <BLANKLINE>
        | benchmark | status | seconds | JSON |
        |---|---|---:|---|
        | int8 | ok | 1.5 | x.json |
        <BLANKLINE>
        ## int8
        <BLANKLINE>
        ```text
        a  b
        ```
    """
    env = report.get("environment", {})
    lines = [f"# speedkit bench{' (quick)' if report.get('quick') else ''}", ""]
    if env:
        gpus = ", ".join(env.get("gpus") or []) or "none"
        lines += [
            f"speedkit {report.get('speedkit_version', '?')}, Python {env.get('python')}, torch {env.get('torch')},"
            f" lightning {env.get('lightning', '?')}; {env.get('cpu_cores')} CPU cores; GPUs: {gpus}",
            "",
        ]
    lines += ["| benchmark | status | seconds | JSON |", "|---|---|---:|---|"]
    for name, entry in report["benchmarks"].items():
        json_name = Path(entry["json"]).name if entry.get("json") else "-"  # beside report.md
        lines.append(f"| {name} | {entry['status']} | {entry['seconds']:.1f} | {json_name} |")
    for name, entry in report["benchmarks"].items():
        lines += ["", f"## {name}", "", "```text", entry["table"] or "(printed nothing)", "```"]
        if entry.get("error_tail"):
            lines += ["", f"{entry['status']} (exit code {entry.get('returncode')}); last lines of stderr:", ""]
            lines += ["```text", entry["error_tail"].rstrip("\n"), "```"]
    return "\n".join(lines)


def _write_report(report: dict[str, Any], out: Path) -> None:
    write_json_atomic(report, out / "report.json")
    write_text_atomic(format_markdown(report) + "\n", out / "report.md")


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add ``speedkit bench``'s arguments to ``parser`` (the ``bench`` sub-parser of ``speedkit``)."""
    parser.add_argument("names", nargs="*", metavar="NAME", help="benchmarks to run (default: all)")
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke run, not a measurement")
    parser.add_argument("--out", default="speedkit_out/bench", help="directory for the report (default: %(default)s)")
    parser.add_argument("--benchmarks-dir", help=f"the benchmark scripts (default: ${ENV_DIR} or the checkout)")
    parser.add_argument("--timeout", type=float, help="seconds before a benchmark is stopped (default: none)")
    parser.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    return parser


def run_from_args(args: argparse.Namespace) -> int:
    """Run ``speedkit bench`` with parsed arguments; 0 if every benchmark passed or skipped, 1 if not, 2 if none."""
    try:
        if args.list:
            print("\n".join(discover(find_benchmarks_dir(args.benchmarks_dir))))
            return 0
        report = run_benchmarks(args.names, args.quick, args.out, args.benchmarks_dir, args.timeout)
    except BenchmarksNotFoundError as exc:
        print(exc, file=sys.stderr)
        return 2
    except ValueError as exc:  # named as the command line names them
        shown = str(exc).replace("`timeout_s`", "--timeout").replace("`names`", "NAME").replace("`out_dir`", "--out")
        print(f"speedkit bench: {shown}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"speedkit bench: interrupted; {Path(args.out) / 'report.md'} holds what finished", file=sys.stderr)
        return 130
    print(f"\n{format_markdown(report)}\n\nwrote {Path(args.out) / 'report.md'} and report.json")
    return 0 if all(e["status"] in ("ok", "skipped") for e in report["benchmarks"].values()) else 1


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m lightning_speedkit.bench``: the same as ``speedkit bench``."""
    parser = add_arguments(argparse.ArgumentParser(prog="speedkit bench", description=__doc__))
    return run_from_args(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
