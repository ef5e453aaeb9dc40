"""Whether compiling pays back: the saving per step projected over the steps left, against the compile seconds."""

from __future__ import annotations

import math

__all__ = ["MAX_GAIN", "compile_pays_back", "compile_worth_probing"]

MAX_GAIN = 0.5
"""The most compiling is taken to save of a step when deciding whether to probe (1.3-1.4x measured here)."""


def compile_pays_back(
    eager_step_s: float, compiled_step_s: float, compile_s: float, steps_left: float, margin: float = 0.1
) -> tuple[bool, str]:
    """Whether compiling pays back: ``(eager_step_s - compiled_step_s) * steps_left > compile_s * (1 + margin)``.

    Example:
        >>> compile_pays_back(0.030, 0.020, compile_s=10.0, steps_left=5000, margin=0.1)
        (True, 'compiled: 50.0 s saved over 5000 steps left > 11.0 s (compile 10.0 s + 10%)')
        >>> compile_pays_back(0.030, 0.020, compile_s=10.0, steps_left=500, margin=0.1)[1]
        'eager: 5.0 s saved over 500 steps left <= 11.0 s (compile 10.0 s + 10%)'
        >>> compile_pays_back(0.030, 0.031, compile_s=1.0, steps_left=float("inf"))[1]
        'eager: the compiled step is not faster (31.0 ms vs 30.0 ms eager)'
    """
    if compiled_step_s >= eager_step_s:
        shown = f"{1e3 * compiled_step_s:.1f} ms vs {1e3 * eager_step_s:.1f} ms eager"
        return False, f"eager: the compiled step is not faster ({shown})"
    cost = compile_s * (1.0 + margin)
    if math.isinf(steps_left):
        return True, f"compiled: {100 * (1 - compiled_step_s / eager_step_s):.1f}% faster per step in an unbounded run"
    saved = (eager_step_s - compiled_step_s) * steps_left
    shown = f"{saved:.1f} s saved over {steps_left:.0f} steps left"
    paid = f"{cost:.1f} s (compile {compile_s:.1f} s + {100 * margin:.0f}%)"
    if saved > cost:
        return True, f"compiled: {shown} > {paid}"
    return False, f"eager: {shown} <= {paid}"


def compile_worth_probing(
    eager_step_s: float, steps_left: float, min_compile_s: float, max_gain: float = MAX_GAIN, margin: float = 0.1
) -> tuple[bool, str]:
    """Before compiling anything: whether even steps ``max_gain`` shorter could repay a compile of ``min_compile_s``.

    Example:
        >>> compile_worth_probing(0.010, steps_left=200, min_compile_s=2.0)[1]
        'skipped: steps 50% faster would save at most 1.0 s in 200 steps left, less than a 2.0 s compile + 10%'
        >>> compile_worth_probing(0.010, steps_left=2000, min_compile_s=2.0)[0]
        True
    """
    pays, _ = compile_pays_back(eager_step_s, eager_step_s * (1.0 - max_gain), min_compile_s, steps_left, margin)
    best = "an unbounded run" if math.isinf(steps_left) else f"{max_gain * eager_step_s * steps_left:.1f} s"
    if pays:
        return True, f"worth probing: at best {best} saved"
    return False, (
        f"skipped: steps {100 * max_gain:.0f}% faster would save at most {best} in {steps_left:.0f} steps left,"
        f" less than a {min_compile_s:.1f} s compile + {100 * margin:.0f}%"
    )
