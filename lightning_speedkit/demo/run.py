"""The ``speedkit demo`` job: the naive baseline and speedkit's preset, trained to the same accuracy, side by side."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import EarlyStopping
from typing_extensions import override

from lightning_speedkit.batch import batch_size_of
from lightning_speedkit.demo.data import DemoDataModule
from lightning_speedkit.demo.model import DemoClassifier
from lightning_speedkit.report import write_json_atomic

__all__ = ["ABLATION", "VARIANTS", "DemoConfig", "Timeline", "format_report", "run_demo", "train_variant"]

VARIANTS = ("baseline", "speedkit")
"""``baseline``: the naive setup (plain Trainer, decode per sample, no workers, fp32, AdamW at a constant LR).
``speedkit``: the same model, seed and data through `~lightning_speedkit.preset` (DataLoaderTuner, ChannelsLast,
WarmupScheduler, UtilizationMonitor) on a packed cache, with the warmup making a higher peak LR safe and the cosine
decay planned over an epoch budget."""

ABLATION = ("baseline", "cache", "channels_last", "speedkit")
"""For ``speedkit demo --ablation``: each run adds one lever to the run before it. ``cache``: the packed cache of
decoded images; ``channels_last``: plus `~lightning_speedkit.ChannelsLast`; ``speedkit``: plus the rest of
`~lightning_speedkit.preset` and the schedule (warmup, speedkit's peak LR, cosine over the budget)."""

_LEVERS = {
    "baseline": frozenset(),
    "cache": frozenset({"cache"}),
    "channels_last": frozenset({"cache", "channels_last"}),
    "speedkit": frozenset({"cache", "channels_last", "preset"}),
}


@dataclasses.dataclass(frozen=True)
class DemoConfig:
    """Sizes and settings of one demo run, and the few that speedkit's run changes.

    The baseline is the naive setup: batch 32, no workers, fp32, AdamW at a constant ``lr``. Speedkit's run peaks at
    ``speedkit_lr``, reached after a linear warmup over ``warmup`` of its steps, then cosine-decayed to zero over a
    budget of ``speedkit_epochs`` epochs (at most ``max_epochs``).

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
    speedkit_lr: float = 3e-3
    speedkit_epochs: int = 4
    warmup: float = 0.1

    def __post_init__(self) -> None:
        """Refuse settings that would train nothing or mislabel the table, naming the field."""
        for name in ("lr", "speedkit_lr"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"`{name}` must be a positive number, got {value!r}.")
        for name in ("max_epochs", "speedkit_epochs", "num_images", "batch_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"`{name}` must be a positive int, got {value!r}.")
        if isinstance(self.warmup, bool) or not isinstance(self.warmup, float) or not 0.0 < self.warmup < 1.0:
            raise ValueError(f"`warmup` must be a float fraction of the steps in (0, 1), got {self.warmup!r}.")
        if not 0.0 < self.target_acc <= 1.0:
            raise ValueError(f"`target_acc` must be in (0, 1], got {self.target_acc!r}.")

    @classmethod
    def quick(cls, **overrides: Any) -> DemoConfig:
        """A configuration for tests: 1,200 images, 10 short epochs (speedkit: 6), target 0.8 (under a minute)."""
        values: dict[str, Any] = {"num_images": 1200, "max_epochs": 10, "target_acc": 0.8, "speedkit_epochs": 6}
        values.update(overrides)
        return cls(**values)


class Timeline(L.Callback):
    """Records elapsed wall time, samples seen and ``val_acc`` at the end of each validation epoch."""

    def __init__(self, verbose: bool = True, name: str = "") -> None:
        self.verbose = verbose
        self.name = name
        self.points: list[dict[str, float]] = []
        self._start = 0.0
        self._samples = 0

    def start(self) -> None:
        """Start the clock (call it just before ``trainer.fit``, so set-up and tuning are counted too)."""
        self._start = time.perf_counter()

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Count the samples trained on."""
        self._samples += batch_size_of(batch) or 0

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
                f"  {self.name:<9} epoch {trainer.current_epoch:>2}  {point['seconds']:7.1f} s"
                f"  val_acc {point['val_acc']:.3f}",
                flush=True,
            )


def train_variant(
    config: DemoConfig, variant: str, out_dir: str | Path | None = None, progress: bool = True
) -> dict[str, Any]:
    """Train one variant until ``val_acc >= config.target_acc`` (or ``max_epochs``) and measure it.

    The clock starts just before ``trainer.fit``: dataset caching, loader probing and everything else speedkit
    does is counted. Both variants carry a `UtilizationMonitor` so each gets a diagnosis.

    Returns:
        ``time_to_target_s`` (None when not reached), ``total_s``, ``epochs``, ``final_val_acc``, ``samples_per_s``
        (training samples over training-step time), ``data_wait_fraction``, ``diagnosis``, ``advice``,
        ``step_data_wait_ms`` / ``step_compute_ms``, ``choices`` (what preset chose, for speedkit) and ``timeline``.
    """
    if variant not in ABLATION:
        raise ValueError(f"`variant` must be one of {', '.join(ABLATION)}, got {variant!r}.")
    from lightning_speedkit.memory_format import ChannelsLast
    from lightning_speedkit.monitor import UtilizationMonitor
    from lightning_speedkit.preset import preset
    from lightning_speedkit.warmup import WarmupScheduler

    L.seed_everything(config.seed, verbose=False)
    levers = _LEVERS[variant]
    use_preset = "preset" in levers
    max_epochs = min(config.max_epochs, config.speedkit_epochs) if use_preset else config.max_epochs
    datamodule = DemoDataModule(
        num_images=config.num_images,
        image_size=config.image_size,
        batch_size=config.batch_size,
        num_workers=config.num_workers,
        seed=config.seed,
        root=config.cache_dir,
        cache="cache" in levers,
    )
    datamodule.prepare_data()  # generating the images is not part of either run
    lr = config.speedkit_lr if use_preset else config.lr
    model = DemoClassifier(
        width=config.width, blocks_per_stage=config.blocks_per_stage, lr=lr, crop_size=datamodule.crop_size
    )
    timeline = Timeline(verbose=progress, name=variant)
    stop = EarlyStopping(
        monitor="val_acc", mode="max", stopping_threshold=config.target_acc, patience=config.max_epochs
    )
    common: dict[str, Any] = {
        "max_epochs": max_epochs,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
        "default_root_dir": str(Path(out_dir) / variant) if out_dir is not None else None,
    }
    monitor = UtilizationMonitor(window=50)
    if use_preset:
        schedule = f"warmup {config.warmup:.0%}, cosine over {max_epochs} ep"
        warmup = WarmupScheduler(warmup=config.warmup, decay="cosine")  # decays over the run's budget of steps
        callbacks = [warmup, monitor, timeline, stop]
        trainer = preset(devices=1, logger=False, verbose=progress, callbacks=callbacks, **common)
        choices = {key: trainer.speedkit[key] for key in ("precision", "strategy", "callbacks")}  # type: ignore[attr-defined]
    else:
        schedule = "constant"
        extra = [ChannelsLast()] if "channels_last" in levers else []
        trainer = L.Trainer(
            accelerator="cpu",
            devices=1,
            precision=config.precision,  # type: ignore[arg-type]
            callbacks=[*extra, monitor, timeline, stop],
            logger=False,
            **common,
        )
        choices = {"precision": config.precision, "strategy": "auto", "callbacks": [type(c).__name__ for c in extra]}
    timeline.start()
    trainer.fit(model, datamodule)

    points = timeline.points
    reached = [p["seconds"] for p in points if p["val_acc"] >= config.target_acc]
    monitored = monitor.report()
    totals = monitored["total"]
    steps = max(1, int(totals["steps"]))
    return {
        "variant": variant,
        "time_to_target_s": reached[0] if reached else None,
        "total_s": points[-1]["seconds"] if points else 0.0,
        "epochs": len(points),
        "final_val_acc": points[-1]["val_acc"] if points else None,
        "samples_per_s": totals["samples_per_second"],
        "data_wait_fraction": totals["data_wait_fraction"],
        "step_data_wait_ms": 1e3 * totals["data_wait_s"] / steps,
        "step_compute_ms": 1e3 * totals["compute_s"] / steps,
        "diagnosis": monitored["diagnosis"],
        "advice": monitored["advice"],
        "choices": choices,
        "lr": lr,
        "schedule": schedule,
        "max_epochs": max_epochs,
        "timeline": points,
    }


def run_demo(
    config: DemoConfig,
    out_dir: str | Path | None = None,
    progress: bool = True,
    variants: tuple[str, ...] = VARIANTS,
) -> dict[str, Any]:
    """Train each variant to ``config.target_acc`` and compare them.

    Returns:
        ``{"config", "runs": {variant: train_variant(...)}, "speedup"}``, where ``speedup`` is the baseline's time
        to target over speedkit's (None unless both reached it). With ``out_dir``: ``demo.json`` and, when
        matplotlib is installed, ``demo.png`` (val accuracy vs wall time; per-step data wait vs compute).
    """
    runs = {variant: train_variant(config, variant, out_dir, progress) for variant in variants}
    base, fast = runs.get("baseline"), runs.get("speedkit")
    speedup = None
    if base and fast and base["time_to_target_s"] and fast["time_to_target_s"]:
        speedup = base["time_to_target_s"] / fast["time_to_target_s"]
    report: dict[str, Any] = {"config": dataclasses.asdict(config), "runs": runs, "speedup": speedup}
    if out_dir is not None:
        write_json_atomic(report, Path(out_dir) / "demo.json")
        from lightning_speedkit.demo.plot import plot_demo

        report["plot"] = plot_demo(report, Path(out_dir) / "demo.png")
    return report


def format_report(report: dict[str, Any]) -> str:
    """The side-by-side table of :func:`run_demo`'s report."""
    config, runs = report["config"], report["runs"]
    names = list(runs)

    def seconds(value: float | None) -> str:
        return f"{value:.1f} s" if value is not None else "not reached"

    rows: list[tuple[str, ...]] = [
        ("", *names),
        (f"time to val_acc {config['target_acc']:.2f}", *(seconds(runs[n]["time_to_target_s"]) for n in names)),
        ("epochs", *(str(runs[n]["epochs"]) for n in names)),
        ("train samples/s", *(f"{runs[n]['samples_per_s']:.0f}" for n in names)),
        ("data wait", *(f"{100 * runs[n]['data_wait_fraction']:.1f}%" for n in names)),
        ("diagnosis", *(str(runs[n]["diagnosis"]) for n in names)),
        ("final val_acc", *(f"{runs[n]['final_val_acc'] or 0:.3f}" for n in names)),
        ("precision", *(str(runs[n]["choices"]["precision"]) for n in names)),
        ("peak LR", *(f"{runs[n]['lr']:g}" for n in names)),
        ("LR schedule", *(str(runs[n]["schedule"]) for n in names)),
        ("max epochs", *(str(runs[n]["max_epochs"]) for n in names)),
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [
        f"demo workload: {config['num_images']} images {config['image_size']}px, width {config['width']},"
        f" batch {config['batch_size']}, AdamW"
    ]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    if report.get("speedup") is not None:
        lines.append(f"speed-up (time to target, baseline / speedkit): {report['speedup']:.2f}x")
    for name in names:
        lines.append(f"{name} diagnosis: {runs[name]['advice']}")
    return "\n".join(lines)
