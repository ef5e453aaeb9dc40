"""lightning_speedkit: make PyTorch Lightning training fast without rewriting the model.

Users write ``import lightning_speedkit as speedkit``.
"""

from lightning_speedkit import data, demo
from lightning_speedkit.__about__ import __version__
from lightning_speedkit.average import WeightAverage
from lightning_speedkit.batch_size import BatchSizeFinder
from lightning_speedkit.callback_table import default_callbacks
from lightning_speedkit.channels_last import ChannelsLast
from lightning_speedkit.compile import Compile
from lightning_speedkit.dataloader import DataLoaderTuner
from lightning_speedkit.fused import FusedOptimizer
from lightning_speedkit.guard import TrainingGuard
from lightning_speedkit.int8 import Int8Export, export_int8
from lightning_speedkit.loggers import RunSummary
from lightning_speedkit.lr_finder import LRFinder
from lightning_speedkit.monitor import UtilizationMonitor
from lightning_speedkit.precision import PrecisionTuner
from lightning_speedkit.preset import preset
from lightning_speedkit.pruning import StructuredPruning, load_pruned_checkpoint
from lightning_speedkit.warmup import WarmupScheduler

__all__ = [
    "BatchSizeFinder",
    "ChannelsLast",
    "Compile",
    "DataLoaderTuner",
    "FusedOptimizer",
    "Int8Export",
    "LRFinder",
    "PrecisionTuner",
    "RunSummary",
    "StructuredPruning",
    "TrainingGuard",
    "UtilizationMonitor",
    "WarmupScheduler",
    "WeightAverage",
    "__version__",
    "data",
    "default_callbacks",
    "demo",
    "export_int8",
    "load_pruned_checkpoint",
    "preset",
]
