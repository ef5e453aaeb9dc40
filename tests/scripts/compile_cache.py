"""A fit under ``Compile(measure=False)`` on the inductor cache in ``TORCHINDUCTOR_CACHE_DIR``; how far it computes.

Run by ``tests/test_compile.py`` twice on one cache directory, once under ``ATEN_CPU_CAPABILITY=avx2
ONEDNN_MAX_CPU_ISA=AVX2`` and once without, in separate processes (a forced ISA is read when torch starts)::

    python tests/scripts/compile_cache.py OUT.json

``OUT.json`` gets the CPU capability torch dispatched to, the cache key tag the fit compiled under, and the largest
difference between the compiled module's outputs and an eager copy's on a fixed input (NaN if either is not finite).
"""

from __future__ import annotations

import copy
import json
import math
import sys
from pathlib import Path

import lightning as L
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from conftest import TinyClassifier, tiny_trainer

from lightning_speedkit import Compile


def main(out: str) -> None:
    L.seed_everything(0, verbose=False)
    model = TinyClassifier(num_samples=64)
    tiny_trainer(Path(out).parent, max_epochs=2, callbacks=[Compile(measure=False)]).fit(model)
    x = torch.randn(5, 16, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        eager, compiled = copy.deepcopy(model)(x), model(x)
    gap = (eager - compiled).abs().max().item()
    result = {
        "capability": torch.backends.cpu.get_cpu_capability(),
        "cache_key_tag": str(torch.compiler.config.cache_key_tag),
        "compiled": model._compiled_call_impl is not None,
        "max_abs_gap": gap if math.isfinite(gap) else None,
    }
    Path(out).write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1])
