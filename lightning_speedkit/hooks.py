"""`LeanCallback`: a callback that Lightning does not call on every step for the per-step hooks it leaves alone.

Lightning calls each per-step hook of every callback on every step, overridden or not: for each it reads the
callback's ``state_key``, opens its profiler's context and calls the method (``_call_callback_hooks``). Lightning
skips a hook that is not callable; a `LeanCallback` sets the per-step hooks its class does not override to None on
the instance, and keeps every hook it (or a user's subclass) overrides. With every speedkit callback lean (and each
lever's own step hooks off once it has decided), a `preset()` step on a 4x2 linear layer executes 339k instructions
more than a plain Trainer's 3,961k, against 963k before (`benchmarks/step_overhead.py`, counted with callgrind).
A caller that calls such a hook directly gets None: call it through the Trainer, or check ``callable`` first.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import Self

__all__ = ["STEP_HOOKS", "LeanCallback", "epoch_start_skipped", "inherited_hooks"]

STEP_HOOKS = (
    "on_train_batch_start",
    "on_train_batch_end",
    "on_before_backward",
    "on_after_backward",
    "on_before_optimizer_step",
    "on_before_zero_grad",
    "on_validation_batch_start",
    "on_validation_batch_end",
    "on_test_batch_start",
    "on_test_batch_end",
    "on_predict_batch_start",
    "on_predict_batch_end",
)
"""The hooks Lightning calls once per batch, only through its dispatcher (never directly, unlike ``state_dict``)."""


def inherited_hooks(cls: type[Callback], names: Sequence[str] = STEP_HOOKS, owner: type = Callback) -> tuple[str, ...]:
    """The hooks among ``names`` (by default `STEP_HOOKS`) that ``cls`` inherits unchanged from ``owner``.

    Example:
        >>> class OnlyBatchEnd(Callback):
        ...     def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx): ...
        >>> unused = inherited_hooks(OnlyBatchEnd)
        >>> "on_train_batch_end" in unused, "on_before_backward" in unused
        (False, True)
    """
    return tuple(name for name in names if getattr(cls, name) is getattr(owner, name))


class LeanCallback(Callback):
    """A `Callback` whose per-step hooks that its class leaves as Lightning's no-ops are not called at all.

    Example:
        >>> class OnlyBatchEnd(LeanCallback):
        ...     def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx): ...
        >>> callback = OnlyBatchEnd()
        >>> callback.on_before_backward is None, callable(callback.on_train_batch_end)
        (True, True)
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> Self:
        """A new instance, with the per-step hooks its class inherits from `Callback` set to None."""
        callback = super().__new__(cls)
        callback._skip_hooks(STEP_HOOKS, Callback)
        return callback

    def _skip_hooks(self, names: Sequence[str], owner: type) -> None:
        """Set to None the hooks among ``names`` that this callback's class inherits unchanged from ``owner``.

        Lightning's dispatcher skips a hook that is not callable; a subclass's own hooks are kept.
        """
        for name in inherited_hooks(type(self), names, owner):
            setattr(self, name, None)

    def _resume_hooks(self, names: Sequence[str], owner: type) -> None:
        """Undo `_skip_hooks` for the same ``names`` and ``owner``: Lightning calls them again."""
        for name in inherited_hooks(type(self), names, owner):
            self.__dict__.pop(name, None)


def epoch_start_skipped(trainer: pl.Trainer) -> bool:
    """Whether this fit's first epoch begins without ``on_train_epoch_start`` (ask in ``on_train_start``).

    Lightning (2.6) resumes a checkpoint written at the end of an epoch's last batch (``every_n_train_steps``) as
    "restarted mid-epoch" and moves to the next epoch's first batch, without calling the epoch-start hooks: a
    callback that acts at an epoch's start calls its own hook from ``on_train_start`` then, as the uninterrupted run
    did at that epoch. Not when the fit has nothing left to train, and not for a checkpoint written at a validation's
    end after that batch (the loop then starts the next epoch with its hooks).
    """
    fit_loop = trainer.fit_loop
    epoch_loop = fit_loop.epoch_loop
    return (
        bool(getattr(fit_loop, "restarted_mid_epoch", False))
        and bool(getattr(epoch_loop, "restarted_on_train_batch_end", False))
        and bool(epoch_loop.batch_progress.is_last_batch)
        and not fit_loop.done
    )
