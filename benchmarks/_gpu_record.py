"""The GPU check's run record: every part's and row's status in a JSON written as it goes, and the watchdog.

Statuses are ``ok``, ``partial``, ``failed``, ``timeout`` or ``skipped: <why>``. The JSON is written atomically when
the run starts and after every row and part; an error is recorded with its traceback and the next part runs. When the
time budget runs out the watchdog marks the part it interrupted ``timeout`` and ends the process (`EXIT_TIMEOUT`): a
hung CUDA call or loader cannot hold the check.
"""

from __future__ import annotations

import contextlib
import gc
import os
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from lightning_speedkit.report import write_json_atomic

__all__ = [
    "EXIT_FAILED",
    "EXIT_OK",
    "EXIT_TIMEOUT",
    "MIN_PART_S",
    "RunRecord",
    "error_line",
    "exit_code",
    "passed",
    "recorded_row",
    "release",
]

MIN_PART_S = 10.0  # a part (or row) that would start with less of the budget left is skipped, not cut short
EXIT_OK, EXIT_FAILED, EXIT_TIMEOUT = 0, 1, 3


class RunRecord:
    """The result, written atomically after every row and part, and a watchdog that ends the run on its budget.

    When the budget runs out the watchdog marks the part it interrupted ``timeout`` and the parts still to come
    ``skipped``, writes the JSON, prints ``table(result)`` (when given) and ends the process with `EXIT_TIMEOUT`
    through ``exit_fn``.
    """

    def __init__(
        self,
        result: dict[str, Any],
        out: Path,
        budget_s: float,
        exit_fn: Callable[[int], Any] = os._exit,
        table: Callable[[dict[str, Any]], str] | None = None,
    ) -> None:
        self.result, self.out, self.budget_s, self.exit_fn, self.table = result, out, budget_s, exit_fn, table
        self.started = time.monotonic()
        self.current: str | None = None
        self.lock = threading.RLock()
        self.timer = threading.Timer(budget_s, self.expire)
        self.timer.daemon = True

    def left(self) -> float:
        """Seconds of the budget left."""
        return self.budget_s - (time.monotonic() - self.started)

    def save(self) -> None:
        """Write the JSON now; never raises (a failed write is printed and the check goes on)."""
        with self.lock:
            self.result["seconds"] = round(time.monotonic() - self.started, 1)
            for _ in range(3):
                try:
                    write_json_atomic(self.result, self.out)
                    return
                except RuntimeError:  # a row changed while json walked the dict: again
                    continue
                except Exception as exc:
                    print(f"gpu_check: could not write {self.out} ({type(exc).__name__}: {exc})", flush=True)
                    return

    def part(
        self, name: str, body: Callable[[dict[str, Any]], None], inject: str | None = None, min_s: float = MIN_PART_S
    ) -> None:
        """Run one part; its status (and error) reach the JSON whatever happens, and the next part runs regardless."""
        entry = self.result["parts"][name]
        if self.left() < min_s:
            entry["status"] = f"skipped: {max(0.0, self.left()):.0f} s of the budget left, the part needs {min_s:.0f}"
            self.save()
            return
        self.current, entry["status"], start = name, "running", time.monotonic()
        print(f"{name} ...", flush=True)
        self.save()
        try:
            body(entry)
            if inject == name:
                raise RuntimeError(f"injected failure (--inject-failure {name})")
            if entry["status"] == "running":
                bad = [row for row in entry.get("rows", []) if not passed(row["status"])]
                entry["status"] = "partial" if bad else "ok"
        except Exception as exc:
            entry.update(status="failed", error=error_line(exc), traceback=traceback.format_exc()[-4000:])
            print(f"  {name} failed: {entry['error']}", flush=True)
        finally:
            entry["seconds"] = round(time.monotonic() - start, 1)
            self.current = None
            release()
            self.save()

    def expire(self) -> None:
        """The budget ran out: record it, write, print what there is, end the process."""
        locked = self.lock.acquire(timeout=10)
        try:
            for name, entry in self.result["parts"].items():
                if name == self.current:
                    entry.update(status="timeout", error=f"the time budget of {self.budget_s:.0f} s ran out here")
                elif entry["status"] in ("pending", "running"):
                    entry["status"] = "skipped: the time budget ran out"
            self.result["status"] = "timeout"
            self.save()
            if self.table is not None:
                with contextlib.suppress(Exception):
                    print(self.table(self.result), flush=True)
            print(
                f"gpu_check: the budget of {self.budget_s:.0f} s ran out in {self.current}; wrote {self.out}",
                flush=True,
            )
        finally:
            if locked:
                self.lock.release()
            self.exit_fn(EXIT_TIMEOUT)


@contextlib.contextmanager
def recorded_row(record: RunRecord, rows: list[dict[str, Any]], /, **fields: Any) -> Iterator[dict[str, Any]]:
    """A row appended to ``rows``: an error inside is recorded in it (not raised), and the JSON is written after it."""
    entry = {**fields, "status": "ok"}
    rows.append(entry)
    try:
        yield entry
    except Exception as exc:
        entry.update(status=f"failed: {error_line(exc)}", traceback=traceback.format_exc()[-2000:])
        print(f"  {' '.join(map(str, fields.values()))} failed: {error_line(exc)}", flush=True)
    finally:
        record.save()


def passed(status: str) -> bool:
    """Whether a part or row with this status counts as passed: ``ok`` or skipped."""
    return status == "ok" or status.startswith("skipped")


def error_line(exc: BaseException) -> str:
    """``Type: first line of the message`` (at most 300 characters of it)."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0][:300] if lines else ''}"


def release() -> None:
    """Collect garbage, return the CUDA allocator's cached blocks; never raises (a failed part may break CUDA)."""
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        with contextlib.suppress(Exception):
            torch.cuda.synchronize()
            torch.cuda.empty_cache()


def exit_code(result: dict[str, Any]) -> int:
    """0 when every part passed or was skipped (or the whole check was), 1 when one did not, 3 on a timeout."""
    if result.get("status") == "timeout":
        return EXIT_TIMEOUT
    return EXIT_OK if result.get("skipped") or result.get("status") == "ok" else EXIT_FAILED
