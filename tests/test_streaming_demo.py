"""The demo and the benchmark on litdata: ``speedkit demo --data streaming`` and ``benchmarks/streaming.py --quick``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

litdata = pytest.importorskip("litdata")

from conftest import load_benchmark  # noqa: E402

from lightning_speedkit.cli import main  # noqa: E402
from lightning_speedkit.demo.data import DemoDataModule  # noqa: E402


def test_demo_datamodule_streams_the_same_split_from_litdata(demo_cache: Path) -> None:
    """With streaming=True the demo's splits come from litdata's format, written once, with the same images."""
    files = DemoDataModule(num_images=60, batch_size=8, root=demo_cache)
    files.prepare_data()
    files.setup("fit")
    streaming = DemoDataModule(num_images=60, batch_size=8, root=demo_cache, streaming=True)
    streaming.prepare_data()
    streaming.setup("fit")
    loader = streaming.train_dataloader()
    assert isinstance(loader, litdata.StreamingDataLoader)
    assert len(streaming.train_set) == len(files.train_set) == 48  # type: ignore[arg-type]
    x, _ = next(iter(loader))
    assert tuple(x.shape) == (8, 3, 56, 56)
    val_labels = sorted(int(label) for _, batch in streaming.val_dataloader() for label in batch)
    assert val_labels == sorted(int(files.val_set[i][1]) for i in range(12))  # type: ignore[index]
    written = sorted(p.name for p in next(demo_cache.glob("shapes-*n60-*")).joinpath("litdata").iterdir())
    streaming.prepare_data()  # a second run reuses the written copies
    assert sorted(p.name for p in next(demo_cache.glob("shapes-*n60-*")).joinpath("litdata").iterdir()) == written


def test_a_damaged_streaming_copy_is_written_again(tmp_path: Path) -> None:
    """A copy with a chunk missing (an interrupted copy, a clean-up) is written again, not refused for good.

    The check found it damaged, and the write refused an existing directory ("pass overwrite=True"), which no demo
    flag passes: every later ``speedkit demo --data streaming`` died there.
    """
    from lightning_speedkit.data.streaming import check_streaming_dir
    from lightning_speedkit.demo.data import DecodedShapes, ensure_shapes, ensure_streaming

    directory = ensure_shapes(20, image_size=32, root=tmp_path)
    decoded = DecodedShapes(directory, list(range(10)))
    target = ensure_streaming(decoded, directory)
    for chunk in target.glob("chunk-*.bin"):
        chunk.unlink()
    assert ensure_streaming(decoded, directory) == target
    assert check_streaming_dir(target) == target


@pytest.mark.slow
def test_speedkit_demo_trains_from_streaming_data(
    tmp_path: Path, demo_cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``speedkit demo --data streaming`` trains both runs from litdata and says so in demo.json."""
    out = tmp_path / "out"
    argv = ["demo", "--quick", "--data", "streaming", "--num-images", "100", "--max-epochs", "1", "--out", str(out)]
    assert main([*argv, "--cache-dir", str(demo_cache)]) == 0
    report = json.loads((out / "demo.json").read_text())
    assert report["config"]["data"] == "streaming"
    assert [run["epochs"] for run in report["runs"].values()] == [1, 1]
    assert "baseline" in capsys.readouterr().out


def test_a_bad_data_flag_is_refused() -> None:
    """``--data`` takes files or streaming; anything else exits with status 2 before any work."""
    with pytest.raises(SystemExit) as exit_:
        main(["demo", "--data", "s3"])
    assert exit_.value.code == 2


@pytest.mark.slow
def test_streaming_benchmark_runs_in_quick_mode(tmp_path: Path, demo_cache: Path) -> None:
    """The benchmark's quick mode fits every setting once and writes their rows, the preparation and versions."""
    out = tmp_path / "streaming.json"
    result = load_benchmark("streaming").main(["--quick", "--out", str(out), "--cache-dir", str(demo_cache)])
    saved = json.loads(out.read_text())
    assert [row["setting"] for row in saved["rows"]] == [
        "streaming naive",
        "streaming + DataLoaderTuner",
        "streaming + preset()",
        "CachedDataset naive",
        "CachedDataset + preset()",
    ]
    assert [row["loader"] for row in saved["rows"]] == ["StreamingDataLoader"] * 3 + ["DataLoader"] * 2
    assert all(row["fit_s"] > 0 and row["steps"] > 0 and len(row["load_1m"]) == 2 for row in saved["rows"])
    assert saved["rows"][0]["fit_ratio"] == 1.0
    assert saved["rows"][1]["tuner"]["reason"]
    assert saved["prepare"]["litdata_optimize_s"] > 0
    assert saved["versions"]["litdata"] == litdata.__version__
    assert result["num_images"] == 300
