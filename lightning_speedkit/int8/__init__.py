"""INT8 export: ONNX, static QDQ quantization calibrated on real batches, verified in ONNX Runtime, with a report.

`export_int8` is the pure function (model + batches -> files + report dict); `Int8Export` runs it at the end of
fit on the best checkpoint. `lightning_speedkit.int8.steps` holds the individual steps.
"""

from lightning_speedkit.int8.callback import Int8Export, int8_metrics
from lightning_speedkit.int8.export import (
    ACTIONS_ON_METRIC_DROP,
    ACTIVATION_TYPES,
    Int8VerificationError,
    export_int8,
    export_paths,
)

__all__ = [
    "ACTIONS_ON_METRIC_DROP",
    "ACTIVATION_TYPES",
    "Int8Export",
    "Int8VerificationError",
    "export_int8",
    "export_paths",
    "int8_metrics",
]
