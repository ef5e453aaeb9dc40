"""Tests of the packed, memory-mapped cache of decoded samples."""

from __future__ import annotations

import dataclasses
import functools
import multiprocessing
import operator
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import refusing_files
from torch.utils.data import DataLoader, Dataset, IterableDataset

from lightning_speedkit.data import CacheBudgetError, CachedDataset, callable_fingerprint, dataset_fingerprint
from lightning_speedkit.demo.data import DemoDataModule


class Source:
    """A small decoded dataset: ``(uint8 4x4x3 array, float tensor, int label)``; ``offset`` changes its content."""

    def __init__(self, n: int = 12, offset: int = 0, log: Path | None = None) -> None:
        self.n, self.offset, self.log = n, offset, log

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[np.ndarray[Any, Any], torch.Tensor, int]:
        if self.log is not None:
            with open(self.log, "a") as handle:
                handle.write(f"{i}\n")
        pixels = np.full((4, 4, 3), (i * 7 + self.offset) % 256, dtype=np.uint8)
        return pixels, torch.arange(3, dtype=torch.float32) + i, i % 3


def double_first(sample: tuple[Any, ...]) -> tuple[Any, ...]:
    return (sample[0] * 2, *sample[1:])


def triple_first(sample: tuple[Any, ...]) -> tuple[Any, ...]:
    return (sample[0] * 3, *sample[1:])


def _same(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    """Equal values of the same types and dtypes (a numpy scalar comes back as one, of its dtype)."""
    pairs = zip(a, b, strict=True)
    return all(
        np.array_equal(np.asarray(x), np.asarray(y))
        and type(x) is type(y)
        and np.asarray(x).dtype == np.asarray(y).dtype
        for x, y in pairs
    )


class Numbers:
    """Samples of one number of each kind a row holds (bool, ints, floats, complex), beside a tensor and an array."""

    def __len__(self) -> int:
        return 5

    def __getitem__(self, i: int) -> tuple[Any, ...]:
        numbers = (bool(i % 2), np.uint8(i), np.int16(-i), np.float16(i / 2), np.float32(i / 3), -i / 7, complex(i, 1))
        numpy = (np.bool_(i % 2), np.complex64(i), np.array(i / 4, dtype=np.float32))  # a 0-d array stays one
        tensor = torch.full((2,), i, dtype=torch.bfloat16).float()
        return (tensor, *numbers, *numpy, np.arange(i, i + 3, dtype=np.int32))


@pytest.mark.parametrize("source", [Source(), Numbers()], ids=["images", "numbers"])
def test_cache_returns_the_source_samples(tmp_path: Path, source: Any) -> None:
    """Every cached sample equals the source sample, field by field, with the same types."""
    cached = CachedDataset(source, tmp_path)
    assert len(cached) == len(source)
    assert all(_same(cached[i], source[i]) for i in range(len(source)))


def test_a_collated_batch_of_the_cache_has_the_sources_dtypes(tmp_path: Path) -> None:
    """The numpy scalar fields came back as Python numbers: a float32 target collated to float64, an int16 to int64."""
    source = [(torch.full((2,), i / 3), np.float32(i / 3), np.int16(i), np.array(i / 4, np.float32)) for i in range(6)]
    cached = CachedDataset(source, tmp_path)
    theirs, ours = next(iter(DataLoader(source, batch_size=6))), next(iter(DataLoader(cached, batch_size=6)))
    assert [t.dtype for t in ours] == [t.dtype for t in theirs]
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))


def test_transform_runs_after_the_cache_and_pre_transform_before(tmp_path: Path) -> None:
    """``pre_transform`` output is what is stored; ``transform`` runs on every access."""
    calls: list[int] = []

    def transform(sample: tuple[Any, ...]) -> tuple[Any, ...]:
        calls.append(1)
        return sample

    cached = CachedDataset(Source(), tmp_path, pre_transform=double_first, transform=transform)
    assert np.array_equal(cached[5][0], Source()[5][0] * 2)
    cached[5]
    assert len(calls) == 2


def test_single_field_samples(tmp_path: Path) -> None:
    """A dataset of bare tensors comes back as bare tensors."""
    source = [torch.full((2,), float(i)) for i in range(5)]
    cached = CachedDataset(source, tmp_path)
    assert torch.equal(cached[4], source[4])


def test_second_use_reuses_the_cache(tmp_path: Path) -> None:
    """A second CachedDataset over the same source and pre-transform reads the existing files instead of decoding."""
    log = tmp_path / "calls.txt"
    first = CachedDataset(Source(log=log), tmp_path / "cache", pre_transform=double_first)
    decoded = log.read_text().count("\n")
    second = CachedDataset(Source(log=log), tmp_path / "cache", pre_transform=double_first)
    assert second.directory == first.directory
    assert log.read_text().count("\n") - decoded <= 8  # only the fingerprint's probes, no rebuild


def test_cache_is_rebuilt_when_source_or_pre_transform_changes(tmp_path: Path) -> None:
    """A changed source or a changed pre-transform gets a new cache; the old one is not served."""
    base = CachedDataset(Source(), tmp_path, pre_transform=double_first)
    changed_source = CachedDataset(Source(offset=1), tmp_path, pre_transform=double_first)
    changed_transform = CachedDataset(Source(), tmp_path, pre_transform=triple_first)
    assert len({base.directory, changed_source.directory, changed_transform.directory}) == 3
    assert np.array_equal(changed_source[3][0], Source(offset=1)[3][0] * 2)
    assert np.array_equal(changed_transform[3][0], Source()[3][0] * 3)


def test_fingerprints_are_stable_and_sensitive() -> None:
    """Fingerprints repeat for the same input and differ for different content or transforms."""
    assert dataset_fingerprint(Source()) == dataset_fingerprint(Source())
    assert dataset_fingerprint(Source()) != dataset_fingerprint(Source(offset=1))
    assert callable_fingerprint(double_first) != callable_fingerprint(triple_first)


def _scaled(sample: tuple[Any, ...], factor: float) -> tuple[Any, ...]:
    return (sample[0] * factor, *sample[1:])


def _make_scaled(factor: float) -> Any:
    def pre(sample: tuple[Any, ...]) -> tuple[Any, ...]:
        return _scaled(sample, factor)

    return pre


class _Scale:
    """A callable transform object holding a value and another transform (as a ``Compose`` holds its steps)."""

    def __init__(self, factor: float) -> None:
        self.factor, self.then = factor, functools.partial(_scaled, factor=1.0)

    def __call__(self, sample: tuple[Any, ...]) -> tuple[Any, ...]:
        return self.then(_scaled(sample, self.factor))


@dataclasses.dataclass(slots=True)
class _SlotScale:
    """A callable transform whose value is in a slot, not in a ``__dict__``."""

    factor: float

    def __call__(self, sample: tuple[Any, ...]) -> tuple[Any, ...]:
        return _scaled(sample, self.factor)


@pytest.mark.parametrize(
    "make",
    [
        lambda f: functools.partial(_scaled, factor=f),
        _make_scaled,
        _Scale,
        lambda f: _Scale(f).__call__,
        _SlotScale,
        lambda f: functools.partial(_SlotScale.__call__, _SlotScale(f)),
    ],
    ids=["partial", "closure", "object", "bound-method", "slotted-object", "slotted-held"],
)
def test_a_pre_transform_that_differs_only_in_its_values_gets_a_new_cache(tmp_path: Path, make: Any) -> None:
    """A transform's values are part of its fingerprint, so ``make(100.0)`` after ``make(1.0)`` gets a new cache.

    A partial's arguments, a closure's captured values, a callable object's attributes and a bound method's object:
    the x100 transform was served the x1 cache, silently.
    """
    one, hundred = make(1.0), make(100.0)
    assert callable_fingerprint(one) == callable_fingerprint(make(1.0)) != callable_fingerprint(hundred)
    CachedDataset(Source(), tmp_path, pre_transform=one)
    assert np.array_equal(CachedDataset(Source(), tmp_path, pre_transform=hundred)[3][0], Source()[3][0] * 100.0)


def test_a_c_callables_arguments_are_part_of_its_fingerprint() -> None:
    """``operator.itemgetter(0, 2)`` is not ``itemgetter(0, 1)``: a C callable has no source and no attributes.

    Its type's source (operator.py's Python twin) was all the fingerprint held, so the two shared one cache.
    """
    assert callable_fingerprint(operator.itemgetter(0, 1)) != callable_fingerprint(operator.itemgetter(0, 2))
    assert callable_fingerprint(operator.itemgetter(0, 2)) == callable_fingerprint(operator.itemgetter(0, 2))
    assert callable_fingerprint(operator.methodcaller("a", 1)) != callable_fingerprint(operator.methodcaller("a", 2))


def test_a_transform_fingerprint_is_the_same_in_another_process() -> None:
    """A transform's fingerprint holds no memory address: every process gives the same, so the cache is built once.

    A partial, a closure, a transform object and a bound builtin, in two processes (as a DataLoader worker, a DDP
    rank or the next run would).
    """
    code = (
        "import functools, sys; sys.path.insert(0, 'tests'); import test_data_cache as t;"
        " from lightning_speedkit.data import callable_fingerprint as f;"
        " print(f(functools.partial(t._scaled, factor=2.0)), f(t._make_scaled(2.0)), f(t._Scale(2.0)), f('ab'.upper))"
    )
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True) for _ in range(2)]
    assert runs[0].stdout == runs[1].stdout
    assert len(set(runs[0].stdout.split())) == 4


def test_a_source_of_dicts_or_objects_is_cached_once_not_once_a_run(tmp_path: Path) -> None:
    """Samples holding dicts, objects or bfloat16 tensors get one fingerprint for the same data, in any process.

    Their bytes were hashed as numpy object arrays, that is as the objects' memory addresses: every run (and every
    DDP rank) built a cache of its own, and a bfloat16 source raised before ``pre_transform`` could convert it.
    """

    def source(offset: float = 0.0) -> list[dict[str, object]]:  # new objects on every call
        return [{"image": torch.full((2, 2), i + offset, dtype=torch.bfloat16), "label": i, "meta": object()}
                for i in range(6)]  # fmt: skip

    assert dataset_fingerprint(source()) == dataset_fingerprint(source()) != dataset_fingerprint(source(0.5))
    flat = [(s["image"].float(), s["label"]) for s in source()]  # what a `pre_transform` gives

    def pre_transform(sample: dict[str, Any]) -> tuple[torch.Tensor, int]:
        return sample["image"].float(), int(sample["label"])  # type: ignore[call-overload]

    first = CachedDataset(source(), tmp_path, pre_transform=pre_transform)
    again = CachedDataset(source(), tmp_path, pre_transform=pre_transform)
    assert again.directory == first.directory
    assert again.build_report == {}  # found built
    assert all(torch.equal(again[i][0], flat[i][0]) and again[i][1] == flat[i][1] for i in range(6))


def test_a_nested_tuple_field_is_refused_by_name(tmp_path: Path) -> None:
    """A field that is itself a tuple gets a clear error (numpy stacked it or failed without naming CachedDataset)."""
    with pytest.raises(ValueError, match="field 0 of sample 0 is a tuple; the cache holds flat samples"):
        CachedDataset([((torch.zeros(2), torch.ones(1)), i) for i in range(4)], tmp_path)


def test_two_workers_read_the_same_samples(tmp_path: Path) -> None:
    """DataLoader worker processes map the files themselves and return what the main process reads."""
    cached = CachedDataset(Source(), tmp_path)
    serial = list(DataLoader(cached, batch_size=4))
    parallel = list(DataLoader(cached, batch_size=4, num_workers=2))
    for a, b in zip(serial, parallel, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _build(args: tuple[str, str]) -> str:
    root, log = args
    return str(CachedDataset(Source(n=40, log=Path(log)), root, pre_transform=double_first).directory)


def test_racing_processes_build_once(tmp_path: Path) -> None:
    """Two processes that build the same cache at once share one build and one directory."""
    log = tmp_path / "calls.txt"
    with multiprocessing.get_context("spawn").Pool(2) as pool:
        results = pool.map(_build, [(str(tmp_path / "cache"), str(log))] * 2)
    assert results[0] == results[1]
    # Each process reads 8 fingerprint probes; the single build decodes all 40 samples once.
    assert log.read_text().count("\n") == 40 + 2 * 8
    assert [p.name for p in (tmp_path / "cache").iterdir() if not p.name.endswith(".lock")] == [Path(results[0]).name]


_SLOW_BUILD = """
import sys, time
sys.path.insert(0, {tests!r})
from test_data_cache import Source
from lightning_speedkit.data import CachedDataset

class Slow(Source):
    def __getitem__(self, i):
        time.sleep(0.05)
        return super().__getitem__(i)

CachedDataset(Slow(n=400), {root!r}, fingerprint="fixed")
"""


@pytest.mark.slow
def test_killed_build_is_detected_and_rebuilt(tmp_path: Path) -> None:
    """A build killed half-way leaves no cache; the next use removes its remains and builds a complete cache."""
    code = _SLOW_BUILD.format(tests=str(Path(__file__).parent), root=str(tmp_path))
    process = subprocess.Popen([sys.executable, "-c", code])
    try:
        for _ in range(600):
            if any(p.name.startswith(".cache-") and ".tmp-" in p.name for p in tmp_path.iterdir()):
                break
            time.sleep(0.1)
        else:
            pytest.fail("the build never started")
        os.kill(process.pid, signal.SIGKILL)
    finally:
        process.wait()
    assert not list(tmp_path.glob("cache-v*"))
    cached = CachedDataset(Source(n=400), tmp_path, fingerprint="fixed")
    assert _same(cached[399], Source(n=400)[399])
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def test_an_older_format_of_the_same_source_is_named_and_left_on_disk(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A new format's build names the older format's copy of the same source (never read again), and leaves it there.

    A library update that changes the format rebuilt the cache beside the old one without a word: a second copy of a
    data set's decoded samples, whose space only the user can give back (another install may still read it).
    """
    first = CachedDataset(Source(), tmp_path / "a", fingerprint="fixed")
    version, key = first.directory.name.split("-", 2)[1:]
    older = tmp_path / "b" / f"cache-{'v' + str(int(version[1:]) - 1)}-{key}"
    other = tmp_path / "b" / "cache-v1-another0source0key0"
    for place in (older, other):
        place.mkdir(parents=True)
        (place / "data.bin").write_bytes(b"old")
    with caplog.at_level("WARNING", logger="lightning_speedkit.data.cache"):
        cached = CachedDataset(Source(), tmp_path / "b", fingerprint="fixed")
    named = [r.getMessage() for r in caplog.records if "another cache format" in r.getMessage()]
    assert len(named) == 1
    assert str(older) in named[0]
    assert (older / "data.bin").read_bytes() == b"old"
    assert other.is_dir()
    caplog.clear()
    with caplog.at_level("WARNING", logger="lightning_speedkit.data.cache"):
        CachedDataset(Source(), tmp_path / "b", fingerprint="fixed")  # found built: nothing said again
    assert not [r for r in caplog.records if "another cache format" in r.getMessage()]
    assert _same(cached[3], Source()[3])


def test_disk_budget_is_refused_clearly(tmp_path: Path) -> None:
    """A cache larger than ``max_disk_bytes`` is refused before anything is written."""
    with pytest.raises(CacheBudgetError, match="max_disk_bytes"):
        CachedDataset(Source(), tmp_path, max_disk_bytes=100)
    assert not list(tmp_path.glob("cache-v*"))


def test_memory_budget_and_in_memory_mode(tmp_path: Path) -> None:
    """``in_memory`` loads the arrays into RAM within the budget and refuses beyond it, before building the cache."""
    with pytest.raises(CacheBudgetError, match="max_memory_bytes"):
        CachedDataset(Source(), tmp_path / "first", in_memory=True, max_memory_bytes=10)
    assert not list((tmp_path / "first").glob("cache-*"))  # nothing decoded or written for a cache it refuses
    cached = CachedDataset(Source(), tmp_path, in_memory=True)
    assert _same(cached[2], Source()[2])
    with pytest.raises(CacheBudgetError, match="max_memory_bytes"):
        CachedDataset(Source(), tmp_path, in_memory=True, max_memory_bytes=10)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_disk_bytes": 0}, "`max_disk_bytes` must be a positive int or None, got 0"),
        ({"max_disk_bytes": "x"}, "`max_disk_bytes` must be a positive int or None, got 'x'"),
        ({"max_memory_bytes": -1}, "`max_memory_bytes` must be a positive int or None, got -1"),
    ],
)
def test_bad_budgets_are_refused(tmp_path: Path, kwargs: dict[str, Any], match: str) -> None:
    """Budgets that are not a positive int of bytes are refused with the argument's name and value."""
    with pytest.raises(ValueError, match=match):
        CachedDataset(Source(), tmp_path, **kwargs)


class SizedStream(IterableDataset[int]):
    """An IterableDataset with a length: it has ``__len__`` and Dataset's ``__getitem__`` (which raises)."""

    def __len__(self) -> int:
        return 3

    def __iter__(self) -> Iterator[int]:
        return iter(range(3))


_PATH = re.escape("`path` must be a directory path (a non-empty str or os.PathLike), got ")
_SOURCE = re.escape("`source` must be a map-style dataset (") + ".*" + re.escape("), got ")
_FINGERPRINT = re.escape("`fingerprint` must be a non-empty str (e.g. a data-set version) or None, got ")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"path": None}, _PATH + "None"),
        ({"path": 123}, _PATH + "123"),
        ({"path": ""}, _PATH + "''"),
        ({"path": "  "}, _PATH + "'  '"),
        ({"path": b"cache"}, _PATH + "b'cache'"),
        ({"source": "not a dataset"}, _SOURCE + "'not a dataset'"),
        ({"source": b"bytes"}, _SOURCE + "b'bytes'"),
        ({"source": Source}, _SOURCE + re.escape("<class 'test_data_cache.Source'>")),
        ({"source": SizedStream()}, _SOURCE + re.escape("<test_data_cache.SizedStream object")),
        ({"fingerprint": 5}, _FINGERPRINT + "5"),
        ({"fingerprint": ""}, _FINGERPRINT + "''"),
        ({"fingerprint": " "}, _FINGERPRINT + "' '"),
        ({"fingerprint": ["a"]}, _FINGERPRINT + re.escape("['a']")),
    ],
    ids=lambda value: None if isinstance(value, str) else repr(value),
)
def test_bad_path_source_or_fingerprint_is_refused_naming_it_and_its_value(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kwargs: dict[str, Any], match: str
) -> None:
    """An empty or non-path `path`, a `source` that is no dataset, a `fingerprint` that is no non-empty str: refused."""
    monkeypatch.chdir(tmp_path)  # a cache built in the current directory would land here
    with pytest.raises(ValueError, match=match):
        CachedDataset(**{"source": Source(), "path": tmp_path / "cache", **kwargs})
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("below", ["", "cache"])
def test_a_path_at_or_under_a_file_is_refused(tmp_path: Path, below: str) -> None:
    """A `path` that is a file, or lies under one, is refused in the constructor, naming `path` and the file."""
    file = tmp_path / "a-file"
    file.write_text("not a directory")
    path = file / below if below else file
    with pytest.raises(
        ValueError,
        match=re.escape(f"`path` must be a directory or where one can be made, got {path!r}: {file} is a file."),
    ):
        CachedDataset(Source(), path)
    assert [p.name for p in tmp_path.iterdir()] == ["a-file"]


def test_a_cache_to_build_in_a_place_not_writable_is_refused_naming_path(tmp_path: Path) -> None:
    """A `path` where the cache cannot be built: an OSError naming `path` and what to do, not the lock file."""
    read_only = tmp_path / "read-only"
    read_only.mkdir()
    read_only.chmod(0o555)
    place = refusing_files(read_only, Path("/sys"), why="no directory here refuses this process's writes")
    with pytest.raises(OSError, match=re.escape(f"`path`={str(place)!r} cannot hold it (")) as caught:
        CachedDataset(Source(), place)
    assert ".lock" not in str(caught.value)
    assert "give a writable `path`" in str(caught.value)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (
            lambda: callable_fingerprint("not a function"),
            "`fn` must be a function (a transform) or None, got 'not a function'.",
        ),
        (lambda: dataset_fingerprint("abc"), "`dataset` must be a map-style dataset"),
        (lambda: dataset_fingerprint([]), "`dataset` must hold at least one sample, got an empty dataset."),
    ],
    ids=["callable_fingerprint-str", "dataset_fingerprint-str", "dataset_fingerprint-empty"],
)
def test_fingerprint_functions_refuse_what_they_cannot_fingerprint(call: Callable[[], str], match: str) -> None:
    """`callable_fingerprint` of a non-callable and `dataset_fingerprint` of a str or an empty list raise ValueError."""
    with pytest.raises(ValueError, match=re.escape(match)):
        call()


@pytest.mark.parametrize(
    ("samples", "match"),
    [
        (
            [np.zeros(4), np.zeros(4), 1.0],
            "field 0 of sample 2 has shape () and dtype float64, sample 0's has shape (4,)",
        ),
        ([np.zeros(4, np.uint8), np.full(4, 0.5)], "field 0 of sample 1 has shape (4,) and dtype float64"),
        ([(np.zeros(2), 1), (np.zeros(2),)], "sample 1 has 1 fields, sample 0 has 2"),
        ([("cat", 1), ("horse", 2)], "field 0 of sample 0 is 'cat', of dtype <U3"),
        ([(np.zeros(2), object())], "field 1 of sample 0 is <object object"),
        ([torch.zeros(2, dtype=torch.bfloat16)], "field 0 of sample 0 cannot become a numpy array"),
    ],
    ids=["a number after arrays", "floats after bytes", "a missing field", "strings", "an object", "bfloat16"],
)
def test_samples_that_do_not_fit_the_first_are_refused_naming_the_sample(
    tmp_path: Path, samples: list[Any], match: str
) -> None:
    """A sample whose fields differ from sample 0's (shape, lossy dtype, count) or are not numbers: a ValueError."""
    with pytest.raises(ValueError, match=re.escape(match)):
        CachedDataset(samples, tmp_path, fingerprint="fixed")
    assert not list(tmp_path.glob("cache-*"))


def test_a_fingerprint_that_did_not_change_with_the_data_is_refused(tmp_path: Path) -> None:
    """A `fingerprint` reused for a source of another length names the cache and both lengths instead of serving it."""
    CachedDataset(Source(n=12), tmp_path, fingerprint="v1")
    with pytest.raises(ValueError, match="holds 12 samples but `source` has 13"):
        CachedDataset(Source(n=13), tmp_path, fingerprint="v1")


def test_empty_source_is_refused(tmp_path: Path) -> None:
    """An empty dataset cannot be cached."""
    with pytest.raises(ValueError, match="`source`"):
        CachedDataset([], tmp_path)


def test_demo_datamodule_cache_serves_the_same_validation_batches(demo_cache: Path) -> None:
    """The demo's cached pipeline gives exactly the validation batches of the decoding pipeline."""
    plain = DemoDataModule(num_images=40, batch_size=8, root=demo_cache)
    cached = DemoDataModule(num_images=40, batch_size=8, root=demo_cache, cache=True)
    for dm in (plain, cached):
        dm.prepare_data()
        dm.setup("fit")
    for (xa, ya), (xb, yb) in zip(plain.val_dataloader(), cached.val_dataloader(), strict=True):
        assert torch.equal(xa, xb)
        assert torch.equal(ya, yb)


class _Photos(Dataset[tuple[Any, int]]):
    """PIL images, as torchvision's ``ImageFolder`` returns them: version ``v`` of the pixels."""

    def __init__(self, v: int) -> None:
        self.v = v

    def __len__(self) -> int:
        return 20

    def __getitem__(self, i: int) -> tuple[Any, int]:
        from PIL import Image

        return Image.fromarray(np.full((4, 4, 3), self.v * 10 + i, np.uint8)), i % 2


def _pixels(sample: tuple[Any, int]) -> tuple[np.ndarray[Any, Any], int]:
    return np.asarray(sample[0]), sample[1]


def test_a_source_of_pil_images_is_fingerprinted_by_its_pixels(tmp_path: Path) -> None:
    """New pixels behind the same length and labels build a new cache (a PIL image was hashed by its type alone)."""
    assert dataset_fingerprint(_Photos(1)) != dataset_fingerprint(_Photos(2))
    assert dataset_fingerprint(_Photos(1)) == dataset_fingerprint(_Photos(1))
    first = CachedDataset(_Photos(1), tmp_path, pre_transform=_pixels)
    second = CachedDataset(_Photos(2), tmp_path, pre_transform=_pixels)
    assert int(first[3][0][0, 0, 0]) == 13
    assert int(second[3][0][0, 0, 0]) == 23


class _Modes(Dataset[tuple[Any, int]]):
    """PIL images of the given mode per sample (the first one's for the rest unless ``modes`` says otherwise)."""

    def __init__(self, *modes: str) -> None:
        self.modes = modes

    def __len__(self) -> int:
        return 6

    def __getitem__(self, i: int) -> tuple[Any, int]:
        from PIL import Image

        mode = self.modes[min(i, len(self.modes) - 1)]
        pixels = np.random.default_rng(i).integers(0, 255, (5, 4, 3), dtype=np.uint8)
        return Image.fromarray(pixels).convert(mode), i


@pytest.mark.parametrize("mode", ["RGB", "L", "RGBA", "I;16", "F"])
def test_a_pil_image_comes_back_as_one_so_a_pil_transform_takes_it(tmp_path: Path, mode: str) -> None:
    """A PIL field is served as a PIL image of its mode and pixels: a transform written for the source's samples works.

    It came back as its pixel array, and a transform that flips a PIL image failed with numpy's "axes don't match".
    """
    from PIL import Image

    def flip(sample: tuple[Any, int]) -> tuple[Any, int]:
        return sample[0].transpose(Image.Transpose.FLIP_LEFT_RIGHT), sample[1]

    source = _Modes(mode)
    cached = CachedDataset(source, tmp_path, transform=flip)
    for i in range(len(source)):
        image, label = cached[i]
        expected = flip(source[i])[0]
        assert isinstance(image, Image.Image)
        assert image.mode == mode
        assert np.array_equal(np.asarray(image), np.asarray(expected))
        assert label == i


def test_a_pil_mode_its_pixel_array_does_not_keep_is_refused_naming_it(tmp_path: Path) -> None:
    """A palette ("P") or CMYK image would come back as another mode: refused, naming the mode and `pre_transform`."""
    with pytest.raises(ValueError, match=r"field 0 of sample 0 is a PIL image of mode 'P'.*`pre_transform`"):
        CachedDataset(_Modes("P"), tmp_path)


def test_a_later_sample_of_another_pil_mode_is_refused_naming_it(tmp_path: Path) -> None:
    """RGB then YCbCr: the same shape and dtype, another mode, refused by sample index rather than served as RGB."""
    with pytest.raises(ValueError, match=r"field 0 of sample 1 is .*sample 0's a PIL image of mode 'RGB'"):
        CachedDataset(_Modes("RGB", "YCbCr"), tmp_path)
