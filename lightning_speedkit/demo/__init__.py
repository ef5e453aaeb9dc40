"""The embedded demo workload: generated shape images on disk, a DataModule and a small ResNet.

Used by ``speedkit demo``, the benchmarks and the tests::

    from lightning_speedkit.demo import DemoClassifier, DemoDataModule

    trainer.fit(DemoClassifier(), DemoDataModule(num_images=5000, batch_size=32))
"""

from lightning_speedkit.demo.data import CLASSES, DemoDataModule, ShapesDataset, ensure_shapes, render_shape
from lightning_speedkit.demo.model import DemoClassifier, DemoResNet, FlatHeadNet
from lightning_speedkit.demo.run import DemoConfig, format_report, run_demo, train_variant

__all__ = [
    "CLASSES",
    "DemoClassifier",
    "DemoConfig",
    "DemoDataModule",
    "DemoResNet",
    "FlatHeadNet",
    "ShapesDataset",
    "ensure_shapes",
    "format_report",
    "render_shape",
    "run_demo",
    "train_variant",
]
