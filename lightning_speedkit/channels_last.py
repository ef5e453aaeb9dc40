"""ChannelsLast: keep a conv net's weights in the channels-last (NHWC) memory layout, which oneDNN and cuDNN run faster.

Converting the weights is enough: a convolution whose weight is channels-last returns a channels-last output, so the
layout propagates through the network without touching the user's batches. Whether NHWC is faster depends on the model
and the hardware, so the callback times real training steps in both layouts (`lightning_speedkit.trials.measure`) and
keeps NHWC only when it wins by a margin. ``benchmarks/channels_last.py`` shows the gain and the decision per model.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_speedkit import trials
from lightning_speedkit.batch import forward_example, modes_kept
from lightning_speedkit.checks import check_bool, check_margin, check_probe_steps
from lightning_speedkit.hardware import cpu_info
from lightning_speedkit.layout import (
    align_optimizer_state,
    has_convolutions,
    is_channels_last,
    nhwc_unsafe_convs,
    to_channels_last,
    to_default_layout,
)
from lightning_speedkit.trials.counted import counted_cost

__all__ = ["ChannelsLast"]

_NHWC, _NCHW = "channels_last", "default"
_STEP_FAILS = "reverted: the training or validation step fails channels-last"
_MAX_GAIN = 0.4
"""The most NHWC is taken to save of a step when deciding whether a probe can pay back (1.33-1.36x measured here)."""


class _Layout(trials.Setting):
    """A layout for a counted trial: the conv weights (and the optimizer state that follows them) in NHWC or NCHW.

    Only strides change, never values, so its steps train exactly as the run would: they count.
    """

    changes_math = False

    def __init__(self, channels_last: bool) -> None:
        self.channels_last, self.name = channels_last, _NHWC if channels_last else _NCHW
        self._was = False

    @override
    def apply(self, trainer: pl.Trainer) -> None:
        self._was = is_channels_last(trainer.lightning_module)
        _set_layout(trainer, self.channels_last)

    @override
    def revert(self, trainer: pl.Trainer) -> None:
        _set_layout(trainer, self._was)


def _set_layout(trainer: pl.Trainer, channels_last: bool) -> int:
    """Move the conv weights and the optimizer state that follows them; the number of weights moved.

    A DDP wrapper is rebuilt so that its gradient buckets match the new strides.
    """
    moved = (to_channels_last if channels_last else to_default_layout)(trainer.lightning_module)
    for optimizer in trainer.optimizers:
        align_optimizer_state(optimizer)
    strategy = trainer.strategy
    if moved and isinstance(strategy.model, DistributedDataParallel) and hasattr(strategy, "_setup_model"):
        strategy.model = strategy._setup_model(strategy.model.module)
        if hasattr(strategy, "_register_ddp_hooks"):
            strategy._register_ddp_hooks()
    return moved


class ChannelsLast(trials.Lever):
    """Run a convolutional LightningModule in the channels-last memory layout (NHWC), with no change to the model.

    When the Trainer sets up, before the optimizer and any DDP wrapper are built, the weights of the module's 2-D/3-D
    convolutions move to NHWC. With ``verify=True`` the module's ``example_input_array`` is run through it (eval mode,
    no grad) in both layouts first: if the NHWC run fails (``x.view(...)`` on an activation is the usual culprit:
    use ``reshape`` or ``flatten``) or its output differs, the model goes back to the default layout with a
    warning; a module without ``example_input_array`` is left alone unless ``verify=False``. At train start, any
    optimizer state loaded from a checkpoint of the default layout gets the parameters' strides. Convolutions built
    later (in ``configure_model`` or lazily) are reported at fit start; `StructuredPruning` keeps the layout of the
    layers it shrinks. Values never change, so checkpoints load into a model in either layout.

    With ``measure=True``, the fit's first training steps are the probe (counted trials,
    `lightning_speedkit.trials.counted`): blocks of ``probe_steps`` steps alternate the two layouts, twelve rounds,
    every step timed and every step training the model as the run would (only strides differ), so the probe costs
    only the slower layout's extra seconds. NHWC is kept when it is at least ``margin`` faster; otherwise the model
    goes back to the default layout (under DDP the wrapper is rebuilt at each switch, so its gradient buckets match).
    When the run is too short for the probe to pay back, the layout is left as the user had it, and the report says
    why. The life cycle (checkpointed decision, resume, report) is
    `lightning_speedkit.trials.Lever`'s.

    Args:
        enabled: ``False`` makes the callback a no-op (for a callback list written out, e.g. in a config file);
            ``preset(channels_last=False)`` does not use it: it leaves the callback out.
        verify: Check the model on its ``example_input_array`` before keeping the new layout.
        measure: Time both layouts and keep NHWC only when it wins; ``False`` keeps NHWC without timing it.
        margin: How much faster (relative step time, in [0, 1)) NHWC must be to be kept.
        probe_steps: The longest block of each layout, in training steps (the first of each block is a warm-up);
            a run too short to repay blocks that long gets the longest it can, down to ``MIN_BLOCK``
            (`lightning_speedkit.trials.counted.fitted_block`). 6, in 12 rounds (``COUNTED_ROUNDS``): on the
            2-core AVX-512 EPYC in bf16, where NHWC is 12-16% faster, three rounds of 25 steps kept it in 8 of 10
            fresh decisions (`benchmarks/layout_stability.py --precision bf16-mixed`); a load burst of a second
            covered one layout's block of 25 steps (0.5 s) and split its round, where it spans both blocks of a
            short round (`benchmarks/probe_replay.py`).
        remember: Remember the decision across runs (`lightning_speedkit.trials.memory`): a later run with the same
            fingerprint (model, batch, loader, devices, hardware, versions, arguments) applies it without probing.

    Raises:
        ValueError: For a non-bool ``enabled``/``verify``/``measure``, a ``margin`` outside [0, 1) or
            ``probe_steps`` below 2.

    Example:
        >>> from lightning_speedkit import preset
        >>> trainer = preset(logger=False, verbose=False, channels_last=False)  # left out, not enabled=False
        >>> any(isinstance(c, ChannelsLast) for c in trainer.callbacks)
        False
    """

    AREA = "layout"
    MAX_GAIN = _MAX_GAIN
    COUNTED = True
    MIN_BLOCK = 4  # three timed steps after the warm-up
    COUNTED_ROUNDS = 12  # a switch costs one warm-up step: many short rounds pair the blocks closely

    def __init__(
        self,
        enabled: bool = True,
        verify: bool = True,
        measure: bool = True,
        margin: float = 0.03,
        probe_steps: int = 6,
        remember: bool = True,
    ) -> None:
        self.remember = check_bool("remember", remember)
        for name, value in (("enabled", enabled), ("verify", verify), ("measure", measure)):
            if not isinstance(value, bool):
                raise ValueError(f"`{name}` must be True or False, got {value!r}.")
        self.enabled = enabled
        self.verify = verify
        self.measure = measure
        self.margin = check_margin("margin", margin)
        self.probe_steps = check_probe_steps("probe_steps", probe_steps, low=2)
        self.converted = 0
        self._status = "not set up"
        self._verified = False
        self._step_failed = False

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        self._verified = self._verified and stage != "fit"  # each fit's model is checked again (another may not run)
        self._step_failed = self._step_failed and stage != "fit"
        if not self.enabled:
            self._status = "disabled"
            return
        if is_channels_last(pl_module):  # converted already (an earlier stage, or by the user)
            self._status = "channels_last"
            return
        if stage != "fit" and self._step_failed:  # the fit's own steps failed NHWC: validating would too
            self._status = "default layout: the fit's steps fail channels-last"
            return
        if stage != "fit" and self.measure and (self._decision is None or self._decision.decision != _NHWC):
            # validate/test/predict: the layout is a fit's measured decision; none, or the default, leaves it as is
            self._status = (
                "default layout, as the fit decided" if self._decision else "left as it is: no fit measured it"
            )
            return
        if not has_convolutions(pl_module):
            self._status = "no convolutions at setup"
            rank_zero_info("ChannelsLast: no convolutions at setup; the layout is left as it is.")
            return
        unsafe = nhwc_unsafe_convs(pl_module, cpu_info()) if trainer.strategy.root_device.type == "cpu" else []
        if unsafe:
            self._status = (
                f"default layout: oneDNN cannot train {_named(unsafe)} channels-last on this CPU (a strided 1x1"
                " convolution with few input channels; its weight gradient writes past its buffer, oneDNN #6035)"
            )
            rank_zero_warn(f"ChannelsLast: {self._status}; layout unchanged.")
            return
        example = pl_module.example_input_array
        if self.verify and example is None:
            self._status = "unverified: no example_input_array"
            rank_zero_info(
                "ChannelsLast: the module has no `example_input_array` to check that it runs channels-last; layout"
                " left as it is (set one, or pass `ChannelsLast(verify=False)`)."
            )
            return
        expected = None
        if self.verify:
            example = move_data_to_device(example, _parameter_device(pl_module))
            try:
                expected = self._outputs(pl_module, example)
            except Exception as err:  # the model's own problem: let training report it, leave the layout alone
                self._status = f"unverified: the example input fails in the default layout too ({type(err).__name__})"
                rank_zero_info(f"ChannelsLast: {self._status}; layout left as it is.")
                return
        converted = to_channels_last(pl_module)
        if self.verify:
            problem = self._check(pl_module, example, expected)
            if problem is not None:
                to_default_layout(pl_module)
                self._status = f"reverted: {problem}"
                rank_zero_warn(f"ChannelsLast: the model does not run channels-last ({problem}); layout unchanged.")
                return
        self.converted += converted
        self._status = "channels_last"
        self._verified = True
        if self.measure and stage == "fit" and self._decision is None:
            # Decide before DDP wraps the model, so a short run never pays for re-wrapping it.
            cost = counted_cost(2, self.block_steps(trainer, 2), self.COUNTED_ROUNDS, self.margin)
            pays, why, _ = trials.probe_cost(trainer, cost, self.MAX_GAIN)
            if not pays:
                to_default_layout(pl_module)
                self.converted -= converted
                self._status = f"default layout: probe {why}"
                self._decision = trials.Decision.skipped(_NCHW, why)
                return
        rank_zero_info(f"ChannelsLast: {converted} convolution weights moved to the channels-last layout.")

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Check one real training step (and validation batch) channels-last, then the lever's life cycle.

        The check runs whenever NHWC is in place or a resumed decision would put it there, remembered runs included:
        one restored step, not a measurement (the job's fingerprint holds the model's structure, not its code).
        """
        kept = self._decision  # a checkpoint's or an earlier fit's (which may not hold for this one)
        resumed = kept.decision if kept is not None and kept.source == "resumed" else None
        if self._verified and (is_channels_last(pl_module) or resumed == _NHWC) and not trainer.should_stop:
            problem = _step_problem(trainer)
            if problem is not None:
                _set_layout(trainer, False)  # at fit start, outside any step: a DDP wrapper is rebuilt, not re-entered
                self.converted, self._verified, self._step_failed = 0, False, True
                self._status = f"{_STEP_FAILS} ({problem})"
                rank_zero_warn(
                    f"ChannelsLast: {self._status}; layout unchanged. A `view` of an activation is the usual culprit:"
                    " use `reshape` or `flatten`."
                )
                self._decision = None  # decided again (`plan`: the default layout), with this fit's job
                if resumed is not None:  # a resume takes its decision as it is: this one
                    self._decision = trials.Decision.skipped(_NCHW, self._status)
                    self._decision.source = "resumed"
        super().on_fit_start(trainer, pl_module)

    @override
    def holds(self, trainer: pl.Trainer, decision: trials.Decision) -> bool:
        """A decision (an earlier fit's, or remembered) holds unless this fit's steps decide otherwise.

        NHWC does not hold for a fit whose steps fail channels-last; the default layout a failed check chose does not
        hold for a fit whose steps ran (the fingerprint holds the model's structure, not its code).
        """
        if decision.decision == _NHWC and self._step_failed:
            return False
        if decision.decision == _NCHW and decision.reason.startswith(_STEP_FAILS) and not self._step_failed:
            return False
        return super().holds(trainer, decision)

    @override
    def plan(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule
    ) -> tuple[trials.Setting, Sequence[trials.Setting]] | trials.Decision:
        if not self._verified:
            return trials.Decision.skipped(_NHWC if is_channels_last(pl_module) else _NCHW, self._status)
        if not self.measure:
            return trials.Decision.skipped(_NHWC, "kept without timing (measure=False)")
        return _Layout(False), [_Layout(True)]

    @override
    def apply(self, trainer: pl.Trainer, pl_module: pl.LightningModule, decision: trials.Decision) -> None:
        if self._verified:  # measured, or a resumed decision (NHWC "kept without timing" is in place already)
            self._use(trainer, decision.decision == _NHWC, decision.reason)
        set_up = self._status in ("channels_last", "no convolutions at setup")
        if set_up and has_convolutions(pl_module) and not is_channels_last(pl_module):
            rank_zero_warn(
                "ChannelsLast: convolutions built after setup (in `configure_model`, or lazily) are in the default"
                " layout; call `lightning_speedkit.layout.to_channels_last(self)` at the end of `configure_model`."
            )

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._status == "channels_last":  # state restored from a checkpoint of the default layout
            for optimizer in trainer.optimizers:
                align_optimizer_state(optimizer)

    @override
    def status(self) -> dict[str, Any]:
        """``status`` (what the layout is, and why) and ``converted`` (weights that changed layout).

        The decision beside it (`lightning_speedkit.trials.Decision`): ``decision`` (``"channels_last"`` or
        ``"default"``), ``reason``, ``source``, ``step_ms`` (median training-step milliseconds per layout when
        measured), ``probe_s`` and ``probed``.
        """
        return {"status": self._status, "converted": self.converted}

    def _use(self, trainer: pl.Trainer, channels_last: bool, reason: str) -> None:
        """Put the decided layout in place (a no-op when it is); a DDP wrapper is rebuilt so its buckets match."""
        module = trainer.lightning_module
        if is_channels_last(module) != channels_last:
            count = _set_layout(trainer, channels_last)
            self.converted = count if channels_last else 0
        self._status = "channels_last" if channels_last else f"default layout: {reason}"

    @staticmethod
    def _outputs(module: torch.nn.Module, example: Any) -> Any:
        with modes_kept(module), torch.no_grad():
            module.eval()
            return forward_example(module, example)

    def _check(self, module: torch.nn.Module, example: Any, expected: Any) -> str | None:
        try:
            actual = self._outputs(module, example)
        except Exception as err:
            return f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        try:
            torch.testing.assert_close(actual, expected, rtol=1e-3, atol=1e-4)
        except (AssertionError, TypeError, ValueError):
            return "its output differs from the default layout's"
        return None


def _step_problem(trainer: pl.Trainer) -> str | None:
    """Why one training step (and validation batch, when the run validates) fails channels-last, or None.

    The `lightning_speedkit.trials.TrialSession` puts everything back (weights, optimizer, batch-norm statistics,
    RNG, loop progress), so the run that follows is the run without the check. ``example_input_array`` runs only the
    forward: a ``training_step`` or a loss that ``view``s an activation fails here, not in the run's first step. A step
    that fails in the default layout too is the run's own problem, not the layout's: None, the layout left as it is.
    Every rank gets one verdict (a rank's error fails the trial on all of them).
    """
    with trials.TrialSession(trainer, 1, warmup=0, validate=trainer.enable_validation) as session:
        result = session.run(_Layout(True), max_batches=1, catch=True)
        if result.fits or session.run(_Layout(False), max_batches=1, catch=True).fits is False:
            return None
    return result.error


def _named(layers: list[str]) -> str:
    """``"`a`, `b` and 3 more"``: the first layers named, the rest counted."""
    shown = ", ".join(f"`{name or 'the module'}`" for name in layers[:2])
    return shown + (f" and {len(layers) - 2} more" if len(layers) > 2 else "")


def _parameter_device(module: torch.nn.Module) -> torch.device:
    """Where the weights are: in ``setup`` Lightning already reports ``module.device`` as the target device."""
    first = next(module.parameters(), None)
    return first.device if first is not None else torch.device("cpu")
