"""Out-of-memory errors: recognise them on every backend, release memory after one, and inject one in tests."""

from __future__ import annotations

import gc
import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from lightning_speedkit.batch import batch_size_of

log = logging.getLogger(__name__)

__all__ = ["OOM_MESSAGES", "MemoryLimit", "is_oom_error", "release_memory"]

OOM_MESSAGES: tuple[str, ...] = (
    "CUDA out of memory",
    "CUDA error: out of memory",
    "CUDNN_STATUS_ALLOC_FAILED",
    "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if you passed in a non-contiguous input",
    "unable to find an engine to execute this computation",
    "CUBLAS_STATUS_ALLOC_FAILED",
    "MPS backend out of memory",
    "XPU out of memory",
    "DefaultCPUAllocator: can't allocate memory",
)
"""Message fragments that mean an allocator ran out of memory (CUDA, cuDNN, cuBLAS, MPS, XPU, the CPU allocator).

The cuDNN ``NOT_SUPPORTED`` "non-contiguous input" error is what cuDNN raises when its workspace allocation fails;
Lightning treats it as an OOM too. cuDNN's v8/v9 API says "GET (or FIND) was unable to find an engine to execute this
computation" when no convolution engine can get the workspace it needs, which is how a memory-starved convolution
fails; a convolution no engine supports at all gives the same words, so a finder that meets one keeps halving and ends
with "even a batch of 1 ran out of memory", never with a silently wrong size.
"""


def is_oom_error(exc: BaseException) -> bool:
    """Whether ``exc`` means out of memory: a ``torch.OutOfMemoryError``, or a ``RuntimeError`` with a known message.

    Only ``exc`` itself is checked (not its ``__cause__``), so an OOM that user code caught and re-raised as another
    error is not mistaken for one.

    Example:
        >>> is_oom_error(torch.OutOfMemoryError("out of memory"))
        True
        >>> is_oom_error(RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"))
        True
        >>> is_oom_error(RuntimeError("GET was unable to find an engine to execute this computation"))  # cuDNN
        True
        >>> is_oom_error(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
        False
        >>> is_oom_error(ValueError("CUDA out of memory"))  # only RuntimeErrors carry allocator messages
        False
    """
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    if not isinstance(exc, RuntimeError):
        return False
    message = " ".join(str(arg) for arg in exc.args)
    return any(fragment in message for fragment in OOM_MESSAGES)


def release_memory(collect: bool = True) -> None:
    """Free what an OOM left behind: collect garbage, then return cached blocks of every accelerator allocator.

    Call it after the exception (and its traceback, which holds the failed step's tensors) is out of scope.

    Args:
        collect: Run a full ``gc.collect()`` first. It frees tensors held by reference cycles (a traceback's frames),
            and costs ~0.2 s in a process that has imported torch and Lightning; after trials that all succeeded
            on the CPU there is nothing for it to return that Python's own collector will not.

    Example:
        >>> release_memory()  # a no-op on a CPU-only machine apart from gc.collect()
        >>> release_memory(collect=False)  # only the accelerator caches (none here)
    """
    if collect:
        gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        torch.cuda.empty_cache()
    if torch.backends.mps.is_available():
        torch.mps.empty_cache()
    xpu = getattr(torch, "xpu", None)
    if xpu is not None and xpu.is_available():
        xpu.empty_cache()


def _current_rank() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return int(torch.distributed.get_rank())
    return 0


class MemoryLimit:
    """A stand-in for a GPU allocator: raise a real ``torch.OutOfMemoryError`` when a batch over a limit is run.

    This machine has no CUDA allocator to run out of, so tests and benchmarks attach this to a module as a forward
    pre-hook (`attach`): a forward pass whose input batch is larger than the limit raises
    ``torch.OutOfMemoryError`` with a CUDA-style message (so Lightning's own text matching recognises it too).
    Limits may differ per rank (a list indexed by the process's ``torch.distributed`` rank) and between training and
    evaluation (``eval_limit``, applied while the module is in eval mode: evaluation can need more memory than
    training, e.g. larger outputs kept for metrics). The instance is picklable, so it travels to ``ddp_spawn`` workers
    with the module it is attached to.

    Args:
        limit: Largest batch a forward pass in training mode may run; an int, or one int per rank.
        eval_limit: Largest batch in eval mode (default: ``limit``); an int, or one int per rank.

    Raises:
        ValueError: If a limit is not a positive int (or a non-empty list of them).

    Example:
        >>> model = nn.Linear(4, 2)
        >>> handle = MemoryLimit(limit=8).attach(model)
        >>> model(torch.zeros(8, 4)).shape
        torch.Size([8, 2])
        >>> model(torch.zeros(9, 4))
        Traceback (most recent call last):
        ...
        torch.OutOfMemoryError: CUDA out of memory. Tried to run a batch of 9 with room for 8 (MemoryLimit, rank 0).
        >>> handle.remove()
    """

    def __init__(self, limit: int | Sequence[int], eval_limit: int | Sequence[int] | None = None) -> None:
        self.limits = self._check("limit", limit)
        self.eval_limits = self.limits if eval_limit is None else self._check("eval_limit", eval_limit)

    @staticmethod
    def _check(name: str, value: int | Sequence[int]) -> tuple[int, ...]:
        values = tuple(value) if isinstance(value, (list, tuple)) else (value,)
        if not values or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in values):
            raise ValueError(
                f"`{name}` must be a positive int or a non-empty list of them (one per rank), got {value!r}."
            )
        return values

    def limit_for(self, training: bool, rank: int | None = None) -> int:
        """The limit of ``rank`` (default: this process's) in training or eval mode; the last entry covers the rest."""
        limits = self.limits if training else self.eval_limits
        rank = _current_rank() if rank is None else rank
        return limits[min(rank, len(limits) - 1)]

    def check(self, batch_size: int, training: bool) -> None:
        """Raise ``torch.OutOfMemoryError`` if ``batch_size`` exceeds the limit for this rank and mode."""
        limit = self.limit_for(training)
        if batch_size > limit:
            raise torch.OutOfMemoryError(
                f"CUDA out of memory. Tried to run a batch of {batch_size} with room for {limit}"
                f" (MemoryLimit, rank {_current_rank()})."
            )

    def __call__(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        """Forward pre-hook: check the batch size of the module's inputs."""
        size = batch_size_of(args)
        if size is not None:
            self.check(size, module.training)

    def attach(self, module: nn.Module) -> RemovableHandle:
        """Check every forward pass of ``module``; ``.remove()`` the returned handle to detach."""
        return module.register_forward_pre_hook(self)
