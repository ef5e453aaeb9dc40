"""The ``speedkit demo`` job: train the embedded workload to a target accuracy and report time and accuracy."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import EarlyStopping
from typing_extensions import override

from lightning_speedkit.demo.data import DemoDataModule
from lightning_speedkit.demo.model import DemoClassifier
from lightning_speedkit.report import write_json_atomic

__all__ = ["DemoConfig", "Timeline", "format_report", "run_demo"]


@dataclasses.dataclass(frozen=True)
class DemoConfig:
    """Sizes and settings of one demo run; the defaults are the naive baseline (batch 32, no workers, fp32).

    ``quick()`` gives a configuration small enough for tests (seconds, not minutes).
    """

    num_images: int = 5000
    image_size: int = 64
    width: int = 16
    blocks_per_stage: int = 1
    batch_size: int = 32
    num_workers: int = 0
    lr: float = 1e-3
    max_epochs: int = 15
    target_acc: float = 0.95
    seed: int = 0
    precision: str = "32-true"
    cache_dir: str | None = None

    @classmethod
    def quick(cls, **overrides: Any) -> DemoConfig:
        """A configuration for tests: 1,200 images, 10 short epochs, target 0.8 (under a minute)."""
        values: dict[str, Any] = {"num_images": 1200, "max_epochs": 10, "target_acc": 0.8}
        values.update(overrides)
        return cls(**values)


class Timeline(L.Callback):
    """Records elapsed wall time, samples seen and ``val_acc`` at the end of each validation epoch."""

    def __init__(self, verbose: bool = True) -> None:
        self.verbose = verbose
        self.points: list[dict[str, float]] = []
        self._start = 0.0
        self._samples = 0

    @override
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Start the clock."""
        self._start = time.perf_counter()

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Count the samples trained on."""
        self._samples += len(batch[1])

    @override
    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Record one point of the accuracy-vs-time curve."""
        if trainer.sanity_checking:
            return
        point = {
            "epoch": float(trainer.current_epoch),
            "seconds": time.perf_counter() - self._start,
            "samples": float(self._samples),
            "val_acc": float(trainer.callback_metrics["val_acc"]),
        }
        self.points.append(point)
        if self.verbose and trainer.is_global_zero:
            print(
                f"  epoch {trainer.current_epoch:>2}  {point['seconds']:7.1f} s  val_acc {point['val_acc']:.3f}",
                flush=True,
            )


def run_demo(config: DemoConfig, out_dir: str | Path | None = None, progress: bool = True) -> dict[str, Any]:
    """Train the demo model until ``val_acc >= config.target_acc`` (or ``max_epochs``) and measure it.

    Returns:
        A report dict: the config, ``time_to_target_s`` (``None`` when the target was not reached), ``total_s``,
        ``final_val_acc``, ``samples_per_s`` and the per-epoch ``timeline``. Written to ``out_dir/demo.json`` when
        ``out_dir`` is given.
    """
    L.seed_everything(config.seed, verbose=False)
    datamodule = DemoDataModule(
        num_images=config.num_images,
        image_size=config.image_size,
        batch_size=config.batch_size,
        num_workers=config.num_workers,
        seed=config.seed,
        root=config.cache_dir,
    )
    datamodule.prepare_data()  # generate the images before the clock starts
    model = DemoClassifier(
        width=config.width, blocks_per_stage=config.blocks_per_stage, lr=config.lr, crop_size=datamodule.crop_size
    )
    timeline = Timeline(verbose=progress)
    stop = EarlyStopping(
        monitor="val_acc", mode="max", stopping_threshold=config.target_acc, patience=config.max_epochs
    )
    trainer = L.Trainer(
        accelerator="cpu" if config.precision == "32-true" else "auto",
        devices=1,
        precision=config.precision,  # type: ignore[arg-type]
        max_epochs=config.max_epochs,
        callbacks=[timeline, stop],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,  # one line per epoch from Timeline instead
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=out_dir,
    )
    trainer.fit(model, datamodule)

    points = timeline.points
    reached = [p["seconds"] for p in points if p["val_acc"] >= config.target_acc]
    total = points[-1]["seconds"] if points else 0.0
    report: dict[str, Any] = {
        "config": dataclasses.asdict(config),
        "time_to_target_s": reached[0] if reached else None,
        "total_s": total,
        "epochs": len(points),
        "final_val_acc": points[-1]["val_acc"] if points else None,
        "samples_per_s": points[-1]["samples"] / total if total else None,
        "timeline": points,
    }
    if out_dir is not None:
        write_json_atomic(report, Path(out_dir) / "demo.json")
    return report


def format_report(report: dict[str, Any]) -> str:
    """A short plain-text summary of :func:`run_demo`'s report."""
    config = report["config"]
    target = report["time_to_target_s"]
    rows = [
        ("workload", f"{config['num_images']} images {config['image_size']}px, width {config['width']}"),
        ("settings", f"batch {config['batch_size']}, num_workers {config['num_workers']}, {config['precision']}"),
        ("epochs", str(report["epochs"])),
        (f"time to val_acc {config['target_acc']:.2f}", f"{target:.1f} s" if target is not None else "not reached"),
        ("total train time", f"{report['total_s']:.1f} s"),
        ("throughput", f"{report['samples_per_s'] or 0:.0f} samples/s (incl. validation)"),
        ("final val_acc", f"{report['final_val_acc'] or 0:.3f}"),
    ]
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)
