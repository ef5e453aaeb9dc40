"""INT8 export: ONNX, static QDQ quantization calibrated on real batches, verified in ONNX Runtime, with a report.

`export_int8` is the pure function (model + batches -> files + report dict); `Int8Export` runs it at the end of
fit on the best checkpoint. The INT8 format follows the CPU (`int8_format`: 7-bit weights on x86 without VNNI).
Models with several inputs (``input_ids``, ``attention_mask``) take a tuple or dict ``example_input``, and dict
batches keyed by ``forward``'s parameters or an ``inputs_from_batch`` function (`lightning_speedkit.int8.inputs`).
With an accuracy budget the most sensitive layers stay in FP32 (`lightning_speedkit.int8.sensitivity`). An export is
switched into place as a whole (`lightning_speedkit.int8.place`). `lightning_speedkit.int8.steps` holds the steps.
"""

from lightning_speedkit.int8.args import ACTIONS_ON_METRIC_DROP, ACTIVATION_TYPES, ExportPathError
from lightning_speedkit.int8.callback import Int8Export
from lightning_speedkit.int8.export import Int8VerificationError, export_int8
from lightning_speedkit.int8.formats import Int8Format, int8_format
from lightning_speedkit.int8.inputs import named_inputs
from lightning_speedkit.int8.place import export_paths
from lightning_speedkit.int8.report import int8_metrics
from lightning_speedkit.int8.sensitivity import keep_sensitive_layers

__all__ = [
    "ACTIONS_ON_METRIC_DROP",
    "ACTIVATION_TYPES",
    "ExportPathError",
    "Int8Export",
    "Int8Format",
    "Int8VerificationError",
    "export_int8",
    "export_paths",
    "int8_format",
    "int8_metrics",
    "keep_sensitive_layers",
    "named_inputs",
]
