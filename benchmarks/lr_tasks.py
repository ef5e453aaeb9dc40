"""Time to accuracy at a wrong learning rate: a plain Trainer, preset() and preset(lr="auto"), against an LR grid.

Five tasks of different shapes, all data made in-process from a seed, each declaring the LR that is right for it:
``mlp`` (tabular, a random teacher's labels, SGD with momentum 0.9), ``conv`` (16x16 images holding one of four
patterns, Adam), ``transformer`` (`_models.TextEncoder`, smaller, on `_models.text_data`, AdamW), ``demo`` (the
demo's ResNet on its packed-cache shape images, AdamW) and ``conv_bn`` (the conv net with BatchNorm, SGD with
momentum 0.9; added later, held out from the LR trials' rules). For every task, user LR (the right one times 0.01,
0.1, 1 or 10) and seed, four fits of the whole budget (no early stopping) run back to back in rotated order:

- ``naive``: a plain ``lightning.Trainer`` at the user's LR, constant;
- ``preset``: ``speedkit.preset()`` at the user's LR;
- ``preset_auto``: the same with ``lr="auto"``;
- ``naive_nudged``: the naive fit once more, every non-zero initial weight one float ulp up (`nudge_weights`): the
  same job, as far as any user can tell, on the same batches. Its time to target differs from naive's by the machine
  (a target reached in 0.3 s moved by half of it on the shared 2-core EPYC) and by the trajectory's own chaos: a
  rounding-level difference (a fused optimizer's, bf16's) moves the epoch at which a target near a run's peak is
  first crossed (one ulp moved it by an epoch in 4 of 5 cells tried at 47e7cb9). The two naive fits measure this
  benchmark's noise.

Plain fits at the right LR times 0.1, 0.3, 1, 3 and 10 make the grid (the naive fits at 0.1x, 1x and 10x are grid
points; only 0.3x and 3x are fitted again). A task's target is ``MARGIN`` times the lowest peak ``val_acc`` over the
seeds of its best grid LR (the highest mean peak); a run's time to target is the wall time from the start of
``trainer.fit`` (every probe included) to the first validation epoch at or above it, and a seed's oracle is the
grid's best time (the grid's own cost not counted). Every fit decides afresh (`_harness.fresh_decisions`).

On a shared machine pass ``--threads 1``: two OpenMP threads on busy cores made a 1.5 s fit take 30 s. One fit on 2
EPYC cores at one thread: mlp 3 s (preset 5 s), conv 5 s (8 s), transformer 6 s (8 s), demo 33 s (36 s); 216 fits
for those four. ``conv_bn`` adds 54 fits of about 3 s (the Intel Xeon).

    python benchmarks/lr_tasks.py --threads 1                  # about 50 minutes on 2 busy CPU cores
    python benchmarks/lr_tasks.py --tasks mlp,conv --seeds 0   # a part of it
    python benchmarks/lr_tasks.py --quick                      # a smoke run for the tests (JSON to a temp dir)
    python benchmarks/lr_tasks.py --threads 1 --average        # also preset(lr="auto", average=True) in every cell
    python benchmarks/lr_tasks.py --threads 1 --recheck 2      # each cell a preset variant was late in: again, twice
    python benchmarks/lr_tasks.py --threads 1 --schedule linear  # every fit with the user's own LR schedule

With ``--schedule linear`` (or ``cosine``) every fit, the plain ones and the grid's included, trains under the user's
own LR schedule (`SCHEDULES`): a fine-tune's warmup and decay, which ``preset()``'s schedule multiplies on top of and
whose first steps ``lr="auto"`` would otherwise search at.

A cell's verdict rests on one fit of each variant, and a load spike on a shared machine can slow the one epoch a
target falls in (0.17 s of a 1.4-s time to target, once, on the Intel Xeon), while one nudge is one sample of the
trajectory's chaos. ``--recheck N`` runs every cell in which ``preset`` or ``preset_auto`` was later than naive
again, N times (after the whole run, or on a result written before: ``--recheck-from FILE``): naive, the naive fit
nudged by 2, 3, ... ulps (another rounding-level start each time) and the late variants, back to back in rotated
order. A lateness that repeats in every re-run (``..._later_repeated``) is the variant's own (a probe's cost, a
trajectory), one that does not was the machine's; one that is also later than the slowest of every naive fit, the
first run's two and the re-runs' (``..._later_beyond_noise``), is beyond both kinds of noise. The first run's counts
stay as they were.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import logging
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.classification import MulticlassAccuracy
from typing_extensions import override

import lightning_speedkit as speedkit
from lightning_speedkit.demo import DemoClassifier, DemoDataModule
from lightning_speedkit.demo.run import Timeline, parse_seeds
from lightning_speedkit.report import collect_reports, machine_and_load

if str(Path(__file__).resolve().parent) not in sys.path:  # _harness, also when a test loads this file by path
    sys.path.append(str(Path(__file__).resolve().parent))

import _lr_free
from _harness import QUIET, Column, fresh_decisions, print_and_write, quiet_trainer, rotated, table, torch_threads
from _models import TextEncoder, text_data

DEFAULT_OUT = Path(__file__).parent / "results" / "lr_tasks.json"
FACTORS: dict[float, str] = {0.01: "100x low", 0.1: "10x low", 1.0: "right", 10.0: "10x high"}
"""The user's LR as a multiple of the task's right LR, and its label."""
GRID = (0.1, 0.3, 1.0, 3.0, 10.0)
"""The grid of plain fits, as multiples of the right LR: the target and the oracle come from it."""
SEEDS = (0, 1, 2)
VARIANTS = ("naive", "preset", "preset_auto", "naive_nudged")
LR_FREE = _lr_free.VARIANTS
"""``--lr-free`` adds these to every cell: ``preset()`` with the task's optimizer swapped for Prodigy, D-Adaptation
or a schedule-free one (`_lr_free`), what a user could opt into instead of the LR trials."""
AVERAGE = ("preset_auto_average",)
"""``--average`` adds this to every cell: ``preset(lr="auto", average=True)``, the LR trials with validation on a moving
average of the weights (`lightning_speedkit.WeightAverage`), beside ``preset_auto`` without it."""
EXTRAS = {"lr_free": LR_FREE, "average": AVERAGE}
"""The opt-in groups of variants, by the summary key their counts go under."""
MARGIN = 0.98
"""The target is this share of the lowest peak val_acc (over seeds) of the best grid LR."""
WITHOUT = "preset_without_"
"""A variant ``preset_without_<argument>``: ``preset(<argument>=False)``, one lever off (`lr_starts --without`)."""
NOISE = 0.10
"""A variant counts as later than naive only when its time to target is more than this share above naive's (and, in
the counts beyond the measured noise, above the slowest of the naive fits': `later_than_every`)."""
QUICK_FACTORS, QUICK_GRID = (0.1, 1.0), (1.0,)
SCHEDULES = ("constant", "linear", "cosine")
"""The user's own LR schedule (``--schedule``), stepped every step, in every fit alike: none (``"constant"``), Hugging
Face's ``get_linear_schedule_with_warmup`` (`WARMUP_SHARE` of the steps up from 0, then linearly down to 0: a
fine-tune's) or ``CosineAnnealingLR`` over the run."""
WARMUP_SHARE = 0.06
"""The ``"linear"`` schedule's warmup, as a share of the run's steps."""

# ---------------------------------------------------------------------------------------------- pure functions


def linear_with_warmup(step: int, warmup: int, total: int) -> float:
    """The LR factor of Hugging Face's ``get_linear_schedule_with_warmup`` at ``step`` (0 at step 0).

    Example:
        >>> [round(linear_with_warmup(s, 2, 6), 2) for s in range(7)]
        [0.0, 0.5, 1.0, 0.75, 0.5, 0.25, 0.0]
    """
    if step < warmup:
        return step / max(1, warmup)
    return max(0.0, (total - step) / max(1, total - warmup))


def with_schedule(model: L.LightningModule, schedule: str) -> L.LightningModule:
    """``model`` whose ``configure_optimizers`` adds the user's ``schedule`` (`SCHEDULES`), stepped every step.

    The schedule is sized from ``trainer.estimated_stepping_batches`` when the fit asks for the optimizer.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"`schedule` must be one of {', '.join(SCHEDULES)}, got {schedule!r}.")
    if schedule == "constant":
        return model
    own = model.configure_optimizers

    def configure() -> Any:
        optimizer = own()
        total = max(1, int(model.trainer.estimated_stepping_batches))
        if schedule == "linear":
            warmup = math.ceil(WARMUP_SHARE * total)
            factor = functools.partial(linear_with_warmup, warmup=warmup, total=total)
            scheduler: Any = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
        else:
            scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    model.configure_optimizers = configure  # type: ignore[method-assign]
    return model


def time_to_target(timeline: Sequence[Mapping[str, float]], target: float) -> float | None:
    """Seconds at the first point of ``timeline`` whose ``val_acc`` is at least ``target``; None when none is.

    Example:
        >>> time_to_target([{"seconds": 1.0, "val_acc": 0.5}, {"seconds": 2.0, "val_acc": 0.9}], 0.8)
        2.0
    """
    return next((float(p["seconds"]) for p in timeline if p["val_acc"] >= target), None)


def epoch_to_target(timeline: Sequence[Mapping[str, float]], target: float) -> int | None:
    """The epoch of the first point of ``timeline`` whose ``val_acc`` is at least ``target``; None when none is.

    Example:
        >>> epoch_to_target([{"epoch": 0, "val_acc": 0.5}, {"epoch": 1, "val_acc": 0.9}], 0.8)
        1
    """
    return next((int(p["epoch"]) for p in timeline if p["val_acc"] >= target), None)


def timed_points(
    trainer: L.Trainer, model: L.LightningModule, data: L.LightningDataModule, timeline: Timeline
) -> tuple[float, list[dict[str, Any]]]:
    """``trainer.fit(model, data)`` timed from the call (``timeline`` among its callbacks); its seconds and epochs.

    Each epoch's point is ``epoch``, ``seconds`` (since the fit started) and ``val_acc``.
    """
    timeline.start()
    start = time.perf_counter()
    trainer.fit(model, data)
    seconds = time.perf_counter() - start
    points = [{"epoch": int(p["epoch"]), "seconds": p["seconds"], "val_acc": p["val_acc"]} for p in timeline.points]
    return seconds, points


def peak_acc(timeline: Sequence[Mapping[str, float]]) -> float:
    """The highest ``val_acc`` of ``timeline`` (0.0 for an empty one)."""
    return max((float(p["val_acc"]) for p in timeline), default=0.0)


def task_target(peaks: Mapping[float, Sequence[float]], margin: float = MARGIN) -> tuple[float, float]:
    """The best grid LR (highest mean peak over seeds) and the target: ``margin`` x its lowest peak, to 3 places.

    Example:
        >>> task_target({0.1: [0.6, 0.7], 1.0: [0.9, 0.8], 10.0: [0.3, 0.2]})
        (1.0, 0.784)
    """
    best = max(peaks, key=lambda factor: statistics.fmean(peaks[factor]))
    return best, round(margin * min(peaks[best]), 3)


def oracle_time(times: Iterable[float | None]) -> float | None:
    """The smallest of ``times`` that reached the target (not None); None when none did."""
    return min((t for t in times if t is not None), default=None)


def speedup(naive_s: float | None, variant_s: float | None) -> float | str:
    """Naive time over the variant's, a miss (None) counting as infinitely long.

    A variant that misses while naive reaches scores 0.0; ``"naive missed"`` stands for infinity (the variant reached,
    naive did not) and ``"both missed"`` for no comparison.

    Example:
        >>> speedup(4.0, 2.0), speedup(4.0, None), speedup(None, 2.0), speedup(None, None)
        (2.0, 0.0, 'naive missed', 'both missed')
    """
    if naive_s is None:
        return "both missed" if variant_s is None else "naive missed"
    return 0.0 if variant_s is None else naive_s / variant_s


def later(naive_s: float | None, variant_s: float | None, noise: float = NOISE) -> bool:
    """Whether the variant reaches the target more than ``noise`` later than naive (a miss is infinitely late).

    Example:
        >>> later(2.0, 2.1), later(2.0, 2.5), later(2.0, None), later(None, None), later(None, 9.0)
        (False, True, True, False, False)
    """
    if variant_s is None:
        return naive_s is not None
    return naive_s is not None and variant_s > naive_s * (1.0 + noise)


def later_than_every(naive_s: Sequence[float | None], variant_s: float | None, noise: float = NOISE) -> bool:
    """Whether the variant is `later` than the slowest of the naive fits ``naive_s`` (the benchmark's noise).

    A naive fit that missed the target is infinitely slow: then no variant is later than the noise.

    Example:
        >>> later_than_every([0.3, 0.5], 0.52), later_than_every([0.3, 0.5], 0.6), later_than_every([0.3, None], 9.0)
        (False, True, False)
    """
    slowest = None if not naive_s or any(t is None for t in naive_s) else max(t for t in naive_s if t is not None)
    return later(slowest, variant_s, noise)


def nudge_weights(module: nn.Module, ulps: int = 1) -> nn.Module:
    """Move every non-zero floating-point parameter of ``module`` ``ulps`` float ulps up, in place; ``module``.

    The smallest change a float can take: the same model to any user, a rounding-level start for the trajectory (zeros
    stay zeros, so no denormal appears). The re-checks nudge by 2, 3, ... ulps: each another such start.

    Example:
        >>> layer = nn.Linear(2, 1)
        >>> with torch.no_grad():
        ...     _ = layer.weight.copy_(torch.tensor([[1.0, 0.0]]))
        >>> nudge_weights(layer).weight.tolist() == [[1.0 + 2.0**-23, 0.0]]
        True
        >>> nudge_weights(layer, ulps=2).weight.tolist() == [[1.0 + 3 * 2.0**-23, 0.0]]
        True
    """
    with torch.no_grad():
        for parameter in module.parameters():
            if parameter.is_floating_point():
                up = parameter
                for _ in range(ulps):
                    up = torch.nextafter(up, torch.full_like(up, math.inf))
                parameter.copy_(torch.where(parameter != 0, up, parameter))
    return module


def over(time_s: float | None, reference_s: float | None) -> float:
    """``time_s / reference_s``, a miss (None) counting as infinitely long; NaN when both missed."""
    if time_s is None or reference_s is None:
        return math.nan if time_s is None and reference_s is None else math.inf if time_s is None else 0.0
    return time_s / reference_s


# ---------------------------------------------------------------------------------------------- data and models


def teacher_data(samples: int, seed: int, features: int = 32, classes: int = 4) -> TensorDataset:
    """``(x, label)``: Gaussian features labelled by a fixed random 2-layer tanh teacher (the same for every seed)."""
    teacher = torch.Generator().manual_seed(1234)
    w1 = torch.randn(features, 8, generator=teacher) / features**0.5
    w2 = torch.randn(8, classes, generator=teacher)
    x = torch.randn(samples, features, generator=torch.Generator().manual_seed(seed))
    return TensorDataset(x, (torch.tanh(x @ w1) @ w2).argmax(1))


def pattern_data(samples: int, seed: int, side: int = 16, noise: float = 0.8) -> TensorDataset:
    """``(image, label)``: 1 x ``side`` x ``side`` noise holding one of four fixed 5x5 patterns; the label says which.

    The patterns are +-1 and the same for every seed; each is added at a random place, so only a spatial detector
    (a convolution) finds it.
    """
    patterns = torch.randn(4, 5, 5, generator=torch.Generator().manual_seed(4321)).sign()
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 4, (samples,), generator=g)
    images = noise * torch.randn(samples, 1, side, side, generator=g)
    places = torch.randint(0, side - 4, (samples, 2), generator=g).tolist()
    for image, label, (row, col) in zip(images, labels.tolist(), places, strict=True):
        image[0, row : row + 5, col : col + 5] += patterns[label]
    return TensorDataset(images, labels)


class Classifier(L.LightningModule):
    """``net`` trained on ``(*inputs, label)`` batches with cross-entropy; ``val_acc`` logged once per validation epoch.

    ``optimizer`` is ``"sgd"`` (momentum 0.9), ``"adam"`` or ``"adamw"`` (torch's defaults otherwise), at a constant
    ``lr``.
    """

    def __init__(self, net: nn.Module, optimizer: str, lr: float, classes: int = 4) -> None:
        super().__init__()
        self.net, self.optimizer_name, self.lr = net, optimizer, lr
        self.val_acc = MulticlassAccuracy(num_classes=classes, average="micro")

    @override
    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        return self.net(*inputs)  # type: ignore[no-any-return]

    @override
    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return F.cross_entropy(self(*batch[:-1]), batch[-1])

    @override
    def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        self.val_acc(self(*batch[:-1]), batch[-1])
        self.log("val_acc", self.val_acc, on_epoch=True)

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer_name == "sgd":
            return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        optimizer = torch.optim.Adam if self.optimizer_name == "adam" else torch.optim.AdamW
        return optimizer(self.parameters(), lr=self.lr)


class TensorData(L.LightningDataModule):
    """``dataset`` split in order, the first 80% to train (shuffled, ``batch_size``), the rest to validate."""

    def __init__(self, dataset: TensorDataset, batch_size: int) -> None:
        super().__init__()
        cut = len(dataset) * 4 // 5
        self.train_set, self.val_set = TensorDataset(*dataset[:cut]), TensorDataset(*dataset[cut:])
        self.batch_size = batch_size

    @override
    def train_dataloader(self) -> DataLoader[tuple[torch.Tensor, ...]]:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True)

    @override
    def val_dataloader(self) -> DataLoader[tuple[torch.Tensor, ...]]:
        return DataLoader(self.val_set, batch_size=256)


@dataclasses.dataclass(frozen=True)
class Task:
    """One workload: its optimizer, right LR, budget and how its data and model are built.

    The budget is ``max_epochs`` over ``samples`` (train and validation) in batches of ``batch_size``, validated every
    epoch. ``make_data(task, seed, root)`` gives the data module (``root`` for files), ``make_model(task, lr)`` the
    model; ``schedule`` is the user's LR schedule (`SCHEDULES`, `with_schedule`).
    """

    name: str
    optimizer: str
    right_lr: float
    max_epochs: int
    samples: int
    batch_size: int
    make_data: Callable[[Task, int, Path], L.LightningDataModule]
    make_model: Callable[[Task, float], L.LightningModule]
    schedule: str = "constant"

    def as_dict(self) -> dict[str, Any]:
        """The task's settings, for the JSON."""
        return {k: v for k, v in dataclasses.asdict(self).items() if not k.startswith("make_")}


def _tensors(build: Callable[[int, int], TensorDataset]) -> Callable[[Task, int, Path], L.LightningDataModule]:
    return lambda task, seed, root: TensorData(build(task.samples, seed), task.batch_size)


def _demo_data(task: Task, seed: int, root: Path) -> L.LightningDataModule:
    # The packed cache, as the demo's speedkit side uses: every variant reads the same one (built before any fit).
    return DemoDataModule(num_images=task.samples, batch_size=task.batch_size, seed=seed, root=root, cache=True)


def _mlp(task: Task, lr: float) -> L.LightningModule:
    net = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 4))
    return Classifier(net, task.optimizer, lr)


def _conv(task: Task, lr: float) -> L.LightningModule:
    net = nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(),
        nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(), nn.AdaptiveMaxPool2d(1), nn.Flatten(), nn.Linear(32, 4),
    )  # fmt: skip
    return Classifier(net, task.optimizer, lr)


def _conv_bn(task: Task, lr: float) -> L.LightningModule:
    """`_conv` with BatchNorm after every convolution (the shape of most vision nets trained with SGD)."""
    net = nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
        nn.Conv2d(32, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
        nn.AdaptiveMaxPool2d(1), nn.Flatten(), nn.Linear(32, 4),
    )  # fmt: skip
    return Classifier(net, task.optimizer, lr)


def _transformer(task: Task, lr: float) -> L.LightningModule:
    return Classifier(TextEncoder(hidden=32, layers=1, heads=4), task.optimizer, lr)


def _demo(task: Task, lr: float) -> L.LightningModule:
    return DemoClassifier(lr=lr, crop_size=DemoDataModule(num_images=task.samples).crop_size)  # the demo's defaults


TASKS: dict[str, Task] = {
    "mlp": Task("mlp", "sgd", 0.02, 6, 12000, 64, _tensors(teacher_data), _mlp),
    "conv": Task("conv", "adam", 3e-3, 6, 3000, 32, _tensors(pattern_data), _conv),
    "transformer": Task("transformer", "adamw", 1e-3, 7, 2500, 32, _tensors(text_data), _transformer),
    "demo": Task("demo", "adamw", 1e-3, 14, 1200, 32, _demo_data, _demo),
    "conv_bn": Task("conv_bn", "sgd", 3e-2, 6, 3000, 32, _tensors(pattern_data), _conv_bn),
}
"""The tasks. ``conv_bn`` came later, held out from the LR trials' rules: its right LR is the best mean peak of plain
fits at 0.003-1.0 over seeds 0-2 (0.03; 0.01 close behind, 0.1 far lower, 0.3 at chance)."""
QUICK_SIZES = {"mlp": (2, 400), "conv": (2, 400), "transformer": (1, 300), "demo": (1, 200), "conv_bn": (2, 400)}
"""``--quick``: (max_epochs, samples) of each task."""

# ---------------------------------------------------------------------------------------------- one fit


def _trainer(variant: str, device: str, options: dict[str, Any]) -> tuple[L.Trainer, str | bool | None]:
    """The Trainer of ``variant`` with ``options``, and the ``lr`` argument preset got (None for a plain one)."""
    if variant in ("naive", "naive_nudged", "grid"):
        return quiet_trainer(device, devices=1, **options), None
    fresh_decisions()  # nothing remembered from an earlier fit: every probe runs and is timed
    if variant == "preset":
        return speedkit.preset(verbose=False, **QUIET, **options), False
    if variant.startswith(WITHOUT):  # `lr_starts --without`: preset() with one of its levers off
        return speedkit.preset(verbose=False, **QUIET, **{variant.removeprefix(WITHOUT): False}, **options), False
    if variant in LR_FREE:  # no LR search: the optimizer sets its own step (Prodigy) or needs no schedule
        free = variant == "preset_schedulefree"
        callbacks = [*options.pop("callbacks", ()), *([_lr_free.ScheduleFreeModes()] if free else [])]
        trainer = speedkit.preset(verbose=False, warmup=not free, callbacks=callbacks, **QUIET, **options)
        return trainer, False
    average = variant in AVERAGE
    return speedkit.preset(lr="auto", average=average, verbose=False, **QUIET, **options), "auto"


def _decisions(trainer: L.Trainer) -> dict[str, Any]:
    """What preset's levers decided: ``trainer.speedkit.decisions()``, the LR finder's and the warmup's reports."""
    reports, _ = collect_reports(trainer.callbacks)  # type: ignore[attr-defined]
    finder = reports.get("LRFinder")
    keys = ("chosen_lr", "suggested_lr", "scale", "reason", "probe_s", "probed", "steps")
    return {
        "levers": trainer.speedkit.decisions(),  # type: ignore[attr-defined]
        "lr_finder": None if finder is None else {k: finder.get(k) for k in keys},
        "warmup": reports.get("WarmupScheduler"),
        "average": reports.get("WeightAverage"),
        "probe_s": {name: float(r["probe_s"]) for name, r in reports.items() if r.get("probe_s")},
    }


def _chosen_lr(lr: float, finder: Mapping[str, Any] | None) -> float:
    """The LR preset trained at (before its schedule): the LR finder's choice, else the user's ``lr``."""
    if finder is None:
        return lr
    chosen = finder.get("chosen_lr")
    return float(chosen) if chosen is not None else lr * float(finder.get("scale") or 1.0)


def fit_one(
    task: Task,
    variant: str,
    factor: float,
    seed: int,
    root: Path,
    device: str,
    show: bool = True,
    nudge: int = 1,
    callbacks: Sequence[L.Callback] = (),
    start_ulps: int = 0,
) -> dict[str, Any]:
    """Train ``task`` for its whole budget as ``variant`` at ``factor`` x its right LR; the run's record.

    The clock starts just before ``trainer.fit``, so set-up and every probe preset runs at fit start are counted.
    ``show`` prints a line when the fit ends; ``nudge``: the ulps ``naive_nudged`` moves the weights up by;
    ``callbacks`` are added to the fit's (`lr_decisions` stops it with one); ``start_ulps``: every variant's initial
    weights nudged up by that many ulps (`nudge_weights`: another rounding-level start, `lr_starts`), 0 for none.
    """
    data = task.make_data(task, seed, root)
    L.seed_everything(seed, verbose=False)  # the same initial weights and batch order for every variant
    lr = task.right_lr * factor
    model = with_schedule(task.make_model(task, lr), task.schedule)
    ulps = start_ulps + (nudge if variant == "naive_nudged" else 0)  # nudges add up: one nudge of their sum
    if ulps:
        nudge_weights(model, ulps)
    if variant in LR_FREE:
        _lr_free.swap_optimizer(model, variant)
    timeline = Timeline(verbose=False)
    options = {"max_epochs": task.max_epochs, "num_sanity_val_steps": 0, "default_root_dir": str(root / "fits")}
    trainer, lr_argument = _trainer(variant, device, {**options, "callbacks": [timeline, *callbacks]})
    seconds, points = timed_points(trainer, model, data, timeline)
    record: dict[str, Any] = {"task": task.name, "variant": variant, "factor": factor, "lr": lr, "seed": seed}
    record |= {"nudge_ulps": nudge} if variant == "naive_nudged" else {}
    record |= {"start_ulps": start_ulps} if start_ulps else {}
    record["timeline"] = points
    record |= {"peak_val_acc": peak_acc(points), "final_val_acc": points[-1]["val_acc"] if points else None}
    record |= {"fit_s": seconds, "steps": trainer.global_step}
    if lr_argument is not None:
        decisions = _decisions(trainer)
        finder = decisions["lr_finder"]
        record |= {"lr_argument": lr_argument, "decisions": decisions}
        record["chosen_lr"] = _chosen_lr(lr, finder)
    if variant in LR_FREE:
        record["optimizer"] = type(trainer.optimizers[0]).__name__
    if variant in ("preset_prodigy", "preset_dadapt"):  # the step size it estimated (its LR: 1.0 x the schedule)
        record["chosen_lr"] = None  # the user's LR is not used
        record[f"{variant.removeprefix('preset_')}_d"] = float(trainer.optimizers[0].param_groups[0]["d"])
    if show:
        peak = record["peak_val_acc"]
        print(
            f"  {task.name:<11} {variant:<11} x{factor:<5g} seed {seed}  {seconds:6.1f} s  peak {peak:.3f}", flush=True
        )
    return record


def _prepare(task: Task, seed: int, root: Path) -> None:
    """Make the data of ``task`` for ``seed`` (the demo: generate the images, pack the cache) outside any fit."""
    data = task.make_data(task, seed, root)
    data.prepare_data()
    data.setup("fit")


def _warm(task: Task, root: Path, device: str) -> None:
    """Two untimed one-epoch fits of ``task`` on `QUICK_SIZES`: first-call costs (imports, kernels) fall on them."""
    warm = dataclasses.replace(task, max_epochs=1, samples=QUICK_SIZES[task.name][1])
    _prepare(warm, 0, root)
    for variant in ("naive", "preset_auto"):
        fit_one(warm, variant, 1.0, 0, root, device, show=False)


def _score(run: dict[str, Any], target: float) -> dict[str, Any]:
    """Set ``run``'s ``time_to_target_s`` and ``reached`` for ``target``; ``run``."""
    run["time_to_target_s"] = time_to_target(run["timeline"], target)
    run["reached"] = run["time_to_target_s"] is not None
    return run


LATE = {"preset": "preset_later", "preset_auto": "auto_later"}
"""The variants a re-run checks, by the key of their lateness in a cell."""


def recheck_task(task: Task, summary: dict[str, Any], root: Path, device: str, repeats: int) -> list[dict[str, Any]]:
    """Fit each cell of ``summary`` in which a variant of `LATE` was late again, ``repeats`` times; the new runs.

    Each re-run fits naive, ``naive_nudged`` (re-run ``i`` nudged by ``i + 2`` ulps: another rounding-level start)
    and the late variants back to back (rotated order). The cell gets ``recheck`` (each variant's times to target)
    and, for each late variant, ``<key>_repeated`` (later than naive in every re-run too) and ``<key>_than_every``
    (its first time later than the slowest of every naive fit: the first run's two and the re-runs').
    """
    runs: list[dict[str, Any]] = []
    for cell in summary["cells"] if repeats > 0 else ():
        late = [v for v, key in LATE.items() if cell[key]]
        if not late:
            continue
        _prepare(task, cell["seed"], root)
        times: dict[str, list[float | None]] = {v: [] for v in ("naive", "naive_nudged", *late)}
        for index in range(repeats):
            for variant in rotated(list(times), index):
                run = fit_one(task, variant, cell["factor"], cell["seed"], root, device, nudge=index + 2)
                run = _score(run, summary["target"]) | {"recheck": index}
                times[variant].append(run["time_to_target_s"])
                runs.append(run)
        cell["recheck"] = {f"{v}_s": t for v, t in times.items()}
        naive = [cell["naive_s"], cell["naive_nudged_s"], *times["naive"], *times["naive_nudged"]]
        for v in late:
            cell[f"{LATE[v]}_repeated"] = all(later(n, t) for n, t in zip(times["naive"], times[v], strict=True))
            cell[f"{LATE[v]}_than_every"] = later_than_every(naive, cell[f"{v}_s"])
    return runs


def run_task(
    task: Task,
    factors: Sequence[float],
    grid: Sequence[float],
    seeds: Sequence[int],
    root: Path,
    device: str,
    variants: Sequence[str] = VARIANTS,
) -> list[dict[str, Any]]:
    """Every fit of ``task``, in order of running.

    Per seed: the variants of each user LR back to back in rotated order, then the grid LRs the naive fits do not
    cover (also rotated). The data is made (and the demo's cache packed) before the seed's first fit. Two untimed
    one-epoch fits on `QUICK_SIZES` come first, so first-call costs (imports, kernels) fall on no measured variant.
    """
    _warm(task, root, device)
    runs: list[dict[str, Any]] = []
    extra = [g for g in grid if g not in factors]
    for seed in seeds:
        _prepare(task, seed, root)
        for index, factor in enumerate(factors):
            for variant in rotated(variants, index + seed):
                runs.append(fit_one(task, variant, factor, seed, root, device))
        for g in rotated(extra, seed) if extra else ():
            runs.append(fit_one(task, "grid", g, seed, root, device))
    return runs


# ---------------------------------------------------------------------------------------------- the summary


def _find(runs: Sequence[Mapping[str, Any]], variant: str, factor: float, seed: int) -> Mapping[str, Any]:
    return next(r for r in runs if r["variant"] == variant and r["factor"] == factor and r["seed"] == seed)


def _grid_run(runs: Sequence[Mapping[str, Any]], factor: float, seed: int) -> Mapping[str, Any]:
    """The plain fit at ``factor`` x the right LR: a naive fit where there is one, else a grid fit."""
    return next(r for r in runs if r["variant"] in ("naive", "grid") and r["factor"] == factor and r["seed"] == seed)


def _finite(value: float | str) -> float | str | None:
    """A ratio for the JSON: rounded, ``"inf"`` for infinity, None for NaN; a string as it is."""
    if isinstance(value, str):
        return value
    return None if math.isnan(value) else "inf" if math.isinf(value) else round(value, 3)


def summarise_task(
    runs: list[dict[str, Any]], factors: Sequence[float], grid: Sequence[float], seeds: Sequence[int]
) -> dict[str, Any]:
    """Set every run's ``time_to_target_s`` and ``reached`` from the task's target; the task's summary."""
    peaks = {g: [_grid_run(runs, g, seed)["peak_val_acc"] for seed in seeds] for g in grid}
    best, target = task_target(peaks)
    for run in runs:
        _score(run, target)
    oracle = {seed: oracle_time(_grid_run(runs, g, seed)["time_to_target_s"] for g in grid) for seed in seeds}
    ran = {r["variant"] for r in runs}
    opt_in = [v for group in EXTRAS.values() for v in group if v in ran]
    present = [v for v in VARIANTS if v in ran] + opt_in
    cells = []
    for factor in factors:
        for seed in seeds:
            times = {v: _find(runs, v, factor, seed)["time_to_target_s"] for v in present}
            cell: dict[str, Any] = {"factor": factor, "label": FACTORS.get(factor, f"x{factor:g}"), "seed": seed}
            cell |= {f"{v}_s": t for v, t in times.items()} | {"oracle_s": oracle[seed]}
            cell |= {"preset_vs_naive": _finite(speedup(times["naive"], times["preset"]))}
            cell |= {"auto_vs_naive": _finite(speedup(times["naive"], times["preset_auto"]))}
            cell |= {"preset_later": later(times["naive"], times["preset"])}
            cell |= {"auto_later": later(times["naive"], times["preset_auto"])}
            both = times["naive"], times["naive_nudged"]
            cell |= {"preset_later_than_both": later_than_every(both, times["preset"])}
            cell |= {"auto_later_than_both": later_than_every(both, times["preset_auto"])}
            cell |= {"auto_over_oracle": over(times["preset_auto"], oracle[seed])}
            for v in opt_in:
                cell |= {f"{v}_later": later(times["naive"], times[v])}
                cell |= {f"{v}_later_than_both": later_than_every(both, times[v])}
                cell |= {f"{v}_over_oracle": over(times[v], oracle[seed])}
            cells.append(cell)
    auto_over_oracle = statistics.median(c.pop("auto_over_oracle") for c in cells)
    over_oracle = {v: statistics.median(c.pop(f"{v}_over_oracle") for c in cells) for v in opt_in}
    return {
        "target": target,
        "best_grid_factor": best,
        "grid_peak_val_acc": {str(g): values for g, values in peaks.items()},
        "oracle_s": {str(seed): t for seed, t in oracle.items()},
        "auto_over_oracle_median": auto_over_oracle,
        **({"over_oracle_median": over_oracle} if over_oracle else {}),
        "cells": cells,
    }


def summarise(tasks: Mapping[str, dict[str, Any]]) -> dict[str, Any]:
    """The counts over every (task, user LR, seed) cell and the median over tasks of (auto time / oracle time).

    A count is of the cells where a preset variant reached the target later than naive by more than `NOISE` (a miss
    is infinitely late); the ``..._than_both`` counts, later than the slower of the two naive fits by more than it.
    """
    cells = [cell for task in tasks.values() for cell in task["cells"]]
    ratios = [task["auto_over_oracle_median"] for task in tasks.values()]
    finite = [r for r in ratios if not math.isnan(r)]
    extras: dict[str, dict[str, Any]] = {}
    for key, group in EXTRAS.items():
        for v in (v for v in group if f"{v}_later" in cells[0]):
            medians = [task["over_oracle_median"][v] for task in tasks.values()]
            extras.setdefault(key, {})[v] = {
                "later_than_naive": sum(c[f"{v}_later"] for c in cells),
                "later_than_both_naive_fits": sum(c[f"{v}_later_than_both"] for c in cells),
                "later_than_preset_auto": sum(later(c["preset_auto_s"], c[f"{v}_s"]) for c in cells),
                "over_oracle_median_over_tasks": _median([m for m in medians if not math.isnan(m)]),
            }
    return {
        **extras,
        "cells": len(cells),
        "noise_allowance": NOISE,
        "preset_later_than_naive": sum(c["preset_later"] for c in cells),
        "auto_later_than_naive": sum(c["auto_later"] for c in cells),
        "preset_later_than_both_naive_fits": sum(c["preset_later_than_both"] for c in cells),
        "auto_later_than_both_naive_fits": sum(c["auto_later_than_both"] for c in cells),
        "auto_over_oracle_median_over_tasks": _median(finite),
        **(_rechecked(cells) if any("recheck" in c for c in cells) else {}),
    }


def _rechecked(cells: Sequence[Mapping[str, Any]]) -> dict[str, int]:
    """Per `LATE` key: the cells late again in every re-run (``_repeated``); those also later than every naive fit."""
    counts: dict[str, int] = {}
    for key in LATE.values():
        repeated = [c for c in cells if c.get(f"{key}_repeated")]
        counts[f"{key}_repeated"] = len(repeated)
        counts[f"{key}_beyond_noise"] = sum(bool(c.get(f"{key}_than_every")) for c in repeated)
    return counts


def _median(values: Sequence[float]) -> float | str | None:
    """The median of ``values`` for the JSON (`_finite`), None when there is none."""
    return _finite(statistics.median(values)) if values else None


def _shown(seconds: float | None) -> str:
    return "miss" if seconds is None else f"{seconds:.2f}"


def _ratio_shown(value: float | str | None) -> str:
    if isinstance(value, float):
        return f"{value:.2f}x"
    return {"naive missed": "inf", "both missed": "both miss"}.get(str(value), str(value))


COLUMNS = [
    Column("task", 12, "task", align="<"),
    Column("user LR", 10, "label", align="<"),
    Column("seed", 5, "seed"),
    *(Column(header, 8, header) for header in ("naive", "nudged", "preset", "auto", "oracle")),
    Column("auto LR", 10, "auto_lr", ".2g"),
    Column("preset/n", 10, "preset/n"),
    Column("auto/n", 10, "auto/n"),
]
"""Seconds to target of each variant (``nudged``: the naive fit from weights one ulp up) and the oracle (``miss``),
the LR preset_auto trained at, the speed-ups."""


def _row(task: str, cell: Mapping[str, Any], auto: Mapping[str, Any]) -> dict[str, Any]:
    """The table row of ``cell`` of ``task``; ``auto`` is the cell's preset_auto run."""
    row = {"task": task, "label": cell["label"], "seed": cell["seed"], "auto_lr": auto.get("chosen_lr")}
    row |= {"naive": _shown(cell["naive_s"]), "preset": _shown(cell["preset_s"]), "auto": _shown(cell["preset_auto_s"])}
    row |= {"nudged": _shown(cell["naive_nudged_s"])}
    row |= {"oracle": _shown(cell["oracle_s"]), "preset/n": _ratio_shown(cell["preset_vs_naive"])}
    return row | {"auto/n": _ratio_shown(cell["auto_vs_naive"])}


def format_tables(tasks: Mapping[str, Any], runs: Sequence[Mapping[str, Any]], summary: Mapping[str, Any]) -> str:
    """Each task's target, one row per (task, user LR, seed) cell, then the counts over all cells."""
    lines = [
        f"{name}: target val_acc {t['target']:.3f} (best grid LR x{t['best_grid_factor']:g})"
        for name, t in tasks.items()
    ]
    rows = []
    for name, task in tasks.items():
        own = [r for r in runs if r["task"] == name]
        rows += [_row(name, c, _find(own, "preset_auto", c["factor"], c["seed"])) for c in task["cells"]]
    lines += ["", table(COLUMNS, rows, rule=True), ""]
    counts = f"preset {summary['preset_later_than_naive']}, preset_auto {summary['auto_later_than_naive']}"
    lines.append(f"cells later than naive by > {NOISE:.0%}, of {summary['cells']}: {counts}")
    both = summary["preset_later_than_both_naive_fits"], summary["auto_later_than_both_naive_fits"]
    lines.append(f"cells later than both naive fits by > {NOISE:.0%}: preset {both[0]}, preset_auto {both[1]}")
    lines.append(f"median over tasks of auto time / oracle time: {summary['auto_over_oracle_median_over_tasks']}")
    if "preset_later_repeated" in summary:
        again = f"preset {summary['preset_later_repeated']}, preset_auto {summary['auto_later_repeated']}"
        lines.append(f"of those later than naive, later again in every re-run: {again}")
        beyond = f"preset {summary['preset_later_beyond_noise']}, preset_auto {summary['auto_later_beyond_noise']}"
        lines.append(f"later in every re-run and than every naive fit (beyond the benchmark's noise): {beyond}")
    for variant, counts in ((v, c) for key in EXTRAS for v, c in summary.get(key, {}).items()):
        lines.append(
            f"{variant}: later than naive {counts['later_than_naive']}, than both naive fits"
            f" {counts['later_than_both_naive_fits']}, than preset_auto {counts['later_than_preset_auto']};"
            f" median over tasks of its time / oracle time {counts['over_oracle_median_over_tasks']}"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- the run


def run_settings(
    quick: bool,
    names: Sequence[str],
    seeds: Sequence[int],
    lr_free: bool = False,
    average: bool = False,
    schedule: str = "constant",
) -> tuple[dict[str, Task], dict[str, Any]]:
    """The tasks to run (``--quick``: `QUICK_SIZES`; ``schedule``: the user's) and the run's settings (factors...)."""
    tasks = {name: dataclasses.replace(TASKS[name], schedule=schedule) for name in names}
    if quick:
        tasks = {
            n: dataclasses.replace(t, max_epochs=QUICK_SIZES[n][0], samples=QUICK_SIZES[n][1]) for n, t in tasks.items()
        }
    factors, grid = (QUICK_FACTORS, QUICK_GRID) if quick else (tuple(FACTORS), GRID)
    settings = {"quick": quick, "schedule": schedule, "tasks": {n: t.as_dict() for n, t in tasks.items()}}
    settings |= {
        "factors": {str(f): FACTORS[f] for f in factors},
        "grid": list(grid),
        "seeds": [0] if quick else list(seeds),
    }
    variants = [*VARIANTS, *(LR_FREE if lr_free else ()), *(AVERAGE if average else ())]
    settings |= {"variants": variants, "margin": MARGIN, "noise_allowance": NOISE}
    settings |= {"device": "cuda" if torch.cuda.is_available() else "cpu", "torch_threads": torch.get_num_threads()}
    return tasks, settings


def out_path(out: str | Path | None, quick: bool) -> Path:
    """Where the JSON goes: ``out``; else `DEFAULT_OUT`, or with ``quick`` a new temp dir (never the committed file)."""
    if out is not None:
        return Path(out)
    return Path(tempfile.mkdtemp(prefix="speedkit-lr-tasks-quick-")) / "lr_tasks.json" if quick else DEFAULT_OUT


def run(
    quick: bool = False,
    tasks: Sequence[str] = tuple(TASKS),
    seeds: Sequence[int] = SEEDS,
    out: str | Path | None = None,
    threads: int | None = None,
    lr_free: bool = False,
    average: bool = False,
    recheck: int = 0,
    schedule: str = "constant",
) -> dict[str, Any]:
    """Fit every task, variant, user LR and seed, summarise, print the tables and write the JSON to ``out``.

    ``quick``: tiny budgets, seed 0 only, user LRs 0.1x and 1x, grid 1x; without ``out`` the JSON goes to a temp dir
    (never over the committed result). ``threads``: torch's intra-op threads during the run (None: torch's default).
    ``lr_free``: every cell also runs `LR_FREE`'s variants; ``average``: `AVERAGE`'s. ``recheck``: re-runs of each
    cell a preset variant was late in (`recheck_task`). ``schedule``: the user's LR schedule in every fit (`SCHEDULES`).
    """
    with torch_threads(threads):
        return _run(quick, tasks, seeds, out, lr_free, average, recheck, schedule)


def recheck_file(
    path: str | Path, repeats: int, out: str | Path | None = None, threads: int | None = None
) -> dict[str, Any]:
    """`recheck_task` on every task of the result at ``path``; the result, with its summary again, to ``out`` (or back).

    Each task is warmed up first (`_warm`), as the first run was; the re-runs are in ``rechecks``. ``threads``: None
    for the first run's. A result re-checked already is refused (its re-runs would mix with these).
    """
    result: dict[str, Any] = json.loads(Path(path).read_text())
    if result.get("rechecks") or result["config"].get("recheck"):
        raise ValueError(
            f"{path} was re-checked already ({result['config'].get('recheck')} re-runs): re-check the first"
        )
    threads = threads or result["config"].get("torch_threads")
    with (
        tempfile.TemporaryDirectory(prefix="speedkit-lr-tasks-", ignore_cleanup_errors=True) as tmp,
        torch_threads(threads),
    ):
        root, device = Path(tmp), result["config"]["device"]
        result["rechecks"] = []
        for name, summary in result["tasks"].items():
            task = dataclasses.replace(TASKS[name], **result["config"]["tasks"][name])
            _warm(task, root, device)
            result["rechecks"] += recheck_task(task, summary, root, device, repeats)
            _ratios(summary, _number)
        result["summary"] = summarise(result["tasks"])
        for summary in result["tasks"].values():
            _ratios(summary, _finite)
        result["config"]["recheck"] = repeats
        print_and_write(format_tables(result["tasks"], result["runs"], result["summary"]), result, out or path)
    return result


def _ratios(summary: dict[str, Any], convert: Callable[[Any], Any]) -> None:
    """Apply ``convert`` to a task summary's time-over-oracle medians (preset_auto's and each opt-in variant's)."""
    summary["auto_over_oracle_median"] = convert(summary["auto_over_oracle_median"])
    for variant, ratio in summary.get("over_oracle_median", {}).items():
        summary["over_oracle_median"][variant] = convert(ratio)


def _number(value: float | str | None) -> float:
    """A ratio back from the JSON (`_finite`'s inverse): ``"inf"`` to infinity, None to NaN."""
    return math.nan if value is None else float(value)


def _run(
    quick: bool,
    tasks: Sequence[str],
    seeds: Sequence[int],
    out: str | Path | None,
    lr_free: bool,
    average: bool,
    recheck: int = 0,
    schedule: str = "constant",
) -> dict[str, Any]:
    """`run` at the threads set."""
    chosen, settings = run_settings(quick, tasks, seeds, lr_free, average, schedule)
    settings["recheck"] = recheck
    factors, grid, seeds = [float(f) for f in settings["factors"]], settings["grid"], settings["seeds"]
    out = out_path(out, quick)
    root = Path(tempfile.mkdtemp(prefix="speedkit-lr-tasks-"))  # the demo's images and the fits' files
    load_before, started = os.getloadavg(), time.perf_counter()
    runs: list[dict[str, Any]] = []
    summaries: dict[str, dict[str, Any]] = {}
    for name, task in chosen.items():
        task_runs = run_task(task, factors, grid, seeds, root, settings["device"], settings["variants"])
        summaries[name] = summarise_task(task_runs, factors, grid, seeds)
        runs += task_runs
    rechecks = [r for n, t in chosen.items() for r in recheck_task(t, summaries[n], root, settings["device"], recheck)]
    summary = summarise(summaries)
    for task_summary in summaries.values():
        _ratios(task_summary, _finite)
    result: dict[str, Any] = {"config": settings, **machine_and_load(load_before)}
    result |= {"wall_s": time.perf_counter() - started, "runs": runs, "tasks": summaries, "summary": summary}
    result |= {"rechecks": rechecks} if recheck else {}
    print_and_write(format_tables(summaries, runs, summary), result, out)
    shutil.rmtree(root, ignore_errors=True)
    return result


def task_names(parser: argparse.ArgumentParser, text: str) -> list[str]:
    """The `TASKS` named by a comma-separated ``--tasks``, or a parser error naming the option and the value."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names or any(name not in TASKS for name in names):
        parser.error(f"--tasks must name some of {', '.join(TASKS)}, got {text!r}")
    return names


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny budgets, seed 0, two user LRs: a smoke run")
    parser.add_argument("--tasks", default=",".join(TASKS), help=f"comma-separated, of {', '.join(TASKS)}")
    parser.add_argument("--seeds", default=",".join(map(str, SEEDS)), help="e.g. 0,1,2 or 0-4 (--quick: 0)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (1 on a busy shared machine)")
    parser.add_argument("--out", default=None, help=f"the JSON (default {DEFAULT_OUT}; with --quick a temp dir)")
    parser.add_argument("--lr-free", action="store_true", help=f"also run {', '.join(LR_FREE)} in every cell")
    parser.add_argument("--average", action="store_true", help=f"also run {', '.join(AVERAGE)} in every cell")
    parser.add_argument(
        "--recheck", type=int, default=0, help="re-runs of each cell preset or preset_auto was late in (not opt-ins)"
    )
    parser.add_argument("--recheck-from", default=None, help="a result JSON to re-run the late cells of (--recheck N)")
    parser.add_argument(
        "--schedule", choices=SCHEDULES, default="constant", help="the user's own LR schedule in every fit, per step"
    )
    args = parser.parse_args(argv)
    if args.recheck < 0 or (args.recheck_from and args.recheck < 1):
        parser.error(f"--recheck must be at least 1 with --recheck-from and never negative, got {args.recheck}")
    given = ("quick", "lr_free", "average", "tasks", "seeds", "schedule")
    chosen = [f"--{name.replace('_', '-')}" for name in given if getattr(args, name) != parser.get_default(name)]
    if args.recheck_from and chosen:
        parser.error(f"--recheck-from re-runs the file's own cells; {', '.join(chosen)} cannot change them")
    if args.lr_free and args.schedule != "constant":
        parser.error(
            f"--lr-free swaps the optimizer a schedule is built on; it runs with no --schedule, got {args.schedule}"
        )
    tasks = task_names(parser, args.tasks)
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)  # no device banner for each of ~170 fits
    if args.recheck_from:
        return recheck_file(args.recheck_from, args.recheck, args.out, args.threads)
    seeds = parse_seeds(args.seeds)
    options = {"lr_free": args.lr_free, "average": args.average, "recheck": args.recheck, "schedule": args.schedule}
    return run(quick=args.quick, tasks=tasks, seeds=seeds, out=args.out, threads=args.threads, **options)


if __name__ == "__main__":
    main()
