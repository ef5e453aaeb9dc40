"""A damaged packed cache is found and rebuilt, or fails clearly; a damaged sample is never served.

Real files on disk, damaged the way a disk, a full file system or a careless `truncate` would: no mocks.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_speedkit.data import CacheDamagedError, CachedDataset

DATA = "samples.npy"


class Images:
    """``n`` decoded 32x32 RGB images with labels, 3 KiB a sample: a 4 KiB overwrite spans two or three samples."""

    def __init__(self, n: int = 16) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[np.ndarray[Any, Any], int]:
        return np.random.default_rng(i).integers(0, 256, (32, 32, 3), dtype=np.uint8), i % 10


class Gone(Images):
    """The same data set after its files were deleted: every read fails."""

    def __getitem__(self, i: int) -> tuple[np.ndarray[Any, Any], int]:
        raise FileNotFoundError(f"image {i} is gone")


def _serves_the_source(cached: CachedDataset) -> bool:
    source = Images(len(cached))
    return all(np.array_equal(cached[i][0], source[i][0]) and cached[i][1] == source[i][1] for i in range(len(cached)))


def _overwrite_4k(cached: CachedDataset) -> list[int]:
    """Overwrite 4 KiB of the data file in place, from inside sample 2; return the samples it touches."""
    manifest = json.loads((cached.directory / "manifest.json").read_text())
    offset, row_bytes = manifest["data_offset"], manifest["row_bytes"]
    start = offset + 2 * row_bytes + 100
    with open(cached.directory / DATA, "r+b") as handle:
        handle.seek(start)
        handle.write(np.random.default_rng(1).bytes(4096))
    return list(range((start - offset) // row_bytes, (start + 4095 - offset) // row_bytes + 1))


@pytest.mark.parametrize("in_memory", [False, True])
def test_bytes_overwritten_in_place_fail_the_read_naming_cache_file_and_sample(tmp_path: Path, in_memory: bool) -> None:
    """After 4 KiB are overwritten in place, each read of a touched sample raises naming it; the others read fine."""
    cached = CachedDataset(Images(), tmp_path)
    touched = _overwrite_4k(cached)
    reopened = CachedDataset(Images(), tmp_path, in_memory=in_memory)  # the sizes still match: opens
    failed = {}
    for index in range(len(reopened)):
        try:
            sample = reopened[index]
        except CacheDamagedError as error:
            failed[index] = error
            continue
        assert np.array_equal(sample[0], Images()[index][0])
    assert list(failed) == touched
    for index, error in failed.items():
        assert (error.directory, error.file, error.index) == (cached.directory, DATA, index)
        assert f"the cache {cached.directory} is damaged ({DATA}, sample {index})" in str(error)


def test_verify_names_the_first_damaged_sample_and_the_next_open_rebuilds(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``verify()`` reads every byte and names the first overwritten sample; the next CachedDataset rebuilds it."""
    cached = CachedDataset(Images(), tmp_path)
    cached.verify()
    touched = _overwrite_4k(cached)
    with pytest.raises(CacheDamagedError, match=f"sample {touched[0]}") as caught:
        cached.verify()
    assert (caught.value.directory, caught.value.file, caught.value.index) == (cached.directory, DATA, touched[0])
    with caplog.at_level(logging.WARNING, logger="lightning_speedkit.data.cache"):
        rebuilt = CachedDataset(Images(), tmp_path)
    assert "rebuilding it" in caplog.text
    assert _serves_the_source(rebuilt)
    rebuilt.verify()


def test_a_changed_header_fails_verify(tmp_path: Path) -> None:
    """A byte changed in the data file's header (no sample touched) fails ``verify()``'s SHA-256 of the file."""
    cached = CachedDataset(Images(), tmp_path)
    with open(cached.directory / DATA, "r+b") as handle:
        handle.seek(60)  # the header's padding
        handle.write(b"#")
    with pytest.raises(CacheDamagedError, match="SHA-256"):
        cached.verify()


def _truncate_data(directory: Path) -> None:
    with open(directory / DATA, "r+b") as handle:
        handle.truncate((directory / DATA).stat().st_size // 2)


def _truncate_manifest(directory: Path) -> None:
    text = (directory / "manifest.json").read_text()
    (directory / "manifest.json").write_text(text[: len(text) // 2])


def _garble_manifest(directory: Path) -> None:
    data = bytearray((directory / "manifest.json").read_bytes())
    data[len(data) // 2 : len(data) // 2 + 8] = b"\x00\xff#!{]\x00\x01"
    (directory / "manifest.json").write_bytes(bytes(data))


def _edit_manifest(directory: Path) -> None:
    text = (directory / "manifest.json").read_text()
    (directory / "manifest.json").write_text(text.replace('"length": 16', '"length": 15'))


def _delete_data(directory: Path) -> None:
    (directory / DATA).unlink()


@pytest.mark.parametrize(
    ("damage", "file"),
    [
        (_truncate_data, DATA),
        (_truncate_manifest, "manifest.json"),
        (_garble_manifest, "manifest.json"),
        (_edit_manifest, "manifest.json"),
        (_delete_data, DATA),
    ],
    ids=["truncated data", "truncated manifest", "garbled manifest", "edited manifest", "missing data"],
)
def test_a_cache_damaged_before_opening_is_rebuilt(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: Any, file: str
) -> None:
    """A truncated or missing data file, or a truncated, garbled or edited manifest, is found on open and rebuilt."""
    damage(CachedDataset(Images(), tmp_path).directory)
    with caplog.at_level(logging.WARNING, logger="lightning_speedkit.data.cache"):
        cached = CachedDataset(Images(), tmp_path)
    assert f"is damaged ({file})" in caplog.text
    assert _serves_the_source(cached)
    cached.verify()


@pytest.mark.parametrize("damage", [_truncate_data, _garble_manifest], ids=["truncated data", "garbled manifest"])
def test_a_damaged_cache_without_its_source_fails_naming_cache_and_file(tmp_path: Path, damage: Any) -> None:
    """When the source can no longer be read, a damaged cache raises CacheDamagedError naming the cache and file."""
    directory = CachedDataset(Images(), tmp_path, fingerprint="v1").directory
    damage(directory)
    with pytest.raises(CacheDamagedError, match="rebuilding it from `source` failed") as caught:
        CachedDataset(Gone(), tmp_path, fingerprint="v1")
    assert str(directory) in str(caught.value)
    assert caught.value.file in {DATA, "manifest.json"}
    assert isinstance(caught.value.__cause__, FileNotFoundError)


def _truncate_while_open(root: str, report: str) -> None:
    """In a child process: open the cache, truncate its files, read the last sample; write what happened."""
    cached = CachedDataset(Images(), root)
    cached[0]  # the file is open
    for path in Path(cached.directory).glob("*.npy"):
        with open(path, "r+b") as handle:
            handle.truncate(path.stat().st_size // 2)
    try:
        cached[len(cached) - 1]
    except Exception as error:
        Path(report).write_text(f"{type(error).__name__} {error}")


def test_a_file_truncated_while_open_fails_the_read_without_killing_the_process(tmp_path: Path) -> None:
    """Truncating the data file under an open dataset gives a CacheDamagedError, not SIGBUS; the next open rebuilds."""
    report = tmp_path / "report.txt"
    child = multiprocessing.get_context("fork").Process(target=_truncate_while_open, args=(str(tmp_path), str(report)))
    child.start()
    child.join(timeout=120)
    assert child.exitcode == 0, f"the reading process ended with exit status {child.exitcode} (-7: SIGBUS)"
    directory = CachedDataset(Images(), tmp_path).directory
    message = report.read_text()
    assert message.startswith("CacheDamagedError")
    assert f"{directory} is damaged ({DATA}, sample 15)" in message
    assert "truncated" in message
    assert _serves_the_source(CachedDataset(Images(), tmp_path))


def test_a_file_removed_before_the_first_read_fails_it_naming_the_cache(tmp_path: Path) -> None:
    """The data file removed under an open dataset, before any read: CacheDamagedError, not a bare FileNotFoundError."""
    cached = CachedDataset(Images(), tmp_path)
    (cached.directory / DATA).unlink()
    with pytest.raises(CacheDamagedError, match=f"{DATA}, sample 3.*cannot be opened"):
        cached[3]
    assert _serves_the_source(CachedDataset(Images(), tmp_path))


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_a_worker_that_reads_a_damaged_sample_raises_in_the_main_process(tmp_path: Path, context: str) -> None:
    """A DataLoader worker (forked or spawned) serves intact samples and raises CacheDamagedError on a damaged one."""
    cached = CachedDataset(Images(), tmp_path)
    with open(cached.directory / DATA, "r+b") as handle:  # the last sample's last bytes
        handle.seek(-16, 2)
        handle.write(b"\xff" * 16)
    batches = iter(DataLoader(cached, batch_size=4, num_workers=1, multiprocessing_context=context))
    pixels, labels = next(batches)
    assert torch.equal(pixels, torch.stack([torch.from_numpy(Images()[i][0]) for i in range(4)]))
    assert labels.tolist() == [0, 1, 2, 3]
    with pytest.raises(CacheDamagedError, match="sample 15"):
        for _ in batches:
            pass
