"""PrecisionTuner: time the autocast precisions this hardware supports on real training steps, keep the fastest.

Whether bf16 autocast beats fp32 depends on the chip, not on a rule: on an AMD EPYC with avx512_bf16 it trained the
demo ResNet about 1.5x faster per step, on an AVX2-only CPU about 10x slower (``benchmarks/results/precision.json``
records the CPU it was measured on). Switching between autocast precisions needs no change to the model (Lightning's
``MixedPrecision`` plugin only wraps the forward and, for fp16, scales the loss), so the plugin can be swapped between
steps. Autocast changes the rounding of a step, not what it computes (the weights, the optimizer and the LR stay), so
the precisions are tried on the fit's first steps, which count (`lightning_speedkit.trials.counted`), and the winner
installed: a restored trial threw away every step of both precisions (on the 2-core AVX-512 EPYC, 0.2 s of a conv
net's 2 s to its target, 0.6-1.5 s of the demo's fit). Each block of a candidate is checked as its steps end: before
it the weights and optimizer state are copied to host memory, and a non-finite or clearly worse loss than the block
of the Trainer's precision just before it puts them back and rejects the candidate. True-half precisions, which
convert the weights, are never tried.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from typing_extensions import override

from lightning_speedkit import trials
from lightning_speedkit.checks import check_bool, check_margin, check_number, check_probe_steps
from lightning_speedkit.decisions import NOISE_Z, loss_is_sound
from lightning_speedkit.hardware import cpu_info
from lightning_speedkit.trials.counted import CountedTrials
from lightning_speedkit.trials.settings import loss_of, loss_tensor
from lightning_speedkit.trials.snapshot import take_state, undo_block

__all__ = ["AUTOCAST_PRECISIONS", "PrecisionTuner", "precision_candidates"]

AUTOCAST_PRECISIONS = ("32-true", "16-mixed", "bf16-mixed")
"""The precisions a trial may switch between: fp32, and the two autocast modes (the weights stay fp32)."""

_MAX_GAIN = 0.5
"""The most a precision is taken to save of a step when deciding whether a probe can pay back (bf16 measured 1.5x)."""


def precision_candidates(device_type: str, cpu_bf16: bool = False, cuda_bf16: bool = False) -> list[str]:
    """The autocast precisions worth timing on this hardware, the usual default first.

    CPU: ``32-true``, and ``bf16-mixed`` only when the CPU has bf16 instructions (``cpu_bf16``: ``avx512_bf16`` or
    ``amx_bf16``; elsewhere bf16 is emulated and a trial of it alone would cost many steps). CUDA: ``16-mixed``, and
    ``bf16-mixed`` where the GPU supports it; ``32-true`` is then only the fallback, not a candidate.

    Example:
        >>> precision_candidates("cpu", cpu_bf16=True)
        ['32-true', 'bf16-mixed']
        >>> precision_candidates("cpu")
        ['32-true']
        >>> precision_candidates("cuda", cuda_bf16=True)
        ['16-mixed', 'bf16-mixed']
    """
    if device_type == "cuda":
        return ["16-mixed", "bf16-mixed"] if cuda_bf16 else ["16-mixed"]
    return ["32-true", "bf16-mixed"] if cpu_bf16 else ["32-true"]


def _plugin(precision: str, device_type: str) -> Precision:
    if precision == "32-true":
        return Precision()
    return MixedPrecision(precision, device_type)  # type: ignore[arg-type]


class _Autocast(trials.Setting):
    """A precision for a block of counted steps: the strategy's precision plugin swapped, and put back after.

    One plugin per setting serves all its blocks, so an fp16 GradScaler keeps its scale from block to block.
    """

    changes_math = False  # the rounding only: each block's loss is checked (`_PrecisionTrials`)

    def __init__(self, precision: str) -> None:
        self.name = precision
        self._was: Precision | None = None
        self._plugin: Precision | None = None

    @override
    def apply(self, trainer: pl.Trainer) -> None:
        self._was = trainer.strategy.precision_plugin
        if self._was.precision != self.name:
            if self._plugin is None:
                self._plugin = _plugin(self.name, trainer.strategy.root_device.type)
            trainer.strategy.precision_plugin = self._plugin

    @override
    def revert(self, trainer: pl.Trainer) -> None:
        if self._was is not None:
            trainer.strategy.precision_plugin = self._was


class _PrecisionTrials(CountedTrials):
    """Counted blocks of precisions, each candidate block checked by its loss (`decisions.loss_is_sound`).

    Before a candidate's block the weights and optimizer state are copied to host memory; after it, its mean loss is
    compared with the block of the Trainer's precision just before it (other batches, and the weights a few steps
    younger, so only a clearly worse loss counts: more than the tolerance, and `decisions.NOISE_Z` standard errors). A
    non-finite or clearly worse loss on any rank puts the copy back and rejects the candidate: it gets no more blocks
    and is not chosen, and the decision says why.
    """

    def __init__(self, current: trials.Setting, candidates: Sequence[trials.Setting], steps: int, margin: float,
                 warmup: int, tolerance: float) -> None:  # fmt: skip
        super().__init__(current, candidates, steps, margin, warmup=warmup)
        self.tolerance = tolerance
        self.losses: list[list[torch.Tensor | None]] = []  # per block, each step's loss, read at the block's end
        self.rejected: dict[str, str] = {}
        self.snapshot_s = 0.0
        self.undone: list[list[float]] = []  # the step times of each candidate block put back: the run lost them
        self._saved: dict[str, Any] | None = None

    @override
    def block_starting(self, trainer: pl.Trainer, setting: trials.Setting) -> None:
        self.losses.append([])
        if setting is not self.current:
            began = time.perf_counter()
            self._saved = take_state(trainer, schedulers=False, precision=False)  # the LR schedule counts the steps
            self._saved["step"] = trainer.global_step
            self.snapshot_s += time.perf_counter() - began

    def keep_run_state(self) -> None:
        """Drop the block's copy: the state the run was put back to since stands (`PrecisionTuner.rolled_back`)."""
        self._saved = None

    @override
    def step_recorded(self, trainer: pl.Trainer, outputs: Any) -> None:
        self.losses[-1].append(loss_tensor(outputs))  # no device sync inside the timed steps

    @override
    def block_ended(self, trainer: pl.Trainer) -> trials.Decision | None:
        name = self.blocks[-1][0]
        if name == self.current.name:
            return None
        before = next(
            (losses for (block, _), losses in zip(self.blocks[-2::-1], self.losses[-2::-1], strict=False)
             if block == self.current.name), [],
        )  # fmt: skip
        values, reference = ([loss_of(loss) for loss in losses] for losses in (self.losses[-1], before))
        why = loss_is_sound(values, reference, self.tolerance, noise_z=NOISE_Z)
        if not trainer.strategy.reduce_boolean_decision(bool(why), all=False):
            self._saved = None
            return None
        why = trainer.strategy.broadcast(why or "an unsound loss on another rank", src=0)
        began = time.perf_counter()
        if self._saved is not None:  # every rank puts its own copy back (the same weights under DDP)
            undo_block(trainer, self._saved)  # a WeightAverage drops the steps undone; the LRs the schedule reached
            self._saved = None
            self.undone.append(self.blocks[-1][1])
        self.snapshot_s += time.perf_counter() - began
        self.rejected[name] = why
        self.drop([name], f"{why}; its block was undone", note="rejected")
        return None

    @override
    def _extension_room(self, trainer: pl.Trainer) -> str | None:
        """An added round runs at once, before the probes queued behind: they are timed in the precision it decides."""
        return "now" if trials.steps_left(trainer) >= 2 * self.steps else None

    @override
    def _medians(self) -> dict[str, float | None]:
        return {name: None if name in self.rejected else m for name, m in super()._medians().items()}

    @override
    def _decide(self, trainer: pl.Trainer) -> trials.Decision:
        decision = super()._decide(trainer)
        decision.rejected.update(self.rejected)
        return decision

    @override
    def extra_s(self, trainer: pl.Trainer, kept_step_s: float | None) -> float:
        # An undone block's time is all the probe's: the part over the kept step's is in the blocks' sum, the rest here.
        undone = sum(min(sum(times), (kept_step_s or 0.0) * len(times)) for times in self.undone)
        return super().extra_s(trainer, kept_step_s) + float(
            trainer.strategy.broadcast(self.snapshot_s + undone, src=0)
        )


class PrecisionTuner(trials.Lever):
    """Choose the training precision by timing real steps in each autocast precision the hardware supports.

    The fit's first training steps are the probe (counted trials, `lightning_speedkit.trials.counted`): blocks of
    ``probe_steps`` steps alternate the precision the Trainer was built with and each other candidate
    (`precision_candidates`: on CPU ``32-true`` and, with bf16 instructions, ``bf16-mixed``; on CUDA ``16-mixed`` and
    ``bf16-mixed``), three rounds, and every step trains the run. The fastest candidate is installed if it beats the
    Trainer's precision by ``margin``. A candidate block whose loss is non-finite, or more than ``loss_tolerance``
    worse than the Trainer's precision's block just before it, is undone (the weights and optimizer state copied
    before it are put back) and the candidate rejected. A run too short for the probe to pay back keeps the Trainer's
    precision, and `report` says why. The precision installed is the Trainer's from then on, as if it had been
    built with it: a `validate`, `test` or `predict` after the fit runs in it too. Only plain fp32
    and autocast plugins are swapped: a Trainer built with a true-half, DeepSpeed, FSDP or other plugin is left
    alone. The life cycle (checkpointed decision, resume, report) is `lightning_speedkit.trials.Lever`'s.

    `~lightning_speedkit.preset` adds this callback when ``precision`` is left to it.

    Args:
        candidates: Precisions to try, from ``"32-true"``, ``"16-mixed"`` (CUDA only) and ``"bf16-mixed"``; default:
            `precision_candidates` for the device.
        probe_steps: Training steps per block (fewer, down to 6, when the run is too short to repay such blocks; the
            first two are warm-up: oneDNN and cuDNN build their kernels for a new precision in its first steps).
        margin: How much faster (relative step time, in [0, 1)) a candidate must be to replace the Trainer's.
        loss_tolerance: How much higher (relative, >= 0) a candidate block's mean loss may be than the reference's.
        remember: Remember the decision across runs (`lightning_speedkit.trials.memory`): a later run with the same
            fingerprint (model, batch, loader, devices, hardware, versions, arguments) applies it without probing.

    Raises:
        ValueError: For an empty ``candidates`` or one outside the autocast precisions, ``probe_steps`` below 2, a
            ``margin`` outside [0, 1) or a negative ``loss_tolerance``; at setup, ``"16-mixed"`` among the
            ``candidates`` of a fit that does not run on CUDA.

    Logged metrics: ``speedkit/precision/<precision>_step_ms`` and ``speedkit/precision/probe_s``.

    Example:
        >>> import lightning as L
        >>> trainer = L.Trainer(logger=False, callbacks=[PrecisionTuner(candidates=["32-true", "bf16-mixed"])])
    """

    AREA = "precision"
    MAX_GAIN = _MAX_GAIN
    WARMUP = 2  # oneDNN builds its bf16 kernels in the first steps
    COUNTED = True
    MIN_BLOCK = 6  # the restored trials' length; longer blocks when the run repays them (their steps count)

    def __init__(
        self,
        candidates: Sequence[str] | None = None,
        probe_steps: int = 10,
        margin: float = 0.05,
        loss_tolerance: float = 0.1,
        remember: bool = True,
    ) -> None:
        self.remember = check_bool("remember", remember)
        if candidates is not None and (
            not isinstance(candidates, (list, tuple))
            or not candidates
            or any(c not in AUTOCAST_PRECISIONS for c in candidates)
        ):
            raise ValueError(
                f"`candidates` must be a non-empty list from {', '.join(AUTOCAST_PRECISIONS)}, got {candidates!r}."
            )
        check_number("loss_tolerance", loss_tolerance, 0)
        self.candidates = list(dict.fromkeys(candidates)) if candidates is not None else None
        self.probe_steps = check_probe_steps("probe_steps", probe_steps, low=2)
        self.margin = check_margin("margin", margin)
        self.loss_tolerance = float(loss_tolerance)
        self._paused: trials.Setting | None = None  # a candidate set aside for a validation inside its block

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        self._paused = None  # a validation an exception ended set none aside for this fit
        device = trainer.strategy.root_device.type
        if self.candidates is not None and device != "cuda" and "16-mixed" in self.candidates:
            raise ValueError(
                f"`candidates` must not hold '16-mixed' on {device.upper()}: fp16 autocast runs on CUDA only"
                f" (Lightning turns it into 'bf16-mixed' elsewhere); use '32-true' and 'bf16-mixed', got"
                f" {self.candidates!r}."
            )

    @override
    def plan(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule
    ) -> tuple[trials.Setting, Sequence[trials.Setting]] | trials.Decision:
        plugin = trainer.strategy.precision_plugin
        current = str(plugin.precision)
        if type(plugin) not in (Precision, MixedPrecision) or current not in AUTOCAST_PRECISIONS:
            why = f"{type(plugin).__name__} ({current}) is not an autocast plugin: kept"
            return trials.Decision.skipped(current, why)
        device = trainer.strategy.root_device.type
        cuda_bf16 = device == "cuda" and torch.cuda.is_bf16_supported()
        wanted = self.candidates or precision_candidates(device, bool(cpu_info().bf16_instructions), cuda_bf16)
        others = [_Autocast(p) for p in wanted if p != current]
        if not others:
            reason = f"no other autocast precision to try on this {device.upper()} (candidates: {', '.join(wanted)})"
            return trials.Decision.skipped(current, reason)
        return _Autocast(current), others

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """A validation inside a candidate's block runs in the run's precision: its metric may pick a checkpoint."""
        counted = self._counted
        active = None if counted is None else counted.active
        if counted is not None and active is not None and active is not counted.current:
            active.revert(trainer)
            self._paused = active

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._paused is not None:  # the block goes on in its precision
            self._paused.apply(trainer)
            self._paused = None

    @override
    def counted_trials(
        self, current: trials.Setting, others: Sequence[trials.Setting], steps: int, warmup: int
    ) -> CountedTrials:
        """Blocks whose losses are checked, each candidate block undone when unsound (`_PrecisionTrials`)."""
        return _PrecisionTrials(current, others, steps, self.margin, warmup, float(self.loss_tolerance or 0.0))

    @override
    def apply(self, trainer: pl.Trainer, pl_module: pl.LightningModule, decision: trials.Decision) -> None:
        plugin = trainer.strategy.precision_plugin
        if decision.decision != plugin.precision and decision.decision in AUTOCAST_PRECISIONS:
            trainer.strategy.precision_plugin = _plugin(decision.decision, trainer.strategy.root_device.type)
