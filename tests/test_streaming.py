"""litdata streaming, on real litdata in a temporary directory.

The version and directory checks, write_streaming, the loader rebuild, the tuner's plan pieces, the monitor's advice.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

litdata = pytest.importorskip("litdata")

from lightning_speedkit.data import CachedDataset  # noqa: E402
from lightning_speedkit.data.streaming import (  # noqa: E402
    LITDATA_RANGE,
    StreamingFormatError,
    check_litdata_version,
    check_streaming_dir,
    is_streaming_loader,
    require_litdata,
    streaming_dataset,
    write_streaming,
)
from lightning_speedkit.dataloader import rebuild_dataloader, settings_name  # noqa: E402
from lightning_speedkit.dataloader.streaming import (  # noqa: E402
    rebuild_streaming,
    streaming_candidates,
    streaming_settings,
    untuned_settings,
)
from lightning_speedkit.monitor.diagnosis import LoaderSettings, diagnose  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from streaming_fit import Numbered, write_numbered  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def numbered(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """64 numbered samples in litdata's format, written once for the module."""
    return write_numbered(tmp_path_factory.mktemp("streaming") / "numbered")


def _indices(batches: Any) -> list[int]:
    return [int(i) for batch in batches for i in batch[2]]


@pytest.mark.parametrize("version", ["0.2.70", "0.2.76", "0.2.99"])
def test_supported_litdata_versions_pass(version: str) -> None:
    """A litdata version inside the supported range is accepted as it is."""
    assert check_litdata_version(version) == version


@pytest.mark.parametrize("version", ["0.2.69", "0.3.0", "1.0", "not-a-version"])
def test_unsupported_litdata_versions_name_the_version_and_the_range(version: str) -> None:
    """A litdata version outside the range (or unparsable) is refused, naming it and the supported range."""
    with pytest.raises(ValueError, match=f"litdata {version} is not supported") as error:
        check_litdata_version(version)
    assert LITDATA_RANGE in str(error.value)


def test_the_installed_litdata_is_checked_when_used(monkeypatch: pytest.MonkeyPatch, numbered: Path) -> None:
    """Opening a dataset checks the installed litdata's version: an unsupported one is an error naming it."""
    assert require_litdata() is litdata
    monkeypatch.setattr(litdata, "__version__", "0.9.1")
    with pytest.raises(ValueError, match=r"litdata 0\.9\.1 is not supported: .*>=0\.2\.70,<0\.3"):
        streaming_dataset(numbered)


def test_bad_directories_are_errors_naming_the_path(tmp_path: Path) -> None:
    """A missing path, a file, a directory without index.json, or an index with no chunks: errors naming the path."""
    missing = tmp_path / "nowhere"
    with pytest.raises(StreamingFormatError, match=f"{missing}.* does not exist"):
        streaming_dataset(missing)
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(StreamingFormatError, match=f"{afile}.* is not a directory"):
        check_streaming_dir(afile)
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "data.csv").write_text("1,2\n")
    with pytest.raises(StreamingFormatError, match=f"{plain}.* is not a litdata dataset: it has no index.json"):
        streaming_dataset(plain)
    (plain / "index.json").write_text(json.dumps({"chunks": [], "config": None}))
    with pytest.raises(StreamingFormatError, match=f"{plain}.* lists no chunks"):
        check_streaming_dir(plain)
    (plain / "index.json").write_text("{not json")
    with pytest.raises(StreamingFormatError, match=f"{plain}.* unreadable"):
        check_streaming_dir(plain)


def test_write_streaming_round_trips_every_sample(numbered: Path) -> None:
    """Every sample written by write_streaming reads back equal, in index order, from a StreamingDataset."""
    source, dataset = Numbered(), streaming_dataset(numbered)
    assert len(dataset) == len(source)
    for index in (0, 17, len(source) - 1):
        x, y, i = dataset[index]
        np.testing.assert_array_equal(np.asarray(x), source[index][0])
        assert (int(y), int(i)) == source[index][1:]


def test_write_streaming_refuses_an_existing_directory_and_leaves_no_staging(numbered: Path) -> None:
    """An existing output directory is not overwritten unless asked; no staging directory is left beside it."""
    with pytest.raises(ValueError, match="already exists; pass overwrite=True"):
        write_streaming(Numbered(), numbered)
    assert not [p for p in numbered.parent.iterdir() if ".staging-" in p.name]


def test_a_cached_dataset_moves_to_litdata_without_its_transform(tmp_path: Path) -> None:
    """A CachedDataset is written as its packed (decoded) rows; its per-sample transform is left to the reader."""
    source = [(torch.full((2, 3), float(i)), i) for i in range(12)]
    cached = CachedDataset(source, tmp_path / "cache", transform=lambda s: (s[0] * 0 - 1, s[1]))
    out = write_streaming(cached, tmp_path / "litdata", chunk_bytes="128B", start_method="fork")
    dataset = streaming_dataset(out)
    assert len(dataset) == 12
    x, y = dataset[5]
    assert torch.equal(torch.as_tensor(x), source[5][0])
    assert int(y) == 5
    assert cached.transform is not None  # the user's dataset keeps its transform


def test_rebuilding_a_streaming_loader_mid_epoch_keeps_its_state(numbered: Path) -> None:
    """A StreamingDataLoader rebuilt mid-epoch with other workers goes on where it stopped: every sample once."""
    loader = litdata.StreamingDataLoader(streaming_dataset(numbered, shuffle=True), batch_size=4)
    iterator = iter(loader)
    first = _indices(next(iterator) for _ in range(5))
    rebuilt = rebuild_dataloader(loader, {"num_workers": 2, "prefetch_factor": 4})
    del iterator
    assert type(rebuilt) is litdata.StreamingDataLoader
    assert (rebuilt.num_workers, rebuilt.prefetch_factor, rebuilt.batch_size) == (2, 4, 4)
    rest = _indices(rebuilt)
    assert sorted(first + rest) == list(range(64))
    assert loader.dataset.num_workers == 1  # the user's dataset keeps its own worker count


def test_a_streaming_loader_rebuilt_after_a_whole_epoch_starts_the_next(numbered: Path) -> None:
    """A loader iterated to its end, rebuilt with workers: the next epoch, every sample once (no state carried).

    litdata counts a partial last batch whole (65 of 64 samples here): the finished epoch's state was carried as a
    place mid-epoch, and the rebuilt loader's worker failed ("num_samples_yielded ... greater than the dataset length").
    """
    loader = litdata.StreamingDataLoader(streaming_dataset(numbered), batch_size=5)
    assert sorted(_indices(loader)) == list(range(64))
    rebuilt = rebuild_dataloader(loader, {"num_workers": 2, "prefetch_factor": 2})
    assert sorted(_indices(rebuilt)) == list(range(64))


def test_a_fresh_streaming_loader_rebuilt_yields_the_same_epoch(numbered: Path) -> None:
    """Rebuilt before it is used, a streaming loader yields the same shuffled epoch as the user's loader."""
    loader = litdata.StreamingDataLoader(streaming_dataset(numbered, shuffle=True, seed=3), batch_size=8)
    rebuilt = rebuild_streaming(loader, {"num_workers": 0})
    assert _indices(rebuilt) == _indices(loader)


def test_streaming_settings_candidates_and_what_is_not_tuned(numbered: Path) -> None:
    """On a local streaming loader: its settings, the candidates (workers, prefetch), and the settings left alone."""
    loader = litdata.StreamingDataLoader(streaming_dataset(numbered), batch_size=4, num_workers=1)
    assert is_streaming_loader(loader)
    assert not is_streaming_loader(torch.utils.data.DataLoader(range(3)))
    baseline = streaming_settings(loader)
    assert baseline == {"num_workers": 1, "persistent_workers": False, "prefetch_factor": 2, "pin_memory": False}
    names = [settings_name(c) for c in streaming_candidates(4, baseline)]
    assert len(names) == len(set(names)) == 5  # 0, 1, 2, 4 workers, and 4 with prefetch 4
    assert all("persistent_workers=False" in n for n in names)
    remote = streaming_candidates(2, {**baseline, "max_pre_download": 2})
    assert {c["max_pre_download"] for c in remote} == {2, 4}
    notes = untuned_settings(loader)
    assert [n.split(":")[0] for n in notes] == ["chunk size", "max_cache_size", "max_pre_download"]


def test_monitor_advice_for_a_data_bound_streaming_loader(numbered: Path) -> None:
    """A data-bound streaming loader gets litdata's levers as advice (chunks, workers), not persistent_workers."""
    loader = litdata.StreamingDataLoader(streaming_dataset(numbered), batch_size=4)
    settings = LoaderSettings.from_loader(loader, cores=4)
    assert (settings.streaming, settings.remote) == (True, False)
    advice = diagnose(0.6, loader=settings).advice
    assert advice.startswith("data_bound: 60% of each step waits for data; a litdata StreamingDataLoader")
    assert "num_workers=4" in advice
    assert "larger chunks" in advice
    assert "persistent_workers" not in advice
    remote = diagnose(0.6, loader=LoaderSettings(streaming=True, remote=True)).advice
    assert "max_pre_download" in remote
    assert "max_cache_size" in remote


def test_without_litdata_the_pack_imports_and_says_which_extra_to_install() -> None:
    """With litdata unimportable the pack imports and tunes plain loaders; streaming asks for the [streaming] extra."""
    code = """
import sys
sys.modules["litdata"] = None  # as if it were not installed
import lightning_speedkit
from lightning_speedkit.data.streaming import is_streaming_loader, require_litdata
from lightning_speedkit.dataloader import rebuild_dataloader
from torch.utils.data import DataLoader
print(rebuild_dataloader(DataLoader(list(range(4))), {"num_workers": 0}).num_workers, is_streaming_loader(None))
try:
    require_litdata()
except ImportError as error:
    print(error)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "0 False"
    assert "pip install 'lightning-speedkit[streaming]'" in lines[1]
