"""INT8 export: ONNX, static QDQ quantization calibrated on real batches, verified in ONNX Runtime, with a report.

`export_int8` is the pure function (model + batches -> files + report dict); `Int8Export` runs it at the end of
fit on the best checkpoint. Models with several inputs (``input_ids``, ``attention_mask``) take a tuple or dict
``example_input`` and an ``inputs_from_batch`` function (`lightning_speedkit.int8.inputs`). With an accuracy budget
the most sensitive layers stay in FP32 (`lightning_speedkit.int8.sensitivity`). `lightning_speedkit.int8.steps`
holds the individual steps.
"""

from lightning_speedkit.int8.callback import Int8Export
from lightning_speedkit.int8.export import (
    ACTIONS_ON_METRIC_DROP,
    ACTIVATION_TYPES,
    Int8VerificationError,
    export_int8,
    export_paths,
)
from lightning_speedkit.int8.inputs import named_inputs
from lightning_speedkit.int8.report import int8_metrics
from lightning_speedkit.int8.sensitivity import keep_sensitive_layers

__all__ = [
    "ACTIONS_ON_METRIC_DROP",
    "ACTIVATION_TYPES",
    "Int8Export",
    "Int8VerificationError",
    "export_int8",
    "export_paths",
    "int8_metrics",
    "keep_sensitive_layers",
    "named_inputs",
]
