"""A forked DDP fit (a notebook's) hands rank zero's decisions and reports back to the Trainer the notebook holds.

With ``start_method="fork"`` (Lightning's ``"ddp_fork"``, what `~lightning_speedkit.preset` uses in an interactive
session) the fit runs in forked processes, and Lightning's launcher brings back to the notebook's process only the
weights, the trainer state and ``callback_metrics``: the callbacks there never ran, so ``trainer.speedkit.decisions()``
was empty and `~lightning_speedkit.loggers.RunSummary`'s ``report()`` too. `ForkedDDPStrategy`'s launcher sends rank
zero's lever decisions (as they were made: measured, remembered, skipped) and run summary back with them, and puts
them into the notebook's callbacks of the same ``state_key``: what a fit in one process leaves there. A later
``trainer.fit`` of the same job in the notebook then applies those decisions without probing, as a second fit in one
process does (`lightning_speedkit.trials.Lever.holds`).
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher
from typing_extensions import override

from lightning_speedkit.loggers import RunSummary
from lightning_speedkit.trials import Decision, Lever

__all__ = ["ForkedDDPStrategy", "adopt_results", "rank_zero_results"]

_KEY = "speedkit"


def rank_zero_results(callbacks: list[Any]) -> dict[str, Any]:
    """What the notebook's callbacks should hold after the fit: each lever's decision by ``state_key``, the summary.

    Example:
        >>> rank_zero_results([RunSummary()])
        {'decisions': {}, 'summary': {}}
    """
    decisions = {c.state_key: c.decision.as_dict() for c in callbacks if isinstance(c, Lever) and c.decision}
    summary = next((c.report() for c in callbacks if isinstance(c, RunSummary)), {})
    return {"decisions": decisions, "summary": summary}


def adopt_results(callbacks: list[Any], results: dict[str, Any]) -> None:
    """Put `rank_zero_results` into ``callbacks``: a lever of the same ``state_key`` takes its decision as it was."""
    decisions = results.get("decisions", {})
    for callback in callbacks:
        if isinstance(callback, Lever) and callback.state_key in decisions:
            callback._decision = Decision.from_dict(decisions[callback.state_key])
        elif isinstance(callback, RunSummary):
            callback.summary = dict(results.get("summary", {}))


class _DecisionsBack(_MultiProcessingLauncher):
    """Lightning's launcher for forked and spawned processes, with rank zero's `rank_zero_results` sent back too."""

    @override
    def get_extra_results(self, trainer: pl.Trainer) -> dict[str, Any]:
        return {**super().get_extra_results(trainer), _KEY: rank_zero_results(trainer.callbacks)}  # type: ignore[attr-defined]

    @override
    def update_main_process_results(self, trainer: pl.Trainer, extra: dict[str, Any]) -> None:
        super().update_main_process_results(trainer, extra)
        if _KEY in extra:
            adopt_results(trainer.callbacks, extra[_KEY])  # type: ignore[attr-defined]


class ForkedDDPStrategy(DDPStrategy):
    """`DDPStrategy` whose forked (or spawned) processes send speedkit's decisions and reports back to this one.

    Example:
        >>> ForkedDDPStrategy(start_method="fork", process_group_backend="gloo")._start_method
        'fork'
    """

    @override
    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        if type(self._launcher) is _MultiProcessingLauncher:  # not popen's, whose main process is rank zero
            self._launcher = _DecisionsBack(self, start_method=self._launcher._start_method)
