"""DataLoaderTuner: time real training steps under candidate loader settings at fit start; keep a clear winner."""

from __future__ import annotations

import logging
import statistics
from collections.abc import Sequence
from typing import Any, ClassVar

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.seed import isolate_rng
from torch.utils.data import DataLoader, IterableDataset
from typing_extensions import override

from lightning_speedkit.checks import check_bool, check_int, check_margin, check_probe_steps
from lightning_speedkit.data.batched import fetches_at_once
from lightning_speedkit.data.streaming import is_streaming_loader
from lightning_speedkit.dataloader.counted import (
    CountedBlock,
    CountedLoader,
    LiveSettings,
    LoaderTrials,
    worth_trying,
)
from lightning_speedkit.dataloader.rebuild import (
    BATCHED,
    SETTINGS,
    LoaderSettings,
    NotRebuildableError,
    Owner,
    complete_settings,
    default_candidates,
    loader_settings,
    rebuild_dataloader,
    settings_name,
    slower_workers,
    valid_candidate,
)
from lightning_speedkit.dataloader.streaming import streaming_candidates, streaming_settings, untuned_settings
from lightning_speedkit.hardware import cpu_info
from lightning_speedkit.restore import ListOf, StateSpec
from lightning_speedkit.trials import PROBE_ROUNDS, AsIs, Decision, LeaveOut, Lever, Setting, TrialResult
from lightning_speedkit.trials.counted import COUNTED_ROUNDS, CountedTrials, queued_steps
from lightning_speedkit.trials.loaders import forget_peeks, generators_kept

log = logging.getLogger(__name__)

__all__ = ["DataLoaderTuner"]

_HOOKS = ("train_dataloader", "val_dataloader")
_MIN_BLOCK = 4  # two untimed steps (workers start), two timed
_NOT_BATCHED = "the train loader's dataset is not a TensorDataset (or a Subset of one) collated by default_collate"
_AS_IS = "as is"


class DataLoaderTuner(Lever):
    """Time real training steps under candidate loader settings at fit start; rebuild the loaders with a clear winner.

    At ``on_fit_start`` every rank runs, through `~lightning_speedkit.trials.measure`, trials of ``probe_steps`` real
    training steps with the train loader as the user built it and with each candidate, in interleaved rounds (model,
    optimizers, loops and RNGs restored after each, so the fit that follows is the fit without the probe). Data loading,
    the step and any competition between worker processes and the step for the same cores are all in those times. A
    candidate is kept only when its median step time beats the loader's own by ``margin``; then the ``train_dataloader``
    and ``val_dataloader`` hooks of the LightningDataModule (or LightningModule) return their loaders rebuilt with it
    (sampler, batch size, ``collate_fn``, ``drop_last`` and the rest kept) until teardown. Otherwise the loaders stay as
    they are, and `report` says why. The probe is skipped, with the reason, when it cannot pay back within the run's
    steps left (`lightning_speedkit.decisions.probe_pays_back`). The decision is in ``state_dict``: a resumed run does
    not probe again (the life cycle is `lightning_speedkit.trials.Lever`'s).

    A loader that cannot be rebuilt safely (a DataLoader subclass, an IterableDataset with workers) or loaders
    passed straight to ``fit()`` are left alone, with one line saying why. A litdata ``StreamingDataLoader`` is tuned
    on its own terms (`lightning_speedkit.dataloader.streaming`): workers and prefetch (and ``max_pre_download`` when
    streamed from a URL), rebuilt as a ``StreamingDataLoader`` with its state; the decision's ``not_tuned`` says
    which of litdata's settings were left alone, and why.

    Args:
        candidates: Settings to try (dicts with ``num_workers`` and optionally ``persistent_workers``,
            ``prefetch_factor``, ``pin_memory``, ``batched_fetch``; with workers, missing ones are persistent workers
            and ``prefetch_factor=2``; ``pin_memory`` defaults to the loader's); default: `default_candidates` up to
            ``max_workers``; for a ``TensorDataset`` collated by ``default_collate``, ``batched_fetch=True`` instead
            (each batch one indexing call a tensor, `lightning_speedkit.data.batched`). A candidate equal to the
            loader's own settings is not tried twice. When the loader's wait for data cannot repay the start-up of
            worker candidates but can repay the others, only those others are tried.
        probe_steps: Training steps per setting; the first ``min(2, probe_steps - 1)`` are not timed (worker
            start-up). Counted blocks are shorter, down to 4 (or ``probe_steps`` if fewer), when the first epoch
            holds no more after the epoch-bound counted probes queued before this one (the others queue behind it);
            shorter than that, trials are restored.
        max_workers: Most workers tried; default: the cores available to this process divided by the processes of
            this node (DDP local ranks).
        margin: How much faster (relative median step time) a candidate must be than the loader's own settings.
        remember: Remember the decision across runs (`lightning_speedkit.trials.memory`): a later run with the same
            fingerprint (model, batch, loader, devices, hardware, versions, arguments) applies it without probing.

    Raises:
        ValueError: For ``probe_steps`` < 1, a negative ``max_workers``, a ``margin`` outside [0, 1), empty
            ``candidates`` or a candidate with an unknown key or a bad value.

    Logged metrics (rank zero, once the decision is made): ``speedkit/data/num_workers`` (of the loaders
    in use), ``speedkit/data/speedup`` (median step time of the loader's own settings over the chosen one's; 1.0 when
    they are kept) and ``speedkit/data/probe_s`` (seconds the probe took; 0.0 when skipped).

    Example:
        >>> import lightning as L
        >>> trainer = L.Trainer(logger=False, callbacks=[DataLoaderTuner(probe_steps=4)])
    """

    AREA = "data"
    LEGACY_STATE_KEYS = ("report",)  # the key checkpoints of earlier versions hold
    EXTRA_SPEC: ClassVar[StateSpec] = {
        "chosen": dict,
        "baseline": dict,
        "rebuilt": bool,
        "baseline_step_s": (float, None),
        "chosen_step_s": (float, None),
        "speedup": float,
        "candidates": ListOf(dict),
        "max_workers": int,
        "streaming": bool,
        "not_tuned": ListOf(str),
    }

    MAX_GAIN = 0.5
    """The payback rule's best case: loader settings can at most hide the data loading behind the step, and we assume
    that is at most half of it (2x, a data-bound pipeline); the probe runs only when saving half of every step left
    would repay it (`~lightning_speedkit.decisions.probe_pays_back`). A pipeline more data-bound than that gains more,
    so on a run long enough to probe it still repays."""

    WARMUP = 2
    """Untimed steps at the start of each trial: worker processes start (their prefetched batches are bounded in
    `LoaderTrials`: `lightning_speedkit.dataloader.counted.steady_bound`)."""

    COUNTED = True

    def __init__(
        self,
        candidates: Sequence[dict[str, Any]] | None = None,
        probe_steps: int = 6,
        max_workers: int | None = None,
        margin: float = 0.05,
        remember: bool = True,
    ) -> None:
        self.remember = check_bool("remember", remember)
        check_probe_steps("probe_steps", probe_steps)
        check_int("max_workers", max_workers, low=0, optional=True)
        self.margin = check_margin("margin", margin)
        if candidates is not None and (not isinstance(candidates, (list, tuple)) or not candidates):
            raise ValueError(f"`candidates` must be a non-empty list of settings dicts or None, got {candidates!r}.")
        for candidate in candidates or ():
            if not valid_candidate(candidate):
                raise ValueError(
                    f"`candidates` entries take keys {', '.join((*SETTINGS, BATCHED))} (num_workers an int >= 0,"
                    f" prefetch_factor an int >= 1 or None, the others bools), got {candidate!r}."
                )
        self.candidates = [dict(c) for c in candidates] if candidates is not None else None
        self.probe_steps = probe_steps
        self.max_workers = max_workers
        self._applied: LoaderSettings | None = None
        self._left: list[str] = []
        self._planned: dict[str, Any] = {}
        self._live: LiveSettings | None = None
        self._serving: CountedLoader | None = None

    @override
    def plan(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> tuple[Setting, Sequence[Setting]] | Decision:
        self._planned = {}
        owner = self._owner(trainer, pl_module)
        if owner is None:
            return Decision.skipped(_AS_IS, self._left[-1])
        plan = trainer.strategy.broadcast(self._plan(trainer, owner) if trainer.is_global_zero else {}, src=0)
        if "left_alone" in plan:
            self._left_alone(plan["left_alone"])
            return Decision.skipped(_AS_IS, plan["left_alone"])
        self._planned = {**plan, "owner": owner}
        baseline, candidates = plan["baseline"], plan["candidates"]
        if plan["batches"] is not None and plan["batches"] < self.probe_steps and candidates:
            limited = f" (limit_train_batches={trainer.limit_train_batches})" if plan["limited"] else ""
            why = f"skipped: the train loader has {plan['batches']} batches per rank{limited}, fewer than probe_steps"
            return Decision.skipped(settings_name(baseline), why)
        loaders = trainer.fit_loop._combined_loader
        single = loaders is None or len(loaders.flattened) == 1
        counted = plan["map_style"] and single and baseline["num_workers"] == 0  # a single-process loader to serve
        block = self.block_steps(trainer, 1 + len(candidates))
        if plan["batches"] is not None and block >= min(_MIN_BLOCK, self.probe_steps) and counted:
            self._live = live = LiveSettings(baseline)  # counted: the first epoch's steps are the probe
            return CountedBlock(live, baseline), [CountedBlock(live, s) for s in candidates]
        self._live = None  # restored trials: an epoch too short (or an iterable dataset) for the counted window
        current = AsIs(settings_name(baseline))
        return current, [LoaderSettings(owner, s, on_refused=self._left_alone) for s in candidates]

    @override
    def block_steps(self, trainer: pl.Trainer, settings: int) -> int:
        """Counted blocks of ``probe_steps``, or shorter, so that they fit in the first epoch.

        Every setting's blocks, none dropped, after the counted probes this one queues behind (`plan` takes them down
        to 4 steps, then restored trials): the epoch-bound ones; the others wait for it (`CountedTrials.join`).
        """
        room = (self._planned.get("batches") or 0) - queued_steps(trainer, bound=True)
        return min(self.probe_steps, room // (settings * COUNTED_ROUNDS))

    @override
    def counted_trials(self, current: Setting, others: Sequence[Setting], steps: int, warmup: int) -> CountedTrials:
        return LoaderTrials(current, others, steps, self.margin, warmup=warmup)

    @override
    def after_reference(self, result: TrialResult, waits: list[float], steps_left: float) -> str | LeaveOut:
        """Restored trials: keep the loader as built when its steps' wait for data cannot repay trying the others.

        The same rule as counted trials' (`lightning_speedkit.dataloader.counted.worth_trying`): worker candidates are
        left out when only their start-up is what the wait cannot repay.
        """
        step_s, timed = result.median_step_s, waits[result.warmup :]
        candidates = self._planned.get("candidates", [])
        if not step_s or not timed or not candidates:
            return ""
        named = [(settings_name(c), c) for c in candidates]
        steps = self.probe_steps
        keep, out = worth_trying(
            result.setting,
            step_s,
            statistics.median(timed),
            steps_left,
            named,
            lambda n: steps * (PROBE_ROUNDS * (1 + n) - 1),
        )  # the trials still to run, at worst
        return out if out is not None else keep

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Counted trials: the first epoch's iterator (built, its first batch fetched) is served by `CountedLoader`."""
        combined = trainer.fit_loop._combined_loader
        if self._counted is None or self._live is None or self._serving is not None or combined is None:
            return
        iterators: list[Any] | None = getattr(combined._iterator, "iterators", None)
        served = None
        if iterators is not None and len(iterators) == 1:
            (base,) = combined.flattened
            self._serving = CountedLoader(base, self._live)
            served = self._serving.take_over(iterators[0])
        if served is None:  # not the single-process iterator the plan expected: settings cannot switch under it
            self._serving = None
            self._counted.stop(trainer)
            self._counted = None
            reason = "skipped: the first epoch's loader could not be served by the counted trials"
            self._settle(trainer, pl_module, Decision.skipped(settings_name(self._live.settings), reason), store=False)
            return
        assert iterators is not None  # served is None otherwise
        iterators[0] = served

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._serving is not None:  # the next epoch's loader: the one built at fit start, rebuilt or as it is
            self._serving.close()
            self._serving = None
            if self._applied is not None:  # else kept as built: the next epoch continues it, its generator too
                # its hook is not called again; a counted epoch's loader is map-style, never a litdata one
                self._applied.rebuild_in_place(trainer)

    @override
    def finish(self, decision: Decision) -> Decision:
        """The decision also names the settings: ``chosen``, ``baseline``, each candidate's step time."""
        if not self._planned or "chosen" in decision.extra:
            return decision
        baseline, candidates = self._planned["baseline"], self._planned["candidates"]
        by_name = {settings_name(baseline): baseline, **{settings_name(s): s for s in candidates}}
        base_s, chosen_s = decision.step_s.get(settings_name(baseline)), decision.step_s.get(decision.decision)
        tried = [{**c, "name": settings_name(c), "step_s": decision.step_s.get(settings_name(c))} for c in candidates]
        decision.extra.update(
            chosen=by_name[decision.decision],
            baseline=baseline,
            rebuilt=decision.decision != settings_name(baseline),
            baseline_step_s=base_s,
            chosen_step_s=chosen_s,
            speedup=base_s / chosen_s if base_s and chosen_s else 1.0,
            candidates=tried,
            max_workers=self._planned["max_workers"],
        )
        if self._planned.get("streaming"):
            decision.extra.update(streaming=True, not_tuned=list(self._planned["not_tuned"]))
            rank_zero_info(f"DataLoaderTuner: StreamingDataLoader; not tuned: {'; '.join(self._planned['not_tuned'])}.")
        return decision

    @override
    def apply(self, trainer: pl.Trainer, pl_module: pl.LightningModule, decision: Decision) -> None:
        chosen = decision.extra.get("chosen")
        if chosen is None:
            return  # the loaders were left alone
        owner = self._owner(trainer, pl_module)
        if self._live is not None and self._serving is not None:  # mid first epoch: its rest is served so
            self._live.settings = dict(chosen)
        if decision.extra.get("rebuilt", True) and owner is not None:
            self._applied = LoaderSettings(owner, chosen, _HOOKS, self._left_alone)
            self._applied.apply(trainer)  # the hooks return rebuilt loaders: a later fit, a reload
            if self._serving is None:  # a counted epoch's own loader is rebuilt at its end
                self._applied.rebuild_in_place(trainer)  # the loaders already built (fit start: none yet)
            forget_peeks(trainer)  # a streaming loader's length depends on its workers

    @override
    def metrics(self, decision: Decision) -> dict[str, float]:
        chosen = decision.extra.get("chosen")
        if chosen is None:
            return {}
        return {
            "speedkit/data/num_workers": float(chosen["num_workers"]),
            "speedkit/data/speedup": float(decision.extra.get("speedup") or 1.0),
            "speedkit/data/probe_s": float(decision.probe_s),
        }

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._applied is not None:
            self._applied.revert(trainer)
            self._applied = None

    def workers_measured_slower(self) -> str | None:
        """What more workers measured, when each setting tried with more was slower (`slower_workers`).

        Read by `UtilizationMonitor`, so its advice does not suggest workers this run measured slower.
        """
        return slower_workers(self.decision.extra if self.decision is not None else {})

    @override
    def status(self) -> dict[str, Any]:
        """``left_alone``: why a loader was not rebuilt, if so.

        Beside it, the decision (`lightning_speedkit.trials.Decision`): ``decision`` (the chosen setting's name),
        ``chosen`` and ``baseline`` (the chosen settings and the loader's own), ``rebuilt`` (whether the loaders were
        rebuilt), ``baseline_step_s`` and ``chosen_step_s`` (median seconds per training step), ``candidates`` (each
        setting tried, with its ``step_s``), ``speedup`` (``baseline_step_s / chosen_step_s``; 1.0 when kept),
        ``probed``, ``probe_s``, ``reason``, ``source``, ``rejected``, ``steps_left`` and ``max_workers``.
        """
        return {"left_alone": list(self._left)} if self._left else {}

    def _owner(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> Owner | None:
        source = getattr(trainer.fit_loop, "_data_source", None)
        instance = getattr(source, "instance", None)
        if isinstance(instance, (pl.LightningModule, pl.LightningDataModule)):
            return instance
        reason = "dataloaders were passed straight to fit(); return them from a LightningDataModule to tune them"
        self._left_alone(reason)
        return None

    def _plan(self, trainer: pl.Trainer, owner: Owner) -> dict[str, Any]:
        """Rank zero: the loader's own settings, the candidates to try, or why the loader is left alone."""
        with isolate_rng(include_cuda=torch.cuda.is_available()), generators_kept(owner):  # the run's own call then
            loader = owner.train_dataloader()  # draws as without us, from the global RNG and the owner's generators
        if not isinstance(loader, DataLoader):
            return {"left_alone": f"train_dataloader() returned a {type(loader).__name__}, not a DataLoader"}
        streaming = is_streaming_loader(loader)
        baseline = streaming_settings(loader) if streaming else loader_settings(loader)
        max_workers = self.max_workers
        if max_workers is None:
            max_workers = max(0, cpu_info().available_cores // max(1, trainer.num_devices))
        pin = bool(loader.pin_memory)
        batched = fetches_at_once(loader.dataset, loader.collate_fn)
        asked = [c for c in self.candidates or () if batched or not c.get(BATCHED)]
        if len(asked) < len(self.candidates or ()):
            rank_zero_warn(f"DataLoaderTuner: `{BATCHED}` left out: {_NOT_BATCHED}.")
        if streaming:  # litdata's own loader: workers and prefetch, its pre-download when remote (not persistent)
            wanted = (
                streaming_candidates(max_workers, baseline)
                if self.candidates is None
                else [
                    {**baseline, **complete_settings(**{"pin_memory": pin, "persistent_workers": False, **c})}
                    for c in asked
                ]
            )
        elif self.candidates is None:
            wanted = default_candidates(max_workers, trainer.strategy.root_device.type == "cuda", batched)
        else:
            wanted = [complete_settings(**{"pin_memory": pin, **c}) for c in asked]
        candidates: list[dict[str, Any]] = []
        for settings in wanted:
            if settings != baseline and settings not in candidates:
                candidates.append(settings)
        try:
            for settings in (baseline, *candidates):
                rebuild_dataloader(loader, settings)
        except NotRebuildableError as error:
            return {"left_alone": str(error)}
        try:  # a streaming loader's length is already this rank's; a sampler's is at most world_size times it
            batches: int | None = len(loader) // (1 if streaming else trainer.world_size)
        except TypeError:
            batches = None
        limit, loader_batches = trainer.limit_train_batches, batches  # the first epoch's, which the blocks must fit in
        if batches is not None:
            batches = int(batches * limit) if isinstance(limit, float) else min(batches, int(limit))
        # batches a sampler draws (the counted probe serves them); not `batch_size=None`'s samples one by one
        map_style = not isinstance(loader.dataset, IterableDataset) and loader.batch_sampler is not None
        plan = {"baseline": baseline, "candidates": candidates, "max_workers": max_workers, "batches": batches}
        plan["limited"] = batches != loader_batches  # the limit cut the epoch: the skip reason names it
        plan |= {"map_style": map_style, "streaming": streaming}
        return plan | ({"not_tuned": untuned_settings(loader)} if streaming else {})

    def _left_alone(self, reason: str) -> None:
        if reason not in self._left:
            self._left.append(reason)
            rank_zero_warn(f"DataLoaderTuner: leaving the dataloaders alone: {reason.rstrip('.')}.")
