"""The two places in Lightning's fit the monitor times, wrapped on their instances for a fit and put back after it.

``strategy.batch_to_device``: the host-to-device copy of each batch. The training epoch loop's ``_on_before_fetch``
(what Lightning's data fetcher calls just before it asks the loader for the next batch, for its profiler): the
host's work since the last step's end (the loop, callbacks' hooks, logging) ends there, and the data wait begins.
A Lightning without that hook keeps the whole gap between steps as data wait.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["Seams"]


class Seams:
    """Wraps `trainer.strategy.batch_to_device` and the epoch loop's fetch hook to tell ``on_copy`` and ``on_fetch``.

    Example:
        >>> import lightning as L
        >>> trainer, told = L.Trainer(logger=False), []
        >>> seams = Seams()
        >>> seams.wrap(trainer, on_copy=told.append, on_fetch=lambda: told.append("fetch"))
        >>> trainer.fit_loop.epoch_loop._on_before_fetch(); told
        ['fetch']
        >>> seams.restore(); "_on_before_fetch" in vars(trainer.fit_loop.epoch_loop)
        False
    """

    def __init__(self) -> None:
        self._wrapped: list[tuple[Any, str, Callable[..., Any]]] = []

    def wrap(self, trainer: pl.Trainer, on_copy: Callable[[float], None], on_fetch: Callable[[], None]) -> None:
        """Wrap both seams (again: the wrappers of an earlier fit are put back first)."""
        self.restore()
        copy = trainer.strategy.batch_to_device

        def timed_batch_to_device(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            out = copy(*args, **kwargs)
            on_copy(time.perf_counter() - start)
            return out

        self._put(trainer.strategy, "batch_to_device", timed_batch_to_device)
        loop = trainer.fit_loop.epoch_loop
        before_fetch = getattr(loop, "_on_before_fetch", None)
        if callable(before_fetch):

            def fetching() -> None:
                on_fetch()
                before_fetch()

            self._put(loop, "_on_before_fetch", fetching)

    def restore(self) -> None:
        """Put back what was wrapped (left alone where something else replaced the wrapper since)."""
        for owner, name, wrapper in self._wrapped:
            if vars(owner).get(name) is wrapper:
                delattr(owner, name)
        self._wrapped = []

    def _put(self, owner: Any, name: str, wrapper: Callable[..., Any]) -> None:
        setattr(owner, name, wrapper)
        self._wrapped.append((owner, name, wrapper))
