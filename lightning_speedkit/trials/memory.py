"""Decisions remembered across runs: each lever's decision on disk, under a fingerprint of what decides it.

The same job on the same machine (a sweep, a restart, tomorrow's run, every rank of every node) would probe every
lever again. torch.compile's cache artifacts and Triton's autotune cache keep their tuning on disk keyed by versions,
device and configuration; this does the same for speedkit's decisions. A decision is keyed by a `fingerprint` of:

- the model's structure (module types, parameter names, shapes and dtypes);
- the batch (the shapes and dtypes of one training sample, and the batch size) and the data set's length;
- the loader's settings, the number of devices and nodes, the precision (as built) and gradient accumulation;
- the Trainer's ``limit_train_batches``, ``val_check_interval`` and ``check_val_every_n_epoch`` (a batch size found
  for more batches an epoch may not fit fewer);
- the optimizers' and LR schedulers' classes (a schedule of the user's own changes what an LR decision means);
- the device: the CPU model and its ISA as torch dispatches it (a forced ISA too), the GPU name and capability;
- the torch, Lightning and speedkit versions;
- the lever and its arguments.

Any change makes another fingerprint, which is probed afresh. Files are written atomically in a directory per
fingerprint under `decisions_dir` (``$SPEEDKIT_CACHE_DIR/decisions``, by default under ``~/.cache``). A file that
cannot be read, belongs to another fingerprint or another speedkit version is ignored (the lever probes again and
its report says why), never a crash. `DecisionMemory.entries` lists what is remembered (``speedkit doctor``) and
`DecisionMemory.forget` clears it (``speedkit forget``).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import logging
import math
import os
import statistics
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from lightning_speedkit.__about__ import __version__
from lightning_speedkit.decisions import outside_band
from lightning_speedkit.report import cache_dir, write_json_atomic
from lightning_speedkit.timing import StepClock
from lightning_speedkit.trials.counted import queued_steps
from lightning_speedkit.trials.job import fingerprint, fingerprint_key
from lightning_speedkit.trials.lever import Decision

if TYPE_CHECKING:
    import lightning.pytorch as pl

log = logging.getLogger(__name__)

__all__ = [
    "FORMAT",
    "DecisionMemory",
    "Recalled",
    "Remembering",
    "decisions_dir",
    "fingerprint",
    "fingerprint_key",
    "outside_band",
]

FORMAT = 1
"""The file format of a remembered decision; a file of another format is ignored."""


def decisions_dir() -> Path:
    """``$SPEEDKIT_DECISIONS_DIR``, else ``$SPEEDKIT_CACHE_DIR/decisions`` (``~/.cache/lightning_speedkit/...``)."""
    env = os.environ.get("SPEEDKIT_DECISIONS_DIR")
    return Path(env) if env else cache_dir() / "decisions"


def _is_key(name: str) -> bool:
    """Whether a directory name is a `fingerprint_key`: 20 lower-case hex digits."""
    return len(name) == 20 and all(c in "0123456789abcdef" for c in name)


def _is_entry(path: Path) -> bool:
    """Whether the file at ``path`` is a remembered decision: JSON with this memory's ``format`` and a ``decision``."""
    try:
        entry = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(entry, dict) and entry.get("format") == FORMAT and isinstance(entry.get("decision"), dict)


@dataclass
class Recalled:
    """What `DecisionMemory.recall` found: the decision (None when there is none to use) and why not, if so."""

    decision: Decision | None
    note: str = ""


class DecisionMemory:
    """Remembered decisions on disk: one directory per fingerprint, one JSON file per lever.

    Args:
        root: The directory (default `decisions_dir`).
    """

    def __init__(self, root: str | os.PathLike[str] | None = None) -> None:
        self.root = Path(root) if root is not None else decisions_dir()

    def _file(self, print_: Mapping[str, Any]) -> Path:
        lever = str(print_.get("lever", "lever")).split("{", 1)[0]
        return self.root / fingerprint_key(print_) / f"{lever}.json"

    def recall(self, print_: Mapping[str, Any]) -> Recalled:
        """The decision remembered for this fingerprint, as ``source="remembered"``; a note when a file is unusable."""
        path = self._file(print_)
        if not path.exists():
            return Recalled(None)
        try:
            entry = json.loads(path.read_text())
            if not isinstance(entry, dict) or entry.get("format") != FORMAT:
                return Recalled(None, f"{path} is not a speedkit decision file (format {FORMAT}): probed again")
            if entry.get("speedkit") != __version__:
                why = f"{path} is from speedkit {entry.get('speedkit')}, not {__version__}: probed again"
                return Recalled(None, why)
            if entry.get("fingerprint") != json.loads(json.dumps(print_, default=str)):
                return Recalled(None, f"{path} belongs to another run's fingerprint: probed again")
            decision = Decision.from_dict(entry["decision"])
        except (OSError, ValueError, KeyError, TypeError) as err:
            return Recalled(None, f"{path} cannot be read ({type(err).__name__}: {err}): probed again")
        decision.source = "remembered"
        decision.extra["remembered_at"] = entry.get("made", "")
        decision.extra["remembered_in"] = str(path)
        return Recalled(decision)

    def remember(self, print_: Mapping[str, Any], decision: Decision) -> str:
        """Write ``decision`` for this fingerprint atomically; ``""`` on success, else why not (nothing raised)."""
        path = self._file(print_)
        stored = {k: v for k, v in decision.as_dict().items() if k not in ("trials", "remembered_at", "remembered_in")}
        entry = {
            "format": FORMAT,
            "speedkit": __version__,
            "made": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "fingerprint": json.loads(json.dumps(print_, default=str)),
            "decision": {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in stored.items()},
        }
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_json_atomic(entry, path)
        except OSError as err:
            return f"cannot write {path} ({err.strerror or err})"
        return ""

    def _key_dirs(self) -> list[Path]:
        """The fingerprint directories under the root, sorted; not what else a user keeps there (`_is_key`)."""
        return sorted(p for p in self.root.iterdir() if p.is_dir() and _is_key(p.name)) if self.root.is_dir() else []

    def forget(self) -> int:
        """Remove every remembered decision, and nothing else; how many there were.

        Only this memory's own files go: a ``<fingerprint key>/<lever>.json`` holding a decision it wrote, then the
        fingerprint directories and the root when that leaves them empty. Anything else a user keeps in the directory
        (``$SPEEDKIT_DECISIONS_DIR`` may name any) stays.
        """
        removed = 0
        for directory in self._key_dirs():
            for path in sorted(directory.glob("*.json")):
                if _is_entry(path):
                    path.unlink(missing_ok=True)
                    removed += 1
            for stale in directory.glob(".*.json.*.tmp"):  # a write killed half-way (`report.atomic_file`)
                stale.unlink(missing_ok=True)
            with contextlib.suppress(OSError):  # not empty: something of the user's is there
                directory.rmdir()
        with contextlib.suppress(OSError):
            self.root.rmdir()
        return removed

    def entries(self) -> list[dict[str, Any]]:
        """What is remembered, a dict per file: ``path``, ``lever``, ``decision``, ``reason``, ``made``, ``device``."""
        found = []
        for path in (path for directory in self._key_dirs() for path in sorted(directory.glob("*.json"))):
            try:
                entry = json.loads(path.read_text())
                decision = entry["decision"]
                found.append(
                    {
                        "path": str(path),
                        "lever": path.stem,
                        "decision": decision.get("decision"),
                        "reason": decision.get("reason"),
                        "made": entry.get("made"),
                        "speedkit": entry.get("speedkit"),
                        "device": entry.get("fingerprint", {}).get("device", {}).get("name"),
                    }
                )
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                found.append({"path": str(path), "lever": path.stem, "decision": None, "reason": "unreadable"})
        return found


_WARNED: set[Path] = set()


def _batch(trainer: pl.Trainer) -> int:
    """The run's current training batch, counted across epochs from 0."""
    return int(trainer.fit_loop.epoch_loop.total_batch_idx)


class Remembering:
    """One lever's use of the memory in one fit: recall before deciding, store a measured decision, check it live.

    The check costs nothing: the training steps the run takes anyway are timed (``CHECK_STEPS`` steps after the first
    ``CHECK_SKIP``), once no counted probe is pending (`lightning_speedkit.trials.counted`), so every setting is the
    run's own. A measured decision stores their median as ``live_step_s`` and the run's batch where they began as
    ``live_from``; a remembered one times the same batches of its run and compares their median with it, and outside a
    factor of ``BAND`` either way the entry is forgotten, so the next run probes again (a decision made on a loaded
    machine, or a machine that changed, does not stick). Like with like: checked on a later run's first steps, a layout
    decision stored right after its probe was forgotten at 0.64x (the demo). The band is wide because the same job on
    the same shared 2-core machine ran up to 1.45x slower under a second process's load; it catches that and a wrong
    layout or loader setting (1.2-2x on the demo).

    Args:
        enabled: The lever's ``remember`` argument.
        memory: Where decisions are kept (default `DecisionMemory()`).
    """

    CHECK_SKIP = 3
    CHECK_STEPS = 20
    BAND = 1.5

    def __init__(self, enabled: bool, memory: DecisionMemory | None = None) -> None:
        self.enabled = enabled
        self.memory = memory or DecisionMemory()
        self.print_: dict[str, Any] | None = None
        self.source = ""
        self.note = ""
        self.check: dict[str, Any] = {}
        self._times: list[float] = []
        self._clock = StepClock()
        self._steps = self._first = 0  # steps counted; the run's batch where the timed ones begin

    def recall(self, trainer: pl.Trainer, print_: dict[str, Any] | None, unread: str = "") -> Decision | None:
        """Rank zero's remembered decision for this run, on every rank (None: probe), unless remembering is off.

        ``print_`` is the run's `fingerprint` (`lightning_speedkit.trials.job.read_fingerprint`), or None with why it
        could not be read in ``unread``: the lever then decides as without memory.
        """
        if not self.enabled or torch.are_deterministic_algorithms_enabled():  # deterministic: the same on any machine
            return None
        if print_ is None:
            self.note = f"no fingerprint ({unread}); not remembered"
            self.enabled = False
            return None
        self.print_ = print_
        found = self.memory.recall(self.print_) if trainer.is_global_zero else Recalled(None)
        found = trainer.strategy.broadcast(found, src=0)
        self.note = found.note
        if found.decision is not None and isinstance(found.decision.extra.get("live_from"), int):
            self._first = found.decision.extra["live_from"]  # the check times the batches the stored figure timed
        return found.decision

    def store(self, trainer: pl.Trainer, decision: Decision) -> None:
        """Remember a measured decision (rank zero); an unwritable cache is one warning, and the run goes on."""
        if not self.enabled or self.print_ is None or decision.source != "measured" or not trainer.is_global_zero:
            return
        why = self.memory.remember(self.print_, decision)
        if why:
            self.note = f"not remembered: {why}"
            self.enabled = False
            if self.memory.root not in _WARNED:  # one warning per directory, whatever the number of levers
                _WARNED.add(self.memory.root)
                log.warning("lightning_speedkit: lever decisions are not remembered: %s", why)

    @property
    def timing(self) -> bool:
        """Whether the check still times steps (until then the lever needs its step hooks)."""
        return self.enabled and self._steps < self.CHECK_SKIP + self.CHECK_STEPS

    def step_started(self, trainer: pl.Trainer) -> None:
        """Time a step of the check: none while a counted probe is pending, or before the batches remembered."""
        if not self.timing:
            return
        if queued_steps(trainer) or _batch(trainer) < self._first - self.CHECK_SKIP:
            self._clock.reset()  # not a step of the check: the next one is timed from its start
            return
        self._clock.start()

    def step_ended(self, trainer: pl.Trainer, decision: Decision) -> None:
        """Count a timed step; after the last one, record (measured) or check (remembered) the live median."""
        if not self.enabled or not self._clock.running:
            return
        seconds = self._clock.stop()  # from the previous step's end: its batch's wait and its compute
        self._steps += 1
        if self._steps > self.CHECK_SKIP:
            self._times.append(seconds)
        if self._steps == self.CHECK_SKIP + 1 and decision.source == "measured":
            self._first = _batch(trainer)
        if self._steps != self.CHECK_SKIP + self.CHECK_STEPS:
            return
        live = float(trainer.strategy.broadcast(statistics.median(self._times), src=0))
        if decision.source == "measured":
            decision.extra.update(live_step_s=live, live_from=self._first)
            self.store(trainer, decision)
            return
        expected = decision.extra.get("live_step_s")
        if decision.source != "remembered" or not isinstance(expected, (int, float)) or expected <= 0:
            return
        ratio = live / float(expected)
        stale = outside_band(live, float(expected), self.BAND)
        self.check = {"live_step_s": live, "remembered_step_s": float(expected), "ratio": ratio, "stale": stale}
        if stale and trainer.is_global_zero and self.print_ is not None:
            path = self.memory._file(self.print_)
            path.unlink(missing_ok=True)
            self.note = (
                f"the run's steps took {ratio:.2f}x the remembered {1e3 * expected:.1f} ms (outside {self.BAND}x either"
                " way): the entry is forgotten, the next run probes again"
            )

    def report(self) -> dict[str, Any]:
        """``remember`` (on or off), ``memory_note`` (why a file was not used or written) and ``memory_check``."""
        out: dict[str, Any] = {"remember": self.enabled}
        if self.note:
            out["memory_note"] = self.note
        if self.check:
            out["memory_check"] = dict(self.check)
        return out
