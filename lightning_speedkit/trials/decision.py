"""`Decision`: what a lever decided, and why, as one record for reports, logs, checkpoints and the decision memory."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from lightning_speedkit.restore import ListOf, StateSpec

__all__ = ["DECISION_SPEC", "SOURCES", "Decision"]

DECISION_SPEC: StateSpec = {
    "decision": str,
    "reason": str,
    "probed": bool,
    "probe_s": float,
    "step_s": dict,
    "rejected": dict,
    "source": str,
    "steps_left": (float, None),
    "trials": ListOf(dict),
    "job": (str, None),
}
"""What a saved `Decision` holds (its fields, the ones `measure` adds, and ``job``: the key of the job it was made for,
`lightning_speedkit.trials.Lever.holds`), checked before a checkpoint is restored."""

SOURCES = ("measured", "remembered", "resumed", "skipped")
"""Where a decision came from: measured now, remembered from an earlier run, resumed from a checkpoint, or skipped
(nothing was measured: the probe could not pay back, there was nothing to try, or it was not asked for)."""


@dataclass
class Decision:
    """What a lever decided, and why, as one record for reports, logs and checkpoints.

    Attributes:
        decision: The name of the setting in use (``"channels_last"``, ``"bf16-mixed"``, ``"64"``, ``"x2"``...).
        reason: One line: why this setting (or why nothing was measured).
        probed: Whether real steps were timed for it.
        probe_s: Seconds the probe took (0.0 without one).
        step_s: Median seconds per training step by setting (None for a setting that failed or was rejected).
        rejected: Setting -> why it was rejected (a non-finite or worse loss, an out-of-memory error...).
        source: One of `SOURCES`.
        extra: The lever's own fields (``trials``, ``steps_left``, ``chosen``, ``scale``, ``curve``...).

    Example:
        >>> d = Decision("channels_last", "25.0% faster", probed=True, probe_s=0.4, step_s={"default": 0.02})
        >>> Decision.from_dict(d.as_dict()) == d
        True
        >>> d.as_dict()["source"], d.summary()["step_ms"]
        ('measured', {'default': 20.0})
    """

    decision: str
    reason: str
    probed: bool = False
    probe_s: float = 0.0
    step_s: dict[str, float | None] = field(default_factory=dict)
    rejected: dict[str, str] = field(default_factory=dict)
    source: str = "measured"
    extra: dict[str, Any] = field(default_factory=dict)

    FIELDS: ClassVar[tuple[str, ...]] = ("decision", "reason", "probed", "probe_s", "step_s", "rejected", "source")

    @classmethod
    def skipped(cls, decision: str, reason: str, **extra: Any) -> Decision:
        """Nothing measured: ``decision`` stays in place, for ``reason``."""
        return cls(decision, reason, source="skipped", extra=extra)

    def as_dict(self) -> dict[str, Any]:
        """A plain dict: the fields, then the lever's own ones (for checkpoints and JSON reports)."""
        fields = {name: getattr(self, name) for name in self.FIELDS}
        return {**fields, "step_s": dict(self.step_s), "rejected": dict(self.rejected), **self.extra}

    @classmethod
    def from_dict(cls, value: Mapping[str, Any]) -> Decision:
        """The record `as_dict` wrote (keys it does not know go to ``extra``).

        Raises:
            ValueError: If a field has the wrong type, naming it.
        """
        kinds: dict[str, tuple[type, ...]] = {"decision": (str,), "reason": (str,), "probed": (bool,)}
        kinds.update(probe_s=(int, float), step_s=(dict,), rejected=(dict,), source=(str,))
        for name, kind in kinds.items():
            item = value.get(name, "" if name in ("decision", "reason") else None)
            if item is not None and (not isinstance(item, kind) or (kind != (bool,) and isinstance(item, bool))):
                raise ValueError(f"a decision's `{name}` must be {kind[0].__name__}, got {item!r}.")
        source = value.get("source", "measured")
        if source not in SOURCES:
            raise ValueError(f"a decision's `source` must be one of {', '.join(SOURCES)}, got {source!r}.")
        return cls(
            decision=str(value.get("decision", "")),
            reason=str(value.get("reason", "")),
            probed=bool(value.get("probed", False)),
            probe_s=float(value.get("probe_s") or 0.0),
            step_s=dict(value.get("step_s") or {}),
            rejected=dict(value.get("rejected") or {}),
            source=source,
            extra={k: v for k, v in value.items() if k not in cls.FIELDS},
        )

    def summary(self) -> dict[str, Any]:
        """The record for a ``report()``: step times in milliseconds (``step_ms``) instead of seconds."""
        step_ms = {"step_ms": {k: v if v is None else 1e3 * v for k, v in self.step_s.items()}} if self.step_s else {}
        return {**{k: v for k, v in self.as_dict().items() if k != "step_s"}, **step_ms}
