"""lightning_speedkit: make PyTorch Lightning training fast without rewriting the model.

Users write ``import lightning_speedkit as speedkit``.
"""

from lightning_speedkit import demo
from lightning_speedkit.__about__ import __version__
from lightning_speedkit.warmup import WarmupScheduler

__all__ = ["WarmupScheduler", "__version__", "demo"]
