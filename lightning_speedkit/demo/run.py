"""The ``speedkit demo`` job: the naive baseline and speedkit's preset, trained to the same accuracy, side by side."""

from __future__ import annotations

import dataclasses
import os
import shutil
import statistics
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import EarlyStopping
from typing_extensions import override

from lightning_speedkit.batch import batch_size_of
from lightning_speedkit.checks import check_bool, check_int, check_number, is_int
from lightning_speedkit.demo.data import CLASSES, DemoDataModule, ensure_shapes
from lightning_speedkit.demo.model import DemoClassifier
from lightning_speedkit.demo.seeds import MAX_SEED, parse_seeds, seed_speedup
from lightning_speedkit.demo.tables import format_report, format_seeds
from lightning_speedkit.report import collect_reports, machine_and_load, write_json_atomic

__all__ = [
    "ABLATION",
    "VARIANTS",
    "DemoConfig",
    "Timeline",
    "format_report",
    "format_seeds",
    "parse_seeds",
    "run_demo",
    "run_seeds",
    "train_variant",
]

VARIANTS = ("baseline", "speedkit")
"""``baseline``: the naive setup (plain Trainer, decode per sample, no workers, fp32, AdamW at a constant LR).
``speedkit``: the same model, seed, data, LR and epoch budget through ``preset(lr="auto")`` with the library's
defaults on a packed cache: what a user writes for any model. Nothing in it is tuned for this workload."""

ABLATION = ("baseline", "cache", "channels_last", "speedkit")
"""For ``speedkit demo --ablation``: each run adds one lever to the run before it. ``cache``: the packed cache of
decoded images; ``channels_last``: plus `~lightning_speedkit.ChannelsLast`; ``speedkit``: plus the rest of
``preset(lr="auto")``."""

_LEVERS = {
    "baseline": frozenset(),
    "cache": frozenset({"cache"}),
    "channels_last": frozenset({"cache", "channels_last"}),
    "speedkit": frozenset({"cache", "channels_last", "preset"}),
}


_MOST_IMAGES = 1_000_000
"""The most images the demo generates (about 4 GB of JPEGs at 64 px)."""


@dataclasses.dataclass(frozen=True)
class DemoConfig:
    """Sizes and settings of one demo run; both variants get all of them, the epoch budget included.

    The baseline is the naive setup: batch 32, no workers, fp32, AdamW at a constant ``lr``. Speedkit's run is
    ``preset(lr="auto")`` on the same model, data, ``lr`` and ``max_epochs``: the library chooses the rest. Both stop
    when ``val_acc`` reaches ``target_acc`` (with ``stop_at_target``; else both train the whole budget and the time
    to target is read from their timelines). The default budget of 8 epochs lets the baseline reach the target on
    every seed 0-4 (it needs 4-6).

    ``quick()`` gives the small run.
    """

    num_images: int = 5000
    image_size: int = 64
    width: int = 16
    blocks_per_stage: int = 1
    batch_size: int = 32
    num_workers: int = 0
    lr: float = 1e-3
    max_epochs: int = 8
    target_acc: float = 0.95
    seed: int = 0
    precision: str = "32-true"
    cache_dir: str | None = None
    stop_at_target: bool = True
    data: str = "files"
    """``"files"`` (JPEGs decoded per sample) or ``"streaming"`` (both runs stream from litdata's format)."""

    def __post_init__(self) -> None:
        """Refuse settings that would train nothing or mislabel the table, naming the field."""
        check_number("lr", self.lr, 0, open_low=True)
        for name in ("max_epochs", "batch_size", "width", "blocks_per_stage"):
            check_int(name, getattr(self, name))
        check_int("num_images", self.num_images, low=len(CLASSES))  # one per class, as `DemoDataModule` asks
        for name, most in (("num_images", _MOST_IMAGES), ("width", 1024), ("blocks_per_stage", 16)):
            if getattr(self, name) > most:  # a typo's extra digits: hours of JPEGs on disk, or an allocator traceback
                raise ValueError(
                    f"`{name}` must be at most {most:,} for the demo workload, got {getattr(self, name)!r}."
                )
        if self.batch_size > self.num_images:
            raise ValueError(f"`batch_size` must be at most `num_images`={self.num_images}, got {self.batch_size!r}.")
        check_int("num_workers", self.num_workers, low=0)
        check_bool("stop_at_target", self.stop_at_target)
        if self.data not in ("files", "streaming"):
            raise ValueError(f"`data` must be one of files, streaming, got {self.data!r}.")
        check_number("target_acc", self.target_acc, 0, 1, open_low=True)
        if not is_int(self.seed, 0) or self.seed > MAX_SEED:
            raise ValueError(f"`seed` must be an int in [0, {MAX_SEED}] (a numpy seed), got {self.seed!r}.")
        if self.cache_dir is not None and not (isinstance(self.cache_dir, str) and self.cache_dir.strip()):
            raise ValueError(f"`cache_dir` must be a directory or None, got {self.cache_dir!r}.")

    @classmethod
    def quick(cls, **overrides: Any) -> DemoConfig:
        """A small run: 1,200 images, target 0.75, the whole budget of 15 epochs (about a minute for both sides).

        It trains to the end of its budget (``stop_at_target=False``), so the final accuracies compare like for like.
        """
        values: dict[str, Any] = {"num_images": 1200, "max_epochs": 15, "target_acc": 0.75, "stop_at_target": False}
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
    config: DemoConfig,
    variant: str,
    out_dir: str | Path | None = None,
    progress: bool = True,
    callbacks: Sequence[L.Callback] = (),
    preset_options: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Train one variant until ``val_acc >= config.target_acc`` (or ``max_epochs``) and measure it.

    The clock starts just before ``trainer.fit``: dataset caching, loader probing and everything else speedkit
    does is counted. Both variants carry a `UtilizationMonitor` so each gets a diagnosis. ``callbacks`` are added to
    the run and ``preset_options`` override ``preset``'s arguments (for benchmarks that change one lever, e.g.
    ``LRFinder(min_signal=0)``, which replaces preset's of the same type, or ``{"lr": None}``); ``speedkit demo``
    passes neither.

    Returns:
        ``time_to_target_s`` (None when not reached), ``total_s``, ``epochs``, ``final_val_acc``, ``samples_per_s``
        (training samples over training-step time), ``data_wait_fraction``, ``diagnosis``, ``advice``,
        ``step_data_wait_ms`` / ``step_compute_ms`` / ``step_between_ms`` (the loop's and hooks' work between steps),
        ``choices`` (what preset chose, for speedkit) and ``timeline``.
    """
    if variant not in ABLATION:
        raise ValueError(f"`variant` must be one of {', '.join(ABLATION)}, got {variant!r}.")
    from lightning_speedkit.channels_last import ChannelsLast
    from lightning_speedkit.monitor import UtilizationMonitor
    from lightning_speedkit.preset import preset

    L.seed_everything(config.seed, verbose=False)
    levers = _LEVERS[variant]
    use_preset = "preset" in levers
    datamodule = DemoDataModule(
        num_images=config.num_images,
        image_size=config.image_size,
        batch_size=config.batch_size,
        num_workers=config.num_workers,
        seed=config.seed,
        root=config.cache_dir,
        cache="cache" in levers,
        streaming=config.data == "streaming",
    )
    datamodule.prepare_data()  # generating the images is not part of either run
    if "cache" in levers:  # every run that uses the packed cache pays for building it, inside its timed fit
        directory = ensure_shapes(config.num_images, config.image_size, config.seed, config.cache_dir)
        shutil.rmtree(directory / "packed", ignore_errors=True)
    model = DemoClassifier(
        width=config.width, blocks_per_stage=config.blocks_per_stage, lr=config.lr, crop_size=datamodule.crop_size
    )
    timeline = Timeline(verbose=progress, name=variant)
    stop: list[L.Callback] = []
    if config.stop_at_target:
        stop.append(
            EarlyStopping(
                monitor="val_acc", mode="max", stopping_threshold=config.target_acc, patience=config.max_epochs
            )
        )
    common: dict[str, Any] = {
        "max_epochs": config.max_epochs,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
        "default_root_dir": str(Path(out_dir) / variant) if out_dir is not None else None,
    }
    monitor = UtilizationMonitor(window=50)
    if use_preset:
        options: dict[str, Any] = {"devices": 1, "logger": False, "verbose": progress, "lr": "auto", **common}
        trainer = preset(callbacks=[*callbacks, monitor, timeline, *stop], **{**options, **(preset_options or {})})
    else:
        extra = [ChannelsLast()] if "channels_last" in levers else []
        trainer = L.Trainer(
            accelerator="gpu" if torch.cuda.is_available() else "cpu",  # the device preset would choose
            devices=1,
            precision=config.precision,  # type: ignore[arg-type]
            callbacks=[*extra, *callbacks, monitor, timeline, *stop],
            logger=False,
            **common,
        )
    timeline.start()
    trainer.fit(model, datamodule)
    choices = _choices(trainer, config)

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
        "step_between_ms": 1e3 * totals.get("between_s", 0.0) / steps,  # the loop's and hooks' work between steps
        "diagnosis": monitored["diagnosis"],
        "advice": monitored["advice"],
        "choices": choices,
        "cache_build": {  # the packed cache's build, inside the timed fit (None: not cached)
            split: getattr(getattr(datamodule, f"{split}_set", None), "build_report", None)
            for split in ("train", "val")
        },
        "lr": choices["lr"],
        "schedule": choices["schedule"],
        "max_epochs": config.max_epochs,
        "timeline": points,
    }


_EVERY_RUN = ("UtilizationMonitor", "Timeline", "RunSummary")
"""Callbacks every variant carries (measurement, not levers): left out of a run's ``callbacks``."""


def _choices(trainer: L.Trainer, config: DemoConfig) -> dict[str, Any]:
    """What each run used, read from the trained Trainer and speedkit's reports (not restated from a config)."""
    from lightning_speedkit.cooldown import describe
    from lightning_speedkit.warmup import WarmupScheduler

    callbacks: list[L.Callback] = trainer.callbacks  # type: ignore[attr-defined]
    ours = [c for c in callbacks if type(c).__module__.startswith("lightning_speedkit")]
    reports, _ = collect_reports(ours)
    finder = reports.get("LRFinder", {})
    warmup = next((c for c in ours if isinstance(c, WarmupScheduler)), None)
    schedule = "constant"
    if warmup is not None:
        report, resolved = warmup.report(), warmup.schedule  # as set by a finder that raised the LR, if so
        asked, decay = report["warmup"], report["decay_used"] or report["decay"]
        length = f"{asked:.0%}" if isinstance(asked, float) else f"{asked} steps"
        length = f"{resolved[0]} steps" if resolved is not None else length
        decay = describe(report["cooldown_check"], warmup.cooldown) if decay == "wsd" else decay
        schedule = f"warmup {length}, {decay}"
    layout = reports.get("ChannelsLast", {})
    paid = {n: float(r["probe_s"]) for n, r in reports.items() if r.get("probe_s") and r.get("source") != "remembered"}
    memory = {n: {k: r[k] for k in ("memory_note", "memory_check") if k in r} for n, r in reports.items()}
    return {
        "precision": str(trainer.precision),
        "precision_reason": reports.get("PrecisionTuner", {}).get("reason", "as set"),
        "channels_last": layout.get("decision", "not used"),
        "optimizer": reports.get("FusedOptimizer", {}).get("decision", "not used"),
        "loader": reports.get("DataLoaderTuner", {}).get("decision", "as built"),
        "lr": float(finder.get("chosen_lr", config.lr)),
        "lr_reason": finder.get("reason", "as set"),
        "schedule": schedule,
        "rollbacks": reports.get("TrainingGuard", {}).get("rollbacks", 0),
        "callbacks": [type(c).__name__ for c in ours if type(c).__name__ not in _EVERY_RUN],
        "probe_s": sum(paid.values()),
        "probes": paid,
        "sources": {name: r["source"] for name, r in reports.items() if "source" in r},
        "memory": {n: m for n, m in memory.items() if m},  # each lever's memory note and live check, where it has one
    }


def run_demo(
    config: DemoConfig,
    out_dir: str | Path | None = None,
    progress: bool = True,
    variants: tuple[str, ...] = VARIANTS,
) -> dict[str, Any]:
    """Train each variant to ``config.target_acc`` and compare them.

    Returns:
        ``{"config", "machine", "runs": {variant: train_variant(...)}, "speedup", "load_average"}``, as `run_seeds`
        names the CPU and the load; ``speedup`` is the baseline's time to target over speedkit's (None unless both
        reached it). With ``out_dir``: ``demo.json`` and, when matplotlib is installed, ``demo.png``.
    """
    load_before = os.getloadavg()
    runs = {variant: train_variant(config, variant, out_dir, progress) for variant in variants}
    times: list[Any] = [(runs.get(variant) or {}).get("time_to_target_s") for variant in ("baseline", "speedkit")]
    speedup = times[0] / times[1] if all(times) else None
    report = {"config": dataclasses.asdict(config), "runs": runs, "speedup": speedup, **machine_and_load(load_before)}
    if out_dir is not None:
        write_json_atomic(report, Path(out_dir) / "demo.json")
        from lightning_speedkit.demo.plot import plot_demo

        report["plot"] = plot_demo(report, Path(out_dir) / "demo.png")
    return report


def run_seeds(
    config: DemoConfig, seeds: Sequence[int], out_dir: str | Path | None = None, progress: bool = True
) -> dict[str, Any]:
    """Train baseline and speedkit on every seed, in alternating order, and summarise the speed-ups.

    Seed ``i`` (by position) runs the baseline first when ``i`` is even and speedkit first when it is odd, so a slow
    spell on a shared machine does not always hit the same side. A seed where speedkit misses the target counts as
    0.00x; one where only the baseline misses counts as at least its whole run over speedkit's time
    (``speedup_at_least``: `lightning_speedkit.demo.seeds.seed_speedup`). With ``out_dir`` the report is written to
    ``demo.json`` there.

    Returns:
        ``{"config", "machine", "seeds": [{"seed", "order", "baseline", "speedkit", "speedup"}], "summary",
        "load_average"}``: ``machine`` names the CPU (`lightning_speedkit.hardware.CpuInfo.machine`), ``summary``
        holds ``median``, ``worst``, ``reached`` and ``total``, ``load_average`` the 1/5/15-minute load before and after
        (a busy machine makes every figure noisy).
    """
    rows: list[dict[str, Any]] = []
    load_before = os.getloadavg()
    for position, seed in enumerate(seeds):
        seeded = dataclasses.replace(config, seed=seed)
        order = VARIANTS if position % 2 == 0 else tuple(reversed(VARIANTS))
        runs = {variant: train_variant(seeded, variant, out_dir, progress) for variant in order}
        speedup, at_least = seed_speedup(runs["baseline"], runs["speedkit"])
        rows.append({"seed": seed, "order": list(order), **runs, "speedup": speedup, "speedup_at_least": at_least})
    speedups = [row["speedup"] for row in rows]
    summary = {
        "median": statistics.median(speedups),
        "worst": min(speedups),
        "reached": sum(1 for row in rows if row["speedkit"]["time_to_target_s"]),
        "baseline_reached": sum(1 for row in rows if row["baseline"]["time_to_target_s"]),
        "total": len(rows),
    }
    report = {
        "config": {**dataclasses.asdict(config), "seed": None},
        "seeds": rows,
        "summary": summary,
        **machine_and_load(load_before),
    }
    if out_dir is not None:
        write_json_atomic(report, Path(out_dir) / "demo.json")
    return report
