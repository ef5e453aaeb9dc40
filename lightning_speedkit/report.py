"""Files written whole or not at all, and reports as data: the `Reports` protocol, atomic writes, logger payloads."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from lightning_speedkit.hardware import cpu_info

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = [
    "Reports",
    "atomic_directory",
    "atomic_file",
    "cache_dir",
    "collect_reports",
    "flatten_reports",
    "log_rank_zero",
    "machine_and_load",
    "quiet_logger",
    "write_json_atomic",
    "write_text_atomic",
]

_SECRET_MARKERS = ("api_key", "apikey", "token", "secret", "password")


@runtime_checkable
class Reports(Protocol):
    """What every speedkit callback offers: ``report()``, a plain dict of what it decided and measured.

    The dict holds numbers, strings, bools, None, lists and nested dicts (JSON-ready): `RunSummary
    <lightning_speedkit.loggers.RunSummary>` writes it to ``speedkit_summary.json`` and `flatten_reports` turns
    it into logger keys. Before the callback has run it still returns a dict (saying so), never None.
    """

    def report(self) -> dict[str, Any]:
        """What was decided and measured, as a plain dict."""
        ...


def collect_reports(objects: Iterable[object]) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """The non-empty ``report()`` dicts of ``objects`` by class name, and why any were left out.

    Objects without a ``report`` are passed over in silence. One whose ``report`` is not a method, or whose
    ``report()`` returns something other than a dict, is left out, with a line saying why (a summary at the end of
    fit is no reason to fail a finished run). Of two objects of the same class, the first keeps the plain name and
    the next one is ``Name#2``.

    Example:
        >>> class Good:
        ...     def report(self):
        ...         return {"decision": "kept"}
        >>> class Bad:
        ...     def report(self):
        ...         return "kept"
        >>> reports, problems = collect_reports([Good(), Bad(), object(), Good()])
        >>> reports
        {'Good': {'decision': 'kept'}, 'Good#2': {'decision': 'kept'}}
        >>> problems
        ["Bad.report() must return a dict, got str 'kept'; left out of the summary"]
    """
    reports: dict[str, dict[str, Any]] = {}
    problems: list[str] = []
    for obj in objects:
        if not isinstance(obj, Reports):
            continue
        name = type(obj).__name__
        method = getattr(obj, "report", None)
        if not callable(method):
            shown = type(method).__name__
            problems.append(f"{name}.report must be a method returning a dict, got a {shown}; left out of the summary")
            continue
        value = method()
        if not isinstance(value, dict):
            shown = f"{type(value).__name__} {value!r}"[:80]
            problems.append(f"{name}.report() must return a dict, got {shown}; left out of the summary")
            continue
        if value:
            key, count = name, 1
            while key in reports:
                count += 1
                key = f"{name}#{count}"
            reports[key] = value
    return reports, problems


def cache_dir() -> Path:
    """Where speedkit keeps files between runs: ``$SPEEDKIT_CACHE_DIR``, else ``~/.cache/lightning_speedkit``.

    Example:
        >>> import os
        >>> os.environ["SPEEDKIT_CACHE_DIR"] = "/tmp/sk"; str(cache_dir()); del os.environ["SPEEDKIT_CACHE_DIR"]
        '/tmp/sk'
    """
    env = os.environ.get("SPEEDKIT_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "lightning_speedkit"


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; when the block succeeds it replaces ``path`` in one rename.

    On an error the temporary file is removed and ``path`` is left as it was: never a half-written file. The file
    gets the permissions of any file the user creates (the umask), not ``mkstemp``'s 0600.

    Example:
        >>> import tempfile
        >>> target = Path(tempfile.mkdtemp()) / "note.txt"
        >>> with atomic_file(target) as tmp:
        ...     _ = tmp.write_text("done")
        >>> target.read_text()
        'done'
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def atomic_directory(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a private temporary directory beside ``path``; when the block succeeds it is renamed to ``path``.

    A crash leaves only ``.<name>.tmp-<pid>-<id>`` behind (never a half-filled ``path``). If another process
    renamed its own complete directory into place first, ours is discarded and theirs is kept.

    Example:
        >>> import tempfile
        >>> target = Path(tempfile.mkdtemp()) / "set"
        >>> with atomic_directory(target) as tmp:
        ...     _ = (tmp / "a.txt").write_text("1")
        >>> sorted(p.name for p in target.iterdir())
        ['a.txt']
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        yield tmp
        try:
            os.rename(tmp, path)
        except OSError:
            if not path.is_dir():  # not a lost race: a real failure
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def write_text_atomic(text: str, path: str | os.PathLike[str]) -> Path:
    """Write ``text`` to ``path`` through `atomic_file`."""
    with atomic_file(path) as tmp:
        tmp.write_text(text)
    return Path(path)


def write_json_atomic(data: Any, path: str | os.PathLike[str]) -> Path:
    """Write ``data`` as indented JSON to ``path`` through `atomic_file`: never a half-written file.

    Strict JSON (RFC 8259, what ``jq`` and JavaScript read): an infinite or NaN float is written as null.

    Example:
        >>> import tempfile
        >>> import json
        >>> path = write_json_atomic({"a": 1, "b": [float("inf")]}, Path(tempfile.mkdtemp()) / "r.json")
        >>> json.loads(path.read_text())
        {'a': 1, 'b': [None]}
    """
    return write_text_atomic(json.dumps(_finite(data), indent=2, default=str, allow_nan=False), path)


def _finite(data: Any) -> Any:
    """``data`` with every non-finite float (in dicts, lists and tuples) as None."""
    if isinstance(data, float):
        return data if math.isfinite(data) else None
    if isinstance(data, dict):
        return {key: _finite(value) for key, value in data.items()}
    if isinstance(data, (list, tuple)):
        return [_finite(value) for value in data]
    return data


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def flatten_reports(reports: dict[str, Any], prefix: str = "speedkit") -> dict[str, Any]:
    """Flatten nested report dicts into ``prefix/a/b`` keys, keeping numbers, strings and bools.

    Keys that look like secrets (api keys, tokens, passwords) are dropped, whatever their value.

    Example:
        >>> flatten_reports({"monitor": {"diagnosis": "compute_bound", "total": {"steps": 4}}, "x": [1]})
        {'speedkit/monitor/diagnosis': 'compute_bound', 'speedkit/monitor/total/steps': 4}
    """
    flat: dict[str, Any] = {}
    for key, value in reports.items():
        if any(marker in str(key).lower() for marker in _SECRET_MARKERS):
            continue
        name = f"{prefix}/{key}"
        if isinstance(value, dict):
            flat.update(flatten_reports(value, name))
        elif isinstance(value, (bool, int, float, str)):
            flat[name] = value
    return flat


def machine_and_load(load_before: Sequence[float]) -> dict[str, Any]:
    """Where a report's figures come from: the CPU, and how busy the machine was (a busy one makes every figure noisy).

    ``machine`` is `lightning_speedkit.hardware.CpuInfo.machine`; ``load_average`` the 1/5/15-minute load
    ``load_before`` the work (``os.getloadavg()``) and after it, now.
    """
    load = {"before": list(load_before), "after": list(os.getloadavg())}
    return {"machine": cpu_info().machine(), "load_average": load}


def log_rank_zero(trainer: pl.Trainer, metrics: dict[str, float], step: int | None = None) -> None:
    """Send ``metrics`` to every logger of ``trainer``, on rank zero only (at ``step``, default the global step)."""
    if not trainer.is_global_zero:
        return
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=trainer.global_step if step is None else step)


@contextlib.contextmanager
def quiet_logger(name: str | None, level: int = logging.ERROR) -> Iterator[None]:
    """Raise the logger ``name`` (None: the root logger) to ``level`` while the block runs, then put it back.

    For messages that say nothing to the user here: the ONNX exporter's "torchvision is not installed"
    (``torch.onnx._internal.exporter._registration``), ONNX Runtime's quantizer noting every 1-D weight on the root
    logger, and Lightning's "`Trainer.fit` stopped: `max_steps=4` reached." after every trial's steps.

    Example:
        >>> with quiet_logger("lightning.pytorch.utilities.rank_zero", logging.WARNING):
        ...     logging.getLogger("lightning.pytorch.utilities.rank_zero").isEnabledFor(logging.INFO)
        False
    """
    logger = logging.getLogger(name)
    previous = logger.level
    logger.setLevel(level)
    try:
        yield
    finally:
        logger.setLevel(previous)
