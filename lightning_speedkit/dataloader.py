"""DataLoaderTuner: measure the train loader under candidate settings at fit start, keep the fastest."""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch.utils.data import BatchSampler, DataLoader, IterableDataset
from typing_extensions import override

from lightning_speedkit.batch import batch_size_of
from lightning_speedkit.hardware import cpu_info
from lightning_speedkit.timing import StepTimer

log = logging.getLogger(__name__)

__all__ = [
    "DataLoaderTuner",
    "NotRebuildableError",
    "choose_fastest",
    "default_candidates",
    "probe_loader",
    "rebuild_dataloader",
]

_SETTINGS = ("num_workers", "persistent_workers", "prefetch_factor", "pin_memory")
_HOOKS = ("train_dataloader", "val_dataloader")
_Owner = pl.LightningModule | pl.LightningDataModule


class NotRebuildableError(ValueError):
    """A DataLoader that cannot be rebuilt with other settings without changing what it yields."""


def default_candidates(max_workers: int, pin_memory: bool = False) -> list[dict[str, Any]]:
    """Candidate settings: ``num_workers`` 0, 1, 2, 4, ... up to ``max_workers`` (always included).

    Workers are persistent (no start-up cost each epoch) with ``prefetch_factor=2``; `DataLoaderTuner` also tries
    ``prefetch_factor=4`` for the best worker count.

    Example:
        >>> [c["num_workers"] for c in default_candidates(6)]
        [0, 1, 2, 4, 6]
        >>> default_candidates(0)
        [{'num_workers': 0, 'persistent_workers': False, 'prefetch_factor': None, 'pin_memory': False}]
    """
    if max_workers < 0:
        raise ValueError(f"`max_workers` must be >= 0, got {max_workers}.")
    counts = [0] + [2**k for k in range(max_workers.bit_length()) if 2**k < max_workers] + [max_workers]
    return [_settings(w, 2, pin_memory) for w in sorted(set(counts))]


def _settings(num_workers: int, prefetch_factor: int, pin_memory: bool) -> dict[str, Any]:
    return {
        "num_workers": num_workers,
        "persistent_workers": num_workers > 0,
        "prefetch_factor": prefetch_factor if num_workers > 0 else None,
        "pin_memory": pin_memory,
    }


def choose_fastest(results: Sequence[dict[str, Any]], tolerance: float = 0.05) -> dict[str, Any]:
    """The candidate with the fewest workers whose throughput is within ``tolerance`` of the best.

    Fewer workers cost less memory and leave more cores to the model, so a near-tie goes to the smaller setting.

    Example:
        >>> choose_fastest([{"num_workers": 0, "batches_per_s": 50.0}, {"num_workers": 2, "batches_per_s": 100.0},
        ...                 {"num_workers": 4, "batches_per_s": 103.0}])["num_workers"]
        2
    """
    if not results:
        raise ValueError("`results` must hold at least one measured candidate, got none.")
    best = max(r["batches_per_s"] for r in results)
    near = [r for r in results if r["batches_per_s"] >= (1.0 - tolerance) * best]
    return min(near, key=lambda r: (r["num_workers"], -r["batches_per_s"]))


def rebuild_dataloader(loader: DataLoader[Any], settings: dict[str, Any]) -> DataLoader[Any]:
    """A new DataLoader like ``loader`` (dataset, sampler, batch size, collate_fn, ...) with other worker settings.

    Raises:
        NotRebuildableError: For a DataLoader subclass (its extra behaviour would be lost) or an IterableDataset
            with workers (each worker would yield the whole dataset unless it shards itself).

    Example:
        >>> loader = DataLoader(list(range(10)), batch_size=4, shuffle=True, drop_last=True)
        >>> new = rebuild_dataloader(loader, {"num_workers": 2, "persistent_workers": True, "prefetch_factor": 4})
        >>> new.num_workers, new.batch_size, new.drop_last, new.sampler is loader.sampler
        (2, 4, True, True)
    """
    if type(loader) is not DataLoader:
        raise NotRebuildableError(f"{type(loader).__name__} is a DataLoader subclass; rebuilding it would lose it.")
    workers = int(settings.get("num_workers", loader.num_workers))
    if isinstance(loader.dataset, IterableDataset) and workers > 0:
        raise NotRebuildableError(
            f"{type(loader.dataset).__name__} is an IterableDataset: with workers each one would yield every sample"
            " unless the dataset shards itself by worker."
        )
    kwargs: dict[str, Any] = {
        "collate_fn": loader.collate_fn,
        "timeout": loader.timeout,
        "worker_init_fn": loader.worker_init_fn,
        "multiprocessing_context": loader.multiprocessing_context,
        "generator": loader.generator,
        "pin_memory": bool(settings.get("pin_memory", loader.pin_memory)),
        "pin_memory_device": loader.pin_memory_device,
        "num_workers": workers,
    }
    if hasattr(loader, "in_order"):
        kwargs["in_order"] = loader.in_order
    if workers > 0:
        kwargs["persistent_workers"] = bool(settings.get("persistent_workers", loader.persistent_workers))
        kwargs["prefetch_factor"] = settings.get("prefetch_factor") or 2
    if isinstance(loader.dataset, IterableDataset):
        return DataLoader(loader.dataset, batch_size=loader.batch_size, drop_last=loader.drop_last, **kwargs)
    if loader.batch_size is not None and type(loader.batch_sampler) is BatchSampler:
        return DataLoader(
            loader.dataset, batch_size=loader.batch_size, sampler=loader.sampler, drop_last=loader.drop_last, **kwargs
        )
    return DataLoader(loader.dataset, batch_sampler=loader.batch_sampler, **kwargs)


@contextmanager
def _rng_preserved(loader: DataLoader[Any]) -> Iterator[None]:
    """Restore the global RNGs and the loader's own generators afterwards: a probe must not reorder training."""
    generators = {
        id(g): g
        for g in (loader.generator, getattr(loader.sampler, "generator", None))
        if isinstance(g, torch.Generator)
    }
    states = {key: g.get_state() for key, g in generators.items()}
    torch_state, np_state, py_state = torch.get_rng_state(), np.random.get_state(), random.getstate()
    try:
        yield
    finally:
        torch.set_rng_state(torch_state)
        np.random.set_state(np_state)
        random.setstate(py_state)
        for key, g in generators.items():
            g.set_state(states[key])


def probe_loader(loader: DataLoader[Any], batches: int = 20, warmup: int = 2) -> dict[str, float]:
    """Measure a loader on a fresh iterator: start-up seconds, then batches/s over ``batches`` batches.

    The global RNGs and the loader's generators are restored afterwards, so the training epoch that follows sees
    the same order and augmentation as without the probe. Timing goes through `~lightning_speedkit.timing.StepTimer`
    (each fetch is a data wait), the same path the UtilizationMonitor measures training steps with.

    Example:
        >>> result = probe_loader(DataLoader(list(range(64)), batch_size=8), batches=4)
        >>> sorted(result), result["batches"]
        (['batches', 'batches_per_s', 'samples_per_s', 'startup_s'], 4.0)
    """
    if batches < 1 or warmup < 0:
        raise ValueError(f"`batches` must be >= 1 and `warmup` >= 0, got batches={batches}, warmup={warmup}.")
    timer = StepTimer(window=batches)
    with _rng_preserved(loader):
        start = time.perf_counter()
        iterator = iter(loader)
        try:
            for _ in range(warmup):
                next(iterator)
            startup_s = time.perf_counter() - start
            timer.mark()
            for _ in range(batches):
                batch = next(iterator)
                timer.step_start(samples=batch_size_of(batch) or 0)
                timer.step_end()
        except StopIteration:
            startup_s = time.perf_counter() - start if timer.started == 0 else startup_s
        finally:
            del iterator  # shuts its workers down
    stats = timer.window_stats()
    return {
        "startup_s": startup_s,
        "batches": float(stats.steps),
        "batches_per_s": stats.steps_per_second,
        "samples_per_s": stats.samples_per_second,
    }


class DataLoaderTuner(Callback):
    """Measure the train dataloader under candidate settings at fit start; rebuild train and val with the fastest.

    At ``on_fit_start`` rank zero probes the train loader (``probe_batches`` batches on a fresh iterator per
    candidate, with the RNGs restored afterwards, so the training epoch is neither consumed nor reordered), picks the
    candidate with the fewest workers within ``tolerance`` of the best throughput, and broadcasts the choice. The
    ``train_dataloader``/``val_dataloader`` hooks of the LightningDataModule (or LightningModule) then return the
    same loaders rebuilt with those settings: sampler, batch size, ``collate_fn``, ``drop_last`` and everything else
    are kept. The hooks are restored at teardown. The choice is in ``state_dict``: a resumed run does not probe.

    A loader that cannot be rebuilt safely (a DataLoader subclass, an IterableDataset with workers) or loaders
    passed straight to ``fit()`` are left alone, with one line saying why.

    Args:
        candidates: Settings to try (dicts with ``num_workers``, ``persistent_workers``, ``prefetch_factor``,
            ``pin_memory``); default: `default_candidates` up to ``max_workers``, then ``prefetch_factor=4`` for the
            best worker count.
        probe_batches: Batches timed per candidate, after ``warmup_batches`` untimed ones.
        max_workers: Most workers tried; default: the cores available to this process divided by the processes of
            this node (DDP local ranks).
        warmup_batches: Untimed batches per candidate (worker start-up).
        tolerance: Relative throughput within which fewer workers win.

    Raises:
        ValueError: For a non-positive ``probe_batches``, negative ``max_workers``/``warmup_batches``, a
            ``tolerance`` outside [0, 1) or a candidate with an unknown key or negative ``num_workers``.

    Logged metrics: ``speedkit/data/num_workers``, ``speedkit/data/batches_per_s`` (the chosen candidate's probe)
    and ``speedkit/data/speedup`` (over the loader's original settings).

    Example:
        >>> import lightning as L
        >>> trainer = L.Trainer(logger=False, callbacks=[DataLoaderTuner(probe_batches=10)])
    """

    def __init__(
        self,
        candidates: Sequence[dict[str, Any]] | None = None,
        probe_batches: int = 20,
        max_workers: int | None = None,
        warmup_batches: int = 2,
        tolerance: float = 0.05,
    ) -> None:
        if not isinstance(probe_batches, int) or probe_batches < 1:
            raise ValueError(f"`probe_batches` must be a positive int, got {probe_batches!r}.")
        if max_workers is not None and (not isinstance(max_workers, int) or max_workers < 0):
            raise ValueError(f"`max_workers` must be an int >= 0 or None, got {max_workers!r}.")
        if not isinstance(warmup_batches, int) or warmup_batches < 0:
            raise ValueError(f"`warmup_batches` must be an int >= 0, got {warmup_batches!r}.")
        if not isinstance(tolerance, (int, float)) or not 0.0 <= tolerance < 1.0:
            raise ValueError(f"`tolerance` must be in [0, 1), got {tolerance!r}.")
        for candidate in candidates or ():
            unknown = set(candidate) - set(_SETTINGS) if isinstance(candidate, dict) else {"?"}
            workers = candidate.get("num_workers", 0) if not unknown else 0
            if unknown or not isinstance(workers, int) or workers < 0:
                raise ValueError(
                    f"`candidates` entries take keys {', '.join(_SETTINGS)} with num_workers >= 0, got {candidate!r}."
                )
        self.candidates = [dict(c) for c in candidates] if candidates is not None else None
        self.probe_batches = probe_batches
        self.max_workers = max_workers
        self.warmup_batches = warmup_batches
        self.tolerance = tolerance
        self._report: dict[str, Any] = {}
        self._patched: list[tuple[_Owner, str]] = []

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(probe_batches=self.probe_batches, max_workers=self.max_workers)

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        owner = self._owner(trainer, pl_module)
        if owner is None:
            return
        if not self._report.get("chosen"):
            report = self._measure(trainer, owner) if trainer.is_global_zero else {}
            self._report = trainer.strategy.broadcast(report, src=0)
        chosen = self._report.get("chosen")
        if not chosen:
            return
        for hook in _HOOKS:
            if is_overridden(hook, owner):
                self._patch(owner, hook, chosen)
        for logger in trainer.loggers if trainer.is_global_zero else ():
            logger.log_metrics(
                {
                    "speedkit/data/num_workers": float(chosen["num_workers"]),
                    "speedkit/data/batches_per_s": float(self._report["chosen_batches_per_s"]),
                    "speedkit/data/speedup": float(self._report["speedup"]),
                },
                step=trainer.global_step,
            )

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        for owner, hook in self._patched:
            vars(owner).pop(hook, None)
        self._patched = []

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"report": self._report}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._report = dict(state_dict.get("report") or {})

    def report(self) -> dict[str, Any]:
        """What the tuner measured and chose, as a plain dict.

        Keys: ``chosen`` (the settings), ``candidates`` (each with its measured throughput), ``baseline`` (the
        loader's own settings, measured), ``speedup`` and ``left_alone`` (why a loader was not rebuilt, if so).
        """
        return dict(self._report)

    def _owner(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> _Owner | None:
        source = getattr(trainer.fit_loop, "_data_source", None)
        instance = getattr(source, "instance", None)
        if isinstance(instance, (pl.LightningModule, pl.LightningDataModule)):
            return instance
        reason = "dataloaders were passed straight to fit(); return them from a LightningDataModule to tune them"
        self._left_alone(reason)
        return None

    def _measure(self, trainer: pl.Trainer, owner: _Owner) -> dict[str, Any]:
        loader = owner.train_dataloader()
        if not isinstance(loader, DataLoader):
            self._left_alone(f"train_dataloader() returned a {type(loader).__name__}, not a DataLoader")
            return {}
        max_workers = self.max_workers
        if max_workers is None:
            max_workers = max(0, cpu_info().available_cores // max(1, trainer.num_devices))
        use_pin = trainer.strategy.root_device.type == "cuda"
        candidates = self.candidates or default_candidates(max_workers, pin_memory=use_pin)
        try:
            results = [self._probe(loader, c) for c in candidates]
        except NotRebuildableError as error:
            self._left_alone(str(error))
            return {}
        if self.candidates is None and (best := choose_fastest(results, self.tolerance))["num_workers"] > 0:
            results.append(self._probe(loader, _settings(best["num_workers"], 4, use_pin)))
        chosen = choose_fastest(results, self.tolerance)
        baseline = self._probe(loader, {name: getattr(loader, name) for name in _SETTINGS})
        report = {
            "chosen": {name: chosen[name] for name in _SETTINGS},
            "chosen_batches_per_s": chosen["batches_per_s"],
            "candidates": results,
            "baseline": baseline,
            "speedup": chosen["batches_per_s"] / baseline["batches_per_s"] if baseline["batches_per_s"] else 1.0,
            "max_workers": max_workers,
        }
        rank_zero_info(self._table(report))
        return report

    def _probe(self, loader: DataLoader[Any], settings: dict[str, Any]) -> dict[str, Any]:
        full = {name: settings.get(name, getattr(loader, name)) for name in _SETTINGS}
        if full["num_workers"] == 0:
            full.update(persistent_workers=False, prefetch_factor=None)
        measured = probe_loader(rebuild_dataloader(loader, full), self.probe_batches, self.warmup_batches)
        return {**full, **measured}

    def _patch(self, owner: _Owner, hook: str, settings: dict[str, Any]) -> None:
        original: Callable[[], Any] = getattr(type(owner), hook).__get__(owner)

        def tuned() -> Any:
            loader = original()
            try:
                return rebuild_dataloader(loader, settings) if isinstance(loader, DataLoader) else loader
            except NotRebuildableError as error:
                self._left_alone(f"{hook}: {error}")
                return loader

        setattr(owner, hook, tuned)
        self._patched.append((owner, hook))

    def _left_alone(self, reason: str) -> None:
        if reason not in self._report.get("left_alone", []):
            self._report.setdefault("left_alone", []).append(reason)
            rank_zero_warn(f"DataLoaderTuner: leaving the dataloaders alone: {reason}.")

    @staticmethod
    def _table(report: dict[str, Any]) -> str:
        chosen = report["chosen"]
        rows = [(report["baseline"], "  (original)")]
        for row in report["candidates"]:
            rows.append((row, "  <- chosen" if all(row[n] == chosen[n] for n in _SETTINGS) else ""))
        labels = [", ".join(f"{name}={row[name]}" for name in _SETTINGS) for row, _ in rows]
        width = max(len(label) for label in labels)
        lines = ["DataLoaderTuner: measured the train dataloader", f"  {'settings':<{width}} {'batches/s':>10}"]
        for label, (row, mark) in zip(labels, rows, strict=True):
            lines.append(f"  {label:<{width}} {row['batches_per_s']:>10.1f}{mark}")
        lines.append(f"  speed-up over the original settings: {report['speedup']:.2f}x")
        return "\n".join(lines)
