"""Plumbing around dynamo: compile seconds, graph breaks, a compiled call that falls back, a cache key with the ISA."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch._dynamo.exc import TorchDynamoException
from torch._dynamo.utils import counters

from lightning_speedkit.hardware import forced_isa

_callback_handler: Any
try:
    from torch._dynamo.callback import callback_handler as _callback_handler
except ImportError:  # older torch: no compile callbacks; compile seconds then come from the first compiled step
    _callback_handler = None

__all__ = ["ISA_TAG", "CompileWatch", "CompiledCall", "graph_breaks", "isa_cache_tag", "tag_compile_cache"]

ISA_TAG = "speedkit-cpu-isa="
"""The part of ``torch.compiler.config.cache_key_tag`` that `tag_compile_cache` writes: the CPU ISA compiled for."""


class CompileWatch:
    """Seconds and count of dynamo's compilations in this process while installed (its compile start/end callbacks)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, float]] = []  # (trigger, seconds): DYNAMO (a graph) or LAZY_BACKWARD
        self._started: dict[int, float] = {}
        self._installed = False

    @staticmethod
    def available() -> bool:
        """Whether this torch has dynamo's compile callbacks (else compile seconds come from the first step)."""
        return _callback_handler is not None

    def install(self) -> None:
        """Start recording dynamo's compilations (once; a no-op without the callbacks)."""
        if not self._installed and self.available():
            _callback_handler.register_start_callback(self._start)
            _callback_handler.register_end_callback(self._end)
            self._installed = True

    def remove(self) -> None:
        """Stop recording (idempotent)."""
        if self._installed:
            _callback_handler.remove_start_callback(self._start)
            _callback_handler.remove_end_callback(self._end)
            self._installed = False

    def since(self, mark: int) -> tuple[int, float]:
        """Graphs compiled and seconds spent compiling since ``len(events)`` was ``mark``."""
        later = self.events[mark:]
        return sum(trigger == "DYNAMO" for trigger, _ in later), sum(seconds for _, seconds in later)

    def _start(self, args: Any) -> None:
        self._started[id(args)] = time.perf_counter()

    def _end(self, args: Any) -> None:
        started = self._started.pop(id(args), None)
        if started is not None:
            self.events.append((str(args.callback_trigger.name), time.perf_counter() - started))

    def __getstate__(self) -> dict[str, Any]:
        return {"events": list(self.events), "_started": {}, "_installed": False}


def graph_breaks() -> int:
    """Graph breaks dynamo has counted in this process."""
    return sum(counters["graph_break"].values())


def _no_compiled_call() -> None:
    return None


class CompiledCall:
    """A module's compiled ``__call__`` that falls back to eager, for good, when compiling fails at a call.

    A compile error is raised while tracing, before the compiled code runs, so the call is repeated eagerly. Under
    DDP, Lightning runs ``training_step`` as the module's ``forward`` (its ``_ForwardRedirection`` patches ``forward``
    on the instance for that call): that call runs eager, so the compiled graph is the module's own ``forward`` on
    every strategy (``self.log`` inside a step would break the graph, and ``fullgraph=True`` would fail only under
    DDP). A copy or pickle of the module is eager: the compiled function stays bound to the original module.
    """

    def __init__(
        self, compiled: Callable[..., Any], eager: Callable[..., Any], on_failure: Callable[[Exception], None]
    ) -> None:
        self.compiled, self.eager, self.on_failure = compiled, eager, on_failure
        self.module: object = getattr(eager, "__self__", None)
        self.calls = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The compiled call, or the eager one under Lightning's DDP step redirection or after a compile error."""
        patched = getattr(self.module, "__dict__", {}).get("forward")
        if getattr(patched, "__qualname__", "").startswith("_ForwardRedirection."):
            return self.eager(*args, **kwargs)
        self.calls += 1
        try:
            return self.compiled(*args, **kwargs)
        except TorchDynamoException as err:
            self.on_failure(err)
            return self.eager(*args, **kwargs)

    def __deepcopy__(self, memo: dict[int, Any]) -> None:
        return None

    def __reduce__(self) -> tuple[Callable[[], None], tuple[()]]:
        return _no_compiled_call, ()


def isa_cache_tag(tag: str, isa: str) -> str:
    """``tag`` (``torch.compiler.config.cache_key_tag``) with the CPU ISA ``isa`` in it: any earlier ISA part replaced.

    Example:
        >>> isa_cache_tag("", "AVX2")
        'speedkit-cpu-isa=AVX2'
        >>> isa_cache_tag("mine", "AVX512")
        'mine|speedkit-cpu-isa=AVX512'
        >>> isa_cache_tag("mine|speedkit-cpu-isa=AVX2/AVX2", "AVX512")
        'mine|speedkit-cpu-isa=AVX512'
    """
    kept = [part for part in tag.split("|") if part and not part.startswith(ISA_TAG)]
    return "|".join([*kept, ISA_TAG + isa])


def tag_compile_cache() -> str | None:
    """Key torch.compile's on-disk caches by the CPU ISA this process compiles for; the tag set, or None.

    Inductor compiles CPU code for the vector ISA torch dispatches to (``torch.backends.cpu.get_cpu_capability()``,
    lowered by ``ATEN_CPU_CAPABILITY``), but torch 2.13's FX graph cache keys a CPU graph by nothing of the CPU. On
    one cache directory, a graph compiled under ``ATEN_CPU_CAPABILITY=avx2`` was loaded by a process at AVX-512, and
    the reverse: its outputs were not the eager module's (NaN after a fit) and the heap was corrupted ("double free
    or corruption"), on the 2-core AVX-512 EPYC. The ISA (and a oneDNN cap, `lightning_speedkit.hardware.forced_isa`)
    goes into ``torch.compiler.config.cache_key_tag``, which that key includes, beside any tag of the user's; it
    stays set for the process, so a later recompile keys the same way. None on a torch without that setting.
    """
    config = getattr(torch.compiler, "config", None)
    if config is None or not hasattr(config, "cache_key_tag"):
        return None
    level, _ = forced_isa()
    isa = torch.backends.cpu.get_cpu_capability() + (f"/{level}" if level else "")
    config.cache_key_tag = isa_cache_tag(str(config.cache_key_tag), isa)
    return str(config.cache_key_tag)
