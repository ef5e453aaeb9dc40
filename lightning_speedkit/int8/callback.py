"""`Int8Export`: at the end of fit, the best checkpoint to a verified INT8 ONNX model with a report."""

from __future__ import annotations

import logging
import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_speedkit.checks import check_bool, unwritable
from lightning_speedkit.hooks import LeanCallback
from lightning_speedkit.int8.args import check_export_args, check_metric
from lightning_speedkit.int8.export import Int8VerificationError, export_int8
from lightning_speedkit.int8.inputs import InputsFromBatch
from lightning_speedkit.int8.place import export_exists
from lightning_speedkit.int8.report import drop_message, int8_metrics, summary_line
from lightning_speedkit.int8.sources import metrics_of, module_to_export, validation_loader
from lightning_speedkit.int8.steps import import_export_deps
from lightning_speedkit.report import log_rank_zero
from lightning_speedkit.restore import cached_state_key

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from torch import nn
    from torchmetrics import Metric

log = logging.getLogger(__name__)

__all__ = ["Int8Export"]


class Int8Export(LeanCallback):
    """At the end of fit, export the model to a verified INT8 ONNX file with a size, latency and accuracy report.

    Runs `lightning_speedkit.int8.export_int8` at ``on_train_end`` on the weights of the best checkpoint when a
    ``ModelCheckpoint`` monitors a metric (loaded with ``weights_only=True`` into a copy of the module; if its shapes
    no longer fit, e.g. it was saved before pruning, the final weights are used and a warning says so), else on the
    final weights (a `WeightAverage`'s average, wherever it is in the callback list). It calibrates on the first
    ``calibration_batches`` validation batches and, with ``verify``, compares FP32 and INT8 in ONNX Runtime on the
    whole validation set, including the module's own validation metric: ``metric`` if given, else the torchmetrics
    ``Metric`` attribute named like a ``ModelCheckpoint``'s ``monitor``, else the only one whose name starts with
    ``val``; without one, top-1 accuracy when the targets are class indices. The validation batches come from the
    datamodule's (or module's) ``val_dataloader()``, not sharded; they must be ``(input, target, ...)``, an input
    tensor or a dict keyed by ``forward``'s parameters (``input_ids``, ``attention_mask``, ``labels``), unless
    ``inputs_from_batch`` picks the model's inputs out of them. When the INT8 model misses ``max_metric_drop`` (or
    ``min_agreement``), the most sensitive layers are kept in FP32 until it holds (at most ``max_fp32_layers``); the
    report lists them and their cost in size and latency. If it still misses, `report` has ``passed: False`` and a
    ``status`` starting with ``FAILED``.

    Files in ``dirpath``: ``model.onnx`` (INT8), ``model.fp32.onnx`` and ``model.json`` (the report), named after
    ``filename``, switched into place as a whole when complete (`lightning_speedkit.int8.place`). An existing
    export is never replaced unless ``overwrite=True``: the new one gets the next free name ``model-v1.onnx``,
    ``model-v2.onnx``, ... Only global rank zero exports; the other ranks wait for it (a broadcast of the report,
    which every rank then returns from `report`), and a failure on rank zero is raised on every rank. The report
    is uploaded as a W&B artifact when a ``WandbLogger`` is attached.

    Args:
        dirpath: Directory for the files (default: ``<trainer.default_root_dir>/int8``).
        calibration_batches: Validation batches to calibrate on.
        symmetric: Symmetric activations too, so all zero points are 0 (what TensorRT needs); QInt8 activations.
        verify: Compare FP32 and INT8 on the validation set.
        max_metric_drop: Allowed absolute drop of the metric (0.01: one point of accuracy); None: no check.
        activation_type: ``"int8"`` or ``"uint8"``; None: chosen from the CPU (`lightning_speedkit.int8.int8_format`:
            U8S8 on x86, with 7-bit weights where the CPU lacks VNNI; int8 if ``symmetric``).
        reduce_range: 7-bit weights (ONNX Runtime's ``reduce_range``); None: chosen from the CPU.
        filename: Name of the INT8 model, ending in ``.onnx``.
        metric: Name of the module's torchmetrics attribute to compare, or a torchmetrics ``Metric``; None: found as
            above.
        on_metric_drop: ``"warn"``: write and warn by how much; ``"raise"``: write nothing and fail the fit.
        overwrite: Replace an existing export instead of writing a new version beside it.
        use_best_checkpoint: Export the best checkpoint's weights when a ``ModelCheckpoint`` monitors one.
        verify_batches: Verify on at most this many validation batches (None: all).
        latency_batch_size: The larger batch of the latency comparison (the other is 1).
        latency_repeats: Timed runs per model and batch size; 0 skips latency.
        inputs_from_batch: ``batch -> inputs`` (a tensor, a tuple in ``forward`` order or a dict by parameter
            name) for calibration and verification; the target is the batch's last item (or its ``labels``). Not
            needed for dict batches whose keys are ``forward``'s parameters (``input_ids``, ``attention_mask``,
            ``labels``): those keys are the inputs, ``labels`` the target.
        min_agreement: Required FP32/INT8 top-1 agreement, in (0, 1]; None: no check.
        max_fp32_layers: Most layers kept in FP32 to meet the budget (None: half the Conv/Gemm/MatMul; 0: never).

    Raises:
        ValueError: In ``__init__`` for a bad argument; in ``setup`` if ``metric`` names no metric of the module.
        ImportError: In ``setup`` without the ``export`` extra.
        RuntimeError: At the end of fit if the export fails (naming the operator and layer) or there is no
            validation data; `Int8VerificationError` with ``on_metric_drop="raise"``.

    Logged metrics (every Trainer logger, rank zero, once, at ``step=trainer.global_step``; see `int8_metrics`):
        ``speedkit/int8/fp32_mb``, ``int8_mb``, ``size_ratio``; ``latency_fp32_b{n}_ms``, ``latency_int8_b{n}_ms``,
        ``speedup_b{n}`` for n = 1 and ``latency_batch_size``; ``max_abs_diff``, ``top1_agreement``,
        ``metric_fp32``, ``metric_int8``, ``metric_drop`` (when known); ``fp32_layers`` and ``fp32_layers_bytes``
        (when layers were kept in FP32).

    Example:
        >>> import lightning as L
        >>> trainer = L.Trainer(logger=False, callbacks=[Int8Export("exports", symmetric=True)])
    """

    def __init__(
        self,
        dirpath: str | Path | None = None,
        calibration_batches: int = 32,
        symmetric: bool = False,
        verify: bool = True,
        max_metric_drop: float | None = 0.01,
        *,
        activation_type: str | None = None,
        reduce_range: bool | None = None,
        filename: str = "model.onnx",
        metric: str | Metric | None = None,
        on_metric_drop: str = "warn",
        overwrite: bool = False,
        use_best_checkpoint: bool = True,
        verify_batches: int | None = None,
        latency_batch_size: int = 32,
        latency_repeats: int = 10,
        inputs_from_batch: InputsFromBatch | None = None,
        min_agreement: float | None = None,
        max_fp32_layers: int | None = None,
    ) -> None:
        if calibration_batches is None:
            raise ValueError("`calibration_batches` must be a positive int, got None.")
        check_bool("use_best_checkpoint", use_best_checkpoint)
        check_export_args(
            symmetric=symmetric,
            verify=verify,
            overwrite=overwrite,
            activation_type=activation_type,
            reduce_range=reduce_range,
            calibration_batches=calibration_batches,
            max_metric_drop=max_metric_drop,
            on_metric_drop=on_metric_drop,
            verify_batches=verify_batches,
            latency_batch_size=latency_batch_size,
            latency_repeats=latency_repeats,
            inputs_from_batch=inputs_from_batch,
            min_agreement=min_agreement,
            max_fp32_layers=max_fp32_layers,
        )
        check_metric(metric, names=True)
        if dirpath is not None and (not isinstance(dirpath, (str, os.PathLike)) or not str(dirpath).strip()):
            raise ValueError(f"`dirpath` must be a directory path or None, got {dirpath!r}.")
        if (
            not isinstance(filename, str)
            or not filename.endswith(".onnx")
            or Path(filename).name != filename
            or filename == ".onnx"
        ):
            raise ValueError(f"`filename` must be a file name ending in '.onnx', got {filename!r}.")
        self.dirpath = None if dirpath is None else Path(dirpath)
        self.calibration_batches = calibration_batches
        self.symmetric = symmetric
        self.activation_type = activation_type
        self.reduce_range = reduce_range
        self.verify = verify
        self.max_metric_drop = max_metric_drop
        self.filename = filename
        self.metric = metric
        self.on_metric_drop = on_metric_drop
        self.overwrite = overwrite
        self.use_best_checkpoint = use_best_checkpoint
        self.verify_batches = verify_batches
        self.latency_batch_size = latency_batch_size
        self.latency_repeats = latency_repeats
        self.inputs_from_batch = inputs_from_batch
        self.min_agreement = min_agreement
        self.max_fp32_layers = max_fp32_layers
        self._resolved_dir: Path | None = None
        self._report: dict[str, Any] | None = None
        self._failure: dict[str, Any] | None = None

    @property
    @override
    def state_key(self) -> str:
        return cached_state_key(self, dirpath=str(self.dirpath), filename=self.filename)

    def report(self) -> dict[str, Any]:
        """The last export's report (on every rank) with ``exported``; ``passed`` and ``status`` say if it failed.

        After an export: `lightning_speedkit.int8.export_int8`'s report (what ``model.json`` holds: paths, sizes,
        latency, verification, ``passed``, ``status``, ``weights``, ...) plus ``exported: True``. An export that
        missed its accuracy target has ``passed: False`` and a ``status`` starting with ``FAILED``; with
        ``on_metric_drop="raise"`` nothing was written and the report has ``exported: False`` and the numbers.
        Before any export: ``exported: False`` and ``reason``.
        """
        if self._report is not None:
            return {"exported": True, **self._report}
        if self._failure is not None:
            return {"exported": False, **self._failure}
        return {"exported": False, "reason": "Int8Export exports at the end of fit; no fit has ended yet"}

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        import_export_deps()  # fail before training, not after it
        self._resolved_dir = self.dirpath if self.dirpath is not None else Path(trainer.default_root_dir) / "int8"
        problem = unwritable(self._resolved_dir) if trainer.is_global_zero else None
        problem = trainer.strategy.broadcast(problem, src=0)  # every rank fails together, before training
        if problem:
            raise ValueError(
                f"Int8Export: `dirpath` must be a writable directory, got {str(self._resolved_dir)!r}: {problem};"
                " choose another `dirpath` before training."
            )
        if isinstance(self.metric, str):
            metrics = metrics_of(pl_module)
            if self.metric not in metrics:
                raise ValueError(
                    f"Int8Export: `metric={self.metric!r}` names no torchmetrics Metric of {type(pl_module).__name__};"
                    f" pass one of {sorted(metrics)} or None."
                )

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for callback in trainer.callbacks:  # type: ignore[attr-defined]
            if callable(settle := getattr(callback, "settle_weights", None)):  # a guard's last check, an average
                settle(trainer, pl_module)  # in list order, each once: the export holds the weights the fit ends with
        failure: BaseException | None = None
        report: dict[str, Any] | None = None
        if trainer.is_global_zero:
            try:
                report = self._export(trainer, pl_module)
            except Exception as error:  # raised below, after the other ranks have heard of it
                failure = error
                report = error.report if isinstance(error, Int8VerificationError) else None
        message = None if failure is None else f"{type(failure).__name__}: {failure}"
        report, message = trainer.strategy.broadcast((report, message), src=0)  # the other ranks wait here
        if message is not None:
            self._failure = {**(report or {}), "reason": f"the export failed, nothing was written: {message}"}
            if report is not None:
                self._failure["status"] = f"FAILED: {drop_message(report)}; nothing was written (on_metric_drop=raise)"
            if failure is not None:
                raise failure
            raise RuntimeError(f"Int8Export: the export on rank 0 failed: {message}")
        self._report, self._failure = report, None
        if report is None or not trainer.is_global_zero:
            return
        log_rank_zero(trainer, int8_metrics(report))
        self._upload(trainer, report)
        rank_zero_info(f"Int8Export: {summary_line(report)}.")

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"report": self._report, "failure": self._failure}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._report = state_dict.get("report", self._report)
        self._failure = state_dict.get("failure", self._failure)

    def _export(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        module, weights = module_to_export(trainer, pl_module, self.use_best_checkpoint)
        loader = validation_loader(trainer, pl_module)
        with warnings.catch_warnings():  # the drop is reported below, once, in this class's name
            warnings.filterwarnings("ignore", message="export_int8: FAILED ")
            report = self._run_export(trainer, module, loader, weights)
        if not report["passed"]:
            rank_zero_warn(
                f"Int8Export: FAILED its accuracy target: {drop_message(report)}; {report['int8_path']}"
                " was written but is not verified to that target."
            )
        return report

    def _run_export(self, trainer: pl.Trainer, module: nn.Module, loader: Any, weights: str) -> dict[str, Any]:
        return export_int8(
            module,
            loader,
            self._target(),
            symmetric=self.symmetric,
            activation_type=self.activation_type,
            reduce_range=self.reduce_range,
            calibration_batches=self.calibration_batches,
            validation_data=loader,
            metric=self._find_metric(trainer, module),
            max_metric_drop=self.max_metric_drop,
            min_agreement=self.min_agreement,
            max_fp32_layers=self.max_fp32_layers,
            inputs_from_batch=self.inputs_from_batch,
            on_metric_drop=self.on_metric_drop,
            verify=self.verify,
            verify_batches=self.verify_batches,
            overwrite=self.overwrite,
            latency_batch_size=self.latency_batch_size,
            latency_repeats=self.latency_repeats,
            metadata={"weights": weights, "epoch": trainer.current_epoch, "global_step": trainer.global_step},
        )

    def _target(self) -> Path:
        """``dirpath/filename``, or with ``overwrite=False`` the first ``<stem>-v<k>.onnx`` that is free."""
        directory = self._resolved_dir or Path("int8")
        stem = Path(self.filename).stem
        candidate, version = directory / self.filename, 0
        while not self.overwrite and export_exists(candidate.absolute()):
            version += 1
            candidate = directory / f"{stem}-v{version}.onnx"
        return candidate

    def _find_metric(self, trainer: pl.Trainer, module: nn.Module) -> Metric | None:
        if self.metric is not None and not isinstance(self.metric, str):
            return self.metric
        metrics = metrics_of(module)
        if isinstance(self.metric, str):
            return metrics[self.metric]
        for callback in trainer.checkpoint_callbacks:
            monitor = getattr(callback, "monitor", None)
            if monitor in metrics:
                return metrics[monitor]
        named_val = [name for name in metrics if name.rsplit(".", 1)[-1].startswith("val")]
        return metrics[named_val[0]] if len(named_val) == 1 else None

    @staticmethod
    def _upload(trainer: pl.Trainer, report: dict[str, Any]) -> None:
        from lightning.pytorch.loggers import WandbLogger

        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger):
                import wandb

                run = logger.experiment
                artifact = wandb.Artifact(f"int8-{run.id}", type="model", metadata=int8_metrics(report))
                directory = Path(report["int8_path"]).parent
                for name in [*report["files"], Path(report["report_path"]).name]:
                    artifact.add_file(str(directory / name))
                run.log_artifact(artifact)
