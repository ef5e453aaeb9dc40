"""PrecisionTuner: time the autocast precisions this hardware supports on real training steps, keep the fastest.

Whether bf16 autocast beats fp32 depends on the chip, not on a rule: on an AMD EPYC with avx512_bf16 it trained the
demo ResNet about 1.5x faster per step, on an AVX2-only CPU about 10x slower (``benchmarks/results/precision.json``
records the CPU it was measured on). Switching between autocast precisions needs no change to the model (Lightning's
``MixedPrecision`` plugin only wraps the forward and, for fp16, scales the loss), so the plugin can be swapped at fit
start, tried through `lightning_speedkit.trials.measure`, and the winner installed. True-half precisions, which
convert the weights, are never tried.
"""

from __future__ import annotations

from collections.abc import Sequence

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from typing_extensions import override

from lightning_speedkit import trials
from lightning_speedkit.checks import check_bool, check_margin, check_number, check_probe_steps
from lightning_speedkit.hardware import cpu_info

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
    """A precision for a trial: the strategy's precision plugin swapped (the session restores the original)."""

    def __init__(self, precision: str) -> None:
        self.name = precision
        self._was: Precision | None = None

    @override
    def apply(self, trainer: pl.Trainer) -> None:
        self._was = trainer.strategy.precision_plugin
        if self._was.precision != self.name:
            trainer.strategy.precision_plugin = _plugin(self.name, trainer.strategy.root_device.type)

    @override
    def revert(self, trainer: pl.Trainer) -> None:
        if self._was is not None:
            trainer.strategy.precision_plugin = self._was


class PrecisionTuner(trials.Lever):
    """Choose the training precision by timing real steps in each autocast precision the hardware supports.

    At fit start, ``probe_steps`` real training steps run in the precision the Trainer was built with and in each
    other candidate (`precision_candidates`: on CPU ``32-true`` and, with bf16 instructions, ``bf16-mixed``; on CUDA
    ``16-mixed`` and ``bf16-mixed``), from the same weights on the same batches with everything restored afterwards.
    The fastest candidate is installed if it beats the Trainer's precision by ``margin``; one whose loss is
    non-finite, or more than ``loss_tolerance`` worse than the Trainer's precision's on those batches, is rejected.
    A run too short for the probe to pay back keeps the Trainer's precision, and `report` says why. Only plain fp32
    and autocast plugins are swapped: a Trainer built with a true-half, DeepSpeed, FSDP or other plugin is left
    alone. The life cycle (checkpointed decision, resume, report) is `lightning_speedkit.trials.Lever`'s.

    `~lightning_speedkit.preset` adds this callback when ``precision`` is left to it.

    Args:
        candidates: Precisions to try, from ``"32-true"``, ``"16-mixed"`` (CUDA only) and ``"bf16-mixed"``; default:
            `precision_candidates` for the device.
        probe_steps: Training steps per precision and round (the first two are warm-up: oneDNN and cuDNN build
            their kernels for a new precision in its first steps).
        margin: How much faster (relative step time, in [0, 1)) a candidate must be to replace the Trainer's.
        loss_tolerance: How much higher (relative, >= 0) a candidate's mean trial loss may be than the reference's.
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

    def __init__(
        self,
        candidates: Sequence[str] | None = None,
        probe_steps: int = 6,
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

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
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
    def apply(self, trainer: pl.Trainer, pl_module: pl.LightningModule, decision: trials.Decision) -> None:
        plugin = trainer.strategy.precision_plugin
        if decision.decision != plugin.precision and decision.decision in AUTOCAST_PRECISIONS:
            trainer.strategy.precision_plugin = _plugin(decision.decision, trainer.strategy.root_device.type)
