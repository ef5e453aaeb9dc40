"""Compile: ``torch.compile`` as a measured lever, kept only when the steps left repay the compile with a margin.

Compiling costs seconds once (2-45 s on a 2-core CPU; the first compile in a process pays for starting the compiler)
and then saves a share of every step; a short job loses, a long one wins. So the callback times real training steps
eager and compiled through `lightning_speedkit.trials` (state restored afterwards, one verdict on every rank), times
the compile itself, and keeps the compiled module only when `compile_pays_back`. The LightningModule is compiled in
place (`torch.nn.Module.compile`), inside any DDP wrapper: ``state_dict`` keys stay clean and checkpoints load into an
eager model and back. ``benchmarks/compile.py`` sets the decision beside whole fits eager and compiled.

`lightning_speedkit.compile.payback` holds the pure payback rules, `lightning_speedkit.compile.dynamo` the plumbing
around dynamo (compile seconds; the compiled call that falls back to eager; torch.compile's cache keyed by the CPU
ISA, `lightning_speedkit.compile.dynamo.tag_compile_cache`) and `lightning_speedkit.compile.callback`
the `Compile` callback.
"""

from lightning_speedkit.compile.callback import COMPILE_MODES, Compile
from lightning_speedkit.compile.payback import compile_pays_back, compile_worth_probing

__all__ = ["COMPILE_MODES", "Compile", "compile_pays_back", "compile_worth_probing"]
