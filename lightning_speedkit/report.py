"""Reports are data: write them atomically as JSON and flatten them into logger payloads."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["flatten_reports", "write_json_atomic"]

_SECRET_MARKERS = ("api_key", "apikey", "token", "secret", "password")


def write_json_atomic(data: Any, path: str | os.PathLike[str]) -> Path:
    """Write ``data`` as JSON to ``path`` through a temporary file and one rename: never a half-written file.

    Example:
        >>> import tempfile
        >>> import json
        >>> json.loads(write_json_atomic({"a": 1}, Path(tempfile.mkdtemp()) / "r.json").read_text())
        {'a': 1}
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as handle:
            json.dump(data, handle, indent=2, default=str)
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; a report is as readable as any file the user writes
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


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
