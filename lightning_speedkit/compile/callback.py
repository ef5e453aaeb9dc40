"""`Compile`: ``torch.compile`` kept only when the compile is repaid, with margin, by the steps left in the run."""

from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lightning_speedkit import trials
from lightning_speedkit.checks import check_bool, check_int, check_margin, check_number, check_probe_steps
from lightning_speedkit.compile.counted import DECISION_FIELDS, EAGER, CountedCompile
from lightning_speedkit.compile.dynamo import CompiledCall, CompileWatch, graph_breaks, tag_compile_cache
from lightning_speedkit.compile.payback import MAX_GAIN, compile_pays_back
from lightning_speedkit.decisions import loss_is_sound
from lightning_speedkit.report import log_rank_zero
from lightning_speedkit.restore import StateSpec
from lightning_speedkit.trials.counted import COUNTED_ROUNDS, counted_cost

log = logging.getLogger(__name__)

__all__ = ["COMPILE_MODES", "Compile"]

COMPILE_MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
"""The ``mode`` values ``torch.compile`` accepts."""

_EAGER, _COMPILED = EAGER, "compiled"
_LOSS_TOLERANCE = 0.1
"""How much higher (relative) the first compiled block's mean loss may be than the first eager block's: no noise
allowance (a module computing something else passed one); on noisy batches an identical one may stay eager."""


class _Compiled(trials.Setting):
    """The module compiled for a trial; tallies the calls, compile seconds, graphs and graph breaks of its trials."""

    name = _COMPILED
    changes_math = False  # the same step, compiled: its steps can count (up to the compiled kernels' numerics)

    def __init__(self, callback: Compile) -> None:
        self.callback = callback
        self.compile_s = 0.0
        self.calls = self.graphs = self.graph_breaks = 0
        self._marks = (0, 0, 0)

    @override
    def apply(self, trainer: pl.Trainer) -> None:
        call = self.callback._install(trainer.lightning_module)
        self._marks = (len(self.callback._watch.events), graph_breaks(), call.calls)

    @override
    def revert(self, trainer: pl.Trainer) -> None:
        call = self.callback._uninstall(trainer.lightning_module)
        graphs, seconds = self.callback._watch.since(self._marks[0])
        self.graphs, self.compile_s = self.graphs + graphs, self.compile_s + seconds
        self.graph_breaks += graph_breaks() - self._marks[1]
        self.calls += (call.calls if call is not None else self._marks[2]) - self._marks[2]


class Compile(trials.Lever):
    """Compile the LightningModule with ``torch.compile`` when, and only when, it pays back within the run.

    The probe runs on the fit's own first training steps, after any DDP wrapper is built (so the module is compiled
    inside it and DDP's communication stays eager): blocks of ``probe_steps`` steps alternate eager and compiled,
    three rounds (`lightning_speedkit.trials.counted`: compiling does not change what a step computes, so nothing is
    restored and every probe step trains; the optimizer steps, epochs, LR schedule and sample order are the run's).
    The compile seconds are dynamo's own (every graph, forward and backward); the step times are each block's after
    its first step. The compiled module is kept only when `compile_pays_back`: the projected saving over the steps
    left (``trainer.estimated_stepping_batches``) exceeds the compile seconds by ``margin``. The compile paid in the
    probe is counted although it is spent: it stands for the graphs still to come (the validation graph, new batch
    shapes) and keeps a decision honest about what compiling the run costs. The probe costs (``probe_s``) the blocks'
    seconds beyond the setting kept's step time: the compile itself when the module stays eager.

    The probe is skipped, and the module stays eager, when the run is too short to repay the probe's steps
    (`~lightning_speedkit.decisions.probe_pays_back`), or when, after one eager block, even steps 50% shorter could not
    repay a compile of ``min_compile_s`` (`compile_worth_probing`). If compiling fails (in the probe, or later at a
    call), breaks the graph more than ``max_graph_breaks`` times, or gives a clearly higher loss than the eager block
    before it, the module stays eager with one warning and training goes on (a failed compile's steps run eager).
    Batch-size changes and a partial last batch cost one recompile each graph (automatic dynamic shapes), not one per
    step: `report` counts the graphs compiled after the decision. The module is compiled in place
    (`torch.nn.Module.compile`): no ``_orig_mod.`` in ``state_dict`` keys; a deep copy of the module is eager; one the
    user compiled is left alone. At fit start torch.compile's caches are keyed by the CPU ISA (torch keys no CPU graph
    by it: `~lightning_speedkit.compile.dynamo.tag_compile_cache`). The decision is in ``state_dict``.

    Args:
        mode: ``torch.compile`` mode: one of `COMPILE_MODES`.
        backend: A registered ``torch.compile`` backend name (``torch._dynamo.list_backends()``) or a callable.
        fullgraph: Refuse graph breaks (a break then fails the compile, and the module stays eager).
        dynamic: ``torch.compile``'s ``dynamic``: None marks a dimension dynamic once it changes.
        options: Backend options (a dict), instead of ``mode``.
        measure: Time eager and compiled steps and decide; ``False`` compiles without timing (one restored compiled
            trial still checks that it compiles).
        margin: How much (relative, in [0, 1)) the projected saving must exceed the compile seconds.
        probe_steps: Training steps per block (the first is left out of the step time).
        max_graph_breaks: The most graph breaks tolerated before staying eager.
        min_compile_s: The least a compile is taken to cost when deciding whether to probe at all. Inductor's first
            compile in a process took 19-45 s on a 2-core CPU, a tiny MLP's later ones 1.5-2 s; wrongly probing costs
            a compile, wrongly skipping at most the best-case saving, which is then below this.
        remember: Remember the decision across runs (`lightning_speedkit.trials.memory`): a later run with the same
            fingerprint (model, batch, loader, devices, hardware, versions, arguments) applies it without probing.

    Raises:
        ValueError: For an unknown ``mode`` or ``backend``, ``mode`` together with ``options``, a non-bool
            ``fullgraph``/``measure``, a ``dynamic`` other than None/True/False, ``options`` not a dict, a ``margin``
            outside [0, 1), ``probe_steps`` below 2, a negative ``max_graph_breaks`` or ``min_compile_s``.

    Logged metrics: ``speedkit/compile/eager_step_ms``, ``speedkit/compile/compiled_step_ms``,
    ``speedkit/compile/probe_s`` and ``speedkit/compile/compile_s`` (when probed), ``speedkit/compile/recompiles``
    (at the end of training).

    Example:
        >>> import lightning as L
        >>> trainer = L.Trainer(logger=False, callbacks=[Compile(mode="max-autotune-no-cudagraphs")])
    """

    AREA = "compile"
    MAX_GAIN = MAX_GAIN
    EXTRA_SPEC: ClassVar[StateSpec] = {
        "compile_s": (float, None),
        "saving_s": (float, None),
        "cost_s": float,
        "graphs": int,
        "graph_breaks": int,
        "recompiles": int,
        "recompile_s": float,
    }

    def __init__(
        self,
        mode: str | None = None,
        backend: str | Callable[..., Any] = "inductor",
        fullgraph: bool = False,
        dynamic: bool | None = None,
        options: dict[str, Any] | None = None,
        measure: bool = True,
        margin: float = 0.1,
        probe_steps: int = 4,
        max_graph_breaks: int = 4,
        min_compile_s: float = 5.0,
        remember: bool = True,
    ) -> None:
        self.remember = check_bool("remember", remember)
        if mode not in COMPILE_MODES:
            raise ValueError(f"`mode` must be one of {', '.join(map(repr, COMPILE_MODES))}, got {mode!r}.")
        if isinstance(backend, str):
            known = torch._dynamo.list_backends(exclude_tags=())
            if backend not in known:
                raise ValueError(f"`backend` must be a callable or one of {', '.join(known)}, got {backend!r}.")
        elif not callable(backend):
            raise ValueError(f"`backend` must be a backend name or a callable, got {backend!r}.")
        for name, value in (("fullgraph", fullgraph), ("measure", measure)):
            if not isinstance(value, bool):
                raise ValueError(f"`{name}` must be True or False, got {value!r}.")
        if dynamic is not None and not isinstance(dynamic, bool):
            raise ValueError(f"`dynamic` must be None, True or False, got {dynamic!r}.")
        if options is not None and not isinstance(options, dict):
            raise ValueError(f"`options` must be a dict or None, got {options!r}.")
        if options is not None and mode is not None:
            raise ValueError(f"`options` cannot be combined with `mode`; pass one of them, got mode={mode!r}.")
        if options and backend == "inductor":  # other backends take options of their own
            unknown = sorted(str(key) for key in options if key not in torch._inductor.list_options())
            if unknown:
                raise ValueError(
                    f"`options` must name inductor options (torch._inductor.list_options()), got {options!r}: unknown"
                    f" {', '.join(map(repr, unknown))}."
                )
        check_int("max_graph_breaks", max_graph_breaks, low=0)
        check_number("min_compile_s", min_compile_s, 0)
        self.compile_kwargs: dict[str, Any] = {"fullgraph": fullgraph, "dynamic": dynamic, "backend": backend}
        self.compile_kwargs.update(mode=mode, options=options)
        self.measure = measure
        self.margin = check_margin("margin", margin)
        self.probe_steps = check_probe_steps("probe_steps", probe_steps, low=2)
        self.max_graph_breaks = max_graph_breaks
        self.min_compile_s = float(min_compile_s)
        self._status = "not set up"
        self._watch = CompileWatch()
        self._mark = 0
        self._call: CompiledCall | None = None
        self._failure: Exception | None = None

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        tag_compile_cache()  # before any graph compiles, ours or the user's: the caches keyed by the CPU ISA
        users = pl_module._compiled_call_impl
        if (users is not None and not isinstance(users, CompiledCall)) or pl_module._compiler_ctx is not None:
            self._status = "compiled by the user: left as it is"
            self._decision = trials.Decision.skipped("compiled by the user", "left as it is")
            return
        self._watch.install()
        super().on_fit_start(trainer, pl_module)

    @override
    def decide(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> trials.Decision | None:
        """Probe eager against compiled on the first training steps (None: `CountedCompile` decides), or skip."""
        resumed = self.resumed_without_decision(trainer)
        if resumed:
            return trials.Decision.skipped(_EAGER, resumed)
        report = self._decide(trainer)
        if report is None:
            return None
        fields = {k: report.pop(k) for k in DECISION_FIELDS}
        return trials.Decision(**fields, source="measured" if fields["probed"] else "skipped", extra=report)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if isinstance(self._counted, CountedCompile):
            self._counted.record_loss(outputs)
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    @override
    def apply(self, trainer: pl.Trainer, pl_module: pl.LightningModule, decision: trials.Decision) -> None:
        self._use(trainer, decision.decision == _COMPILED, decision.reason)

    @override
    def metrics(self, decision: trials.Decision) -> dict[str, float]:
        metrics = super().metrics(decision)
        if decision.extra.get("compile_s") is not None:
            metrics["speedkit/compile/compile_s"] = float(decision.extra["compile_s"])
        return metrics

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_end(trainer, pl_module)  # a fit that ended inside the probe keeps the module eager
        if self._status != _COMPILED or self._decision is None:
            return
        graphs, seconds = self._watch.since(self._mark)
        self._decision.extra.update(recompiles=graphs, recompile_s=seconds)
        log_rank_zero(trainer, {"speedkit/compile/recompiles": float(graphs)})

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._watch.remove()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._watch.remove()

    @override
    def status(self) -> dict[str, Any]:
        """What was decided and measured, as a plain dict (beside the `lightning_speedkit.trials.Decision`).

        ``status`` (``"compiled"``, ``"eager: <why>"`` or why the module was left alone), ``decision``
        (``"compiled"`` or ``"eager"``), ``reason``, ``probed``, ``probe_s``, ``steps_left``, ``step_ms`` (median
        eager and compiled step, ms), ``compile_s`` (dynamo's compile seconds in the probe), ``saving_s`` (projected
        over the steps left), ``cost_s`` (``compile_s * (1 + margin)``), ``graphs`` and ``graph_breaks`` (in the
        probe), ``rejected`` and, once training ended compiled, ``recompiles`` and ``recompile_s`` (graphs compiled
        after the decision: the validation graph on a resume, new batch shapes).
        """
        return {"status": self._status}

    # ------------------------------------------------------------------------------------------------ private
    def _decide(self, trainer: pl.Trainer) -> dict[str, Any] | None:
        """Start the counted probe (None), or the report of a decision made now.

        A decision now: the run is too short for a probe, or ``measure=False`` (one restored compiled trial checks
        that it compiles); every rank returns rank zero's.
        """
        left = trials.steps_left(trainer)
        report: dict[str, Any] = {"decision": _EAGER, "reason": "", "probed": False, "probe_s": 0.0}
        report.update(steps_left=None if math.isinf(left) else left, step_s={}, compile_s=None, rejected={})
        self._failure = None
        if self.measure:
            cost = counted_cost(2, self.probe_steps, COUNTED_ROUNDS, self.margin)
            pays, why, _ = trials.probe_cost(trainer, cost, MAX_GAIN)
            if not pays:
                report["reason"] = why
                return report
            self._counted = CountedCompile(self, _Compiled(self), left)
            self._counted.join(trainer)
            return None
        val_loop = trainer.fit_loop.epoch_loop.val_loop
        validate = bool(trainer.limit_val_batches) and val_loop._data_source.is_defined()
        compiled = _Compiled(self)
        results: list[trials.TrialResult] = []
        with trials.TrialSession(trainer, self.probe_steps, warmup=1, validate=validate) as session:
            session.require_steps("probe_steps")
            try:
                results.append(self._trial(session, compiled))
            except Exception as err:  # any compiler failure keeps the module eager
                self._failure = err
        report.update(probed=True, probe_s=session.elapsed_s, trials=[r.as_dict() for r in results])
        failed = not trainer.strategy.reduce_boolean_decision(self._failure is None, all=True)
        self._conclude(report, results, compiled, left, failed)
        return dict(trainer.strategy.broadcast(report, src=0))

    def _trial(self, session: trials.TrialSession, setting: trials.Setting) -> trials.TrialResult:
        """One restored trial (``measure=False``)."""
        return self._timed(session.run(setting))

    def _timed(self, result: trials.TrialResult) -> trials.TrialResult:
        """A trial's or a counted block's result, as the decision reads it (the seam where tests inject times)."""
        return result

    def _conclude(
        self,
        report: dict[str, Any],
        results: list[trials.TrialResult],
        compiled: _Compiled,
        left: float,
        failed: bool,
    ) -> None:
        """Fill in the decision from the trials' results."""
        own = {name: [r for r in results if r.setting == name] for name in (_EAGER, _COMPILED)}
        step_s = {name: _median_step(rs) for name, rs in own.items() if rs}
        compile_s = compiled.compile_s if CompileWatch.available() else _first_step_excess(own)
        report.update(step_s=step_s, compile_s=compile_s, graphs=compiled.graphs, graph_breaks=compiled.graph_breaks)
        if failed:
            error = self._failure
            what = f"{type(error).__name__}: {_first_line(error)}" if error is not None else "on another rank"
            report["rejected"][_COMPILED] = report["reason"] = f"eager: compiling failed ({what})"
            rank_zero_warn(f"Compile: compiling the module failed ({what}); training goes on eager.")
            return
        if compiled.calls == 0:
            report["reason"] = "eager: the module itself is never called (compile what `training_step` calls)"
            return
        if compiled.graph_breaks > self.max_graph_breaks:
            report["rejected"][_COMPILED] = report["reason"] = (
                f"eager: {compiled.graph_breaks} graph breaks (more than max_graph_breaks={self.max_graph_breaks})"
            )
            rank_zero_warn(f"Compile: {report['reason'][7:]}; training goes on eager.")
            return
        first = {name: rs[0].losses if rs else [] for name, rs in own.items()}  # measure=False: no eager, a NaN still
        if own[_COMPILED] and (unsound := loss_is_sound(first[_COMPILED], first[_EAGER], _LOSS_TOLERANCE)):
            report["rejected"][_COMPILED] = report["reason"] = f"eager: the compiled loss differs ({unsound})"
            rank_zero_warn(f"Compile: the compiled module trains differently ({unsound}); training goes on eager.")
            return
        if not self.measure:
            report.update(decision=_COMPILED, reason="compiled without timing (measure=False)")
            return
        eager_s, compiled_s = step_s.get(_EAGER), step_s.get(_COMPILED)
        if eager_s is None or compiled_s is None:
            report["reason"] = "eager: no step time to compare"
            return
        keep, why = compile_pays_back(eager_s, compiled_s, compile_s, left, self.margin)
        saving = None if math.isinf(left) else (eager_s - compiled_s) * left  # an unbounded run: no total
        cost = compile_s * (1.0 + self.margin)
        report.update(decision=_COMPILED if keep else _EAGER, reason=why, saving_s=saving, cost_s=cost)

    def _use(self, trainer: pl.Trainer, compiled: bool, reason: str) -> None:
        module = trainer.lightning_module
        if compiled:
            self._install(module)
            self._mark = len(self._watch.events)
            self._status = _COMPILED
        else:
            self._uninstall(module)
            self._status = f"eager: {reason.removeprefix('eager: ')}"

    def _install(self, module: pl.LightningModule) -> CompiledCall:
        """Compile ``module`` in place (once; later calls put the same compiled function back)."""
        if self._call is None or self._call.module is not module:
            module.compile(**self.compile_kwargs)
            compiled = module._compiled_call_impl
            if compiled is None:  # pragma: no cover - nn.Module.compile always sets it
                raise RuntimeError("Compile: `nn.Module.compile` left no compiled call.")
            self._call = CompiledCall(compiled, module._call_impl, self._on_failure)
        module._compiled_call_impl = self._call
        return self._call

    def _uninstall(self, module: pl.LightningModule) -> CompiledCall | None:
        """Make ``module`` eager again; the compiled call it had (kept for the next `_install`)."""
        module._compiled_call_impl = None
        return self._call

    def _on_failure(self, error: Exception) -> None:
        """A compile failed at a call: eager from now on, with one warning once training runs compiled."""
        if self._call is not None and isinstance(self._call.module, torch.nn.Module):
            self._call.module._compiled_call_impl = None
        self._failure = error
        if self._status == _COMPILED:
            what = f"{type(error).__name__}: {_first_line(error)}"
            if self._decision is not None:
                self._decision.decision, self._decision.reason = _EAGER, f"eager: compiling failed at a call ({what})"
            self._status = f"eager: compiling failed at a call ({what})"
            rank_zero_warn(f"Compile: compiling the module failed ({what}); training goes on eager.")


def _median_step(results: list[trials.TrialResult]) -> float | None:
    timed = [t for r in results if r.fits for t in r.step_s[r.warmup :]]
    return statistics.median(timed) if timed else None


def _first_step_excess(own: Mapping[str, list[trials.TrialResult]]) -> float:
    """Without dynamo's compile callbacks: the first compiled step's time beyond the first eager step's."""
    first = [r.step_s[0] for r in own[_COMPILED] if r.step_s][:1]
    eager = [r.step_s[0] for r in own[_EAGER] if r.step_s]
    return max(0.0, first[0] - (statistics.median(eager) if eager else 0.0)) if first else 0.0


def _first_line(error: BaseException | None) -> str:
    return (str(error).strip().splitlines() or [""])[0][:200] if error is not None else ""
