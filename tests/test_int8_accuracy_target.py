"""An export that misses its accuracy target ends as failed: in the report, the file, the summary and the callback."""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import lightning as L
import pytest
from conftest import OutlierClassifier, outlier_mlp, tiny_trainer

from lightning_speedkit.int8 import Int8Export, export_int8
from lightning_speedkit.int8.report import summary_line


def test_an_accuracy_aware_export_that_misses_its_target_reports_passed_false(tmp_path: Path) -> None:
    """One FP32 layer allowed cannot meet 0.98: ``passed`` is False and the status says FAILED, in the file too."""
    net, data = outlier_mlp()
    with pytest.warns(UserWarning, match=r"export_int8: FAILED its accuracy target: INT8 top-1 agreement"):
        report = export_int8(net, data, tmp_path / "mlp.onnx", min_agreement=0.98, max_fp32_layers=1, latency_repeats=0)
    assert report["accuracy_aware"]["met"] is False
    assert report["passed"] is False
    assert report["status"].startswith("FAILED: INT8 top-1 agreement with FP32 is 0.")
    assert "verified" not in report["status"]
    assert json.loads((tmp_path / "mlp.json").read_text())["passed"] is False
    assert summary_line(report).startswith("FAILED its accuracy target: wrote ")


def test_a_met_target_says_what_held(tmp_path: Path) -> None:
    """A target met reads ``passed: ...`` with the bound that held."""
    net, data = outlier_mlp()
    report = export_int8(net, data, tmp_path / "mlp.onnx", min_agreement=0.98, max_fp32_layers=5, latency_repeats=0)
    assert report["passed"] is True
    assert re.fullmatch(r"passed: top-1 agreement (0\.9[89]|1\.0)\d* >= min_agreement=0\.98", report["status"])


def test_the_callback_and_its_summary_say_a_missed_target_failed(tmp_path: Path) -> None:
    """Int8Export's report (what the run summary gets) has ``passed: False`` and a FAILED status; one warning."""
    L.seed_everything(0, verbose=False)
    export = Int8Export(tmp_path / "int8", calibration_batches=1, latency_repeats=0, max_fp32_layers=0)
    trainer = tiny_trainer(tmp_path, max_epochs=3, num_sanity_val_steps=0, callbacks=[export])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(OutlierClassifier())
    failed = [str(w.message) for w in caught if "FAILED" in str(w.message)]
    assert len(failed) == 1
    assert failed[0].startswith("Int8Export: FAILED its accuracy target: INT8 top1_accuracy is ")
    assert "is not verified to that target" in failed[0]
    report = export.report()
    assert report["exported"] is True
    assert report["passed"] is False
    assert report["status"].startswith("FAILED: ")
    assert "verified" not in report["status"]


def test_with_raise_the_callback_reports_the_failure_and_writes_nothing(tmp_path: Path) -> None:
    """``on_metric_drop="raise"``: the fit fails, nothing is written, and ``report()`` holds the numbers and why."""
    L.seed_everything(0, verbose=False)
    export = Int8Export(tmp_path / "int8", calibration_batches=1, latency_repeats=0, on_metric_drop="raise")
    trainer = tiny_trainer(tmp_path, max_epochs=3, num_sanity_val_steps=0, callbacks=[export])
    with pytest.raises(RuntimeError, match="more than max_metric_drop"):
        trainer.fit(OutlierClassifier())
    assert list((tmp_path / "int8").iterdir()) == []
    report = export.report()
    assert report["exported"] is False
    assert report["passed"] is False
    assert report["status"].startswith("FAILED: ")
    assert report["status"].endswith("nothing was written (on_metric_drop=raise)")
    assert report["verification"]["metric_fp32"] > report["verification"]["metric_int8"]


def test_an_int8_file_larger_than_the_fp32_one_is_called_larger() -> None:
    """A small model whose INT8 file outweighs its FP32 one reads "1.37x larger", not "0.73x smaller"."""
    report = {"int8_path": "m.onnx", "size_ratio": 0.73, "verification": None, "metric_drop": None}
    assert summary_line(report) == "wrote m.onnx (1.37x larger than FP32) from the model"
    assert summary_line({**report, "size_ratio": 4.0}).startswith("wrote m.onnx (4.00x smaller than FP32)")
