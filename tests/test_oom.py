from __future__ import annotations

import gc
import pickle
import weakref

import pytest
import torch
from torch import nn

from lightning_speedkit.oom import OOM_MESSAGES, MemoryLimit, is_oom_error, release_memory


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (torch.OutOfMemoryError("out of memory"), True),  # Lightning's text matching misses this one
        (torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), True),
        (RuntimeError("CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 7.79 GiB total capacity)"), True),
        (RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported"), True),
        (RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED"), True),
        (RuntimeError("GET was unable to find an engine to execute this computation"), True),  # memory-starved conv
        (RuntimeError("FIND was unable to find an engine to execute this computation"), True),
        (RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"), True),
        (RuntimeError("MPS backend out of memory (MPS allocated: 17.00 GB, other allocations: 1.00 GB)"), True),
        (RuntimeError("XPU out of memory. Tried to allocate 1.00 GiB"), True),
        (RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory: 9 bytes"), True),
        (RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 4x2)"), False),
        (RuntimeError("CUDA error: device-side assert triggered"), False),
        (ValueError("CUDA out of memory"), False),
        (MemoryError(), False),  # Python's own MemoryError is not an allocator OOM a smaller batch can avoid
        (KeyboardInterrupt(), False),
    ],
)
def test_is_oom_error_table(exc: BaseException, expected: bool) -> None:
    """OOM is recognised by type and by each backend's message; other errors are not."""
    assert is_oom_error(exc) is expected


def test_every_known_message_is_recognised() -> None:
    """Each fragment in OOM_MESSAGES alone makes a RuntimeError an OOM."""
    assert len(OOM_MESSAGES) >= 5  # a vacuous `all` over an emptied tuple must not pass
    assert all(is_oom_error(RuntimeError(f"prefix {fragment} suffix")) for fragment in OOM_MESSAGES)


def test_real_cpu_allocator_failure_is_an_oom() -> None:
    """A real allocation the CPU allocator refuses raises an error that `is_oom_error` recognises."""
    with pytest.raises(RuntimeError) as info:
        torch.empty(2**62, dtype=torch.uint8)
    assert is_oom_error(info.value)


def test_release_memory_frees_tensors_held_by_reference_cycles() -> None:
    """`release_memory` collects what a failed step leaves in reference cycles (a traceback's frames), without CUDA."""

    class Holder:
        """A tensor kept alive only by a reference cycle, as a traceback's frames keep a failed step's tensors."""

        def __init__(self) -> None:
            self.tensor = torch.zeros(1024)
            self.me = self

    holder = Holder()
    alive = weakref.ref(holder.tensor)
    gc.disable()  # so only release_memory can collect the cycle
    try:
        del holder
        assert alive() is not None
        release_memory()
        assert alive() is None
    finally:
        gc.enable()


def test_release_memory_empties_the_cuda_cache_once_cuda_is_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """With CUDA initialised, `release_memory` returns the caching allocator's blocks; before that it leaves CUDA be."""
    calls: list[str] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    release_memory()
    assert calls == []  # never initialise CUDA just to empty a cache it does not have
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    release_memory()
    assert calls == ["empty_cache"]


@pytest.mark.parametrize(
    ("limit", "eval_limit", "training", "rank", "expected"),
    [
        (8, None, True, 0, 8),
        (8, None, False, 0, 8),
        (8, 5, False, 0, 5),
        ([8, 4], None, True, 1, 4),
        ([8, 4], [6, 3], False, 1, 3),
        ([8, 4], None, True, 3, 4),  # ranks past the list use its last entry
    ],
)
def test_memory_limit_per_rank_and_mode(
    limit: int | list[int], eval_limit: int | list[int] | None, training: bool, rank: int, expected: int
) -> None:
    """The limit depends on the rank and on training vs eval mode."""
    assert MemoryLimit(limit, eval_limit).limit_for(training, rank) == expected


def test_memory_limit_raises_a_real_out_of_memory_error_above_the_limit() -> None:
    """Over the limit a batch raises torch.OutOfMemoryError, at it it runs; eval has its own; removing lifts it."""
    model = nn.Linear(4, 2)
    handle = MemoryLimit(8, eval_limit=4).attach(model)
    assert model(torch.zeros(8, 4)).shape == (8, 2)
    with pytest.raises(torch.OutOfMemoryError, match="batch of 9 with room for 8") as info:
        model(torch.zeros(9, 4))
    assert is_oom_error(info.value)
    model.eval()
    assert model(torch.zeros(4, 4)).shape == (4, 2)
    with pytest.raises(torch.OutOfMemoryError, match="batch of 5 with room for 4"):
        model(torch.zeros(5, 4))
    handle.remove()
    assert model(torch.zeros(100, 4)).shape == (100, 2)
    model.train()
    assert model(torch.zeros(100, 4)).shape == (100, 2)


def test_memory_limit_travels_with_a_pickled_module() -> None:
    """The hook pickles with its module (as ddp_spawn does) and still applies, with the same limits."""
    model = nn.Linear(4, 2)
    MemoryLimit(3, eval_limit=2).attach(model)
    clone = pickle.loads(pickle.dumps(model))
    assert clone(torch.zeros(3, 4)).shape == (3, 2)
    with pytest.raises(torch.OutOfMemoryError, match="batch of 4 with room for 3"):
        clone(torch.zeros(4, 4))
    clone.eval()
    with pytest.raises(torch.OutOfMemoryError, match="batch of 3 with room for 2"):
        clone(torch.zeros(3, 4))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"limit": 0}, "`limit`"),
        ({"limit": []}, "`limit`"),
        ({"limit": [4, -1]}, "`limit`"),
        ({"limit": True}, "`limit`"),
        ({"limit": 4, "eval_limit": 2.5}, "`eval_limit`"),
    ],
)
def test_memory_limit_rejects_bad_limits(kwargs: dict[str, object], match: str) -> None:
    """Limits must be positive ints (or lists of them)."""
    with pytest.raises(ValueError, match=match):
        MemoryLimit(**kwargs)  # type: ignore[arg-type]
