"""Generated shape images on disk, decoded per sample: a data pipeline that behaves like a real one."""

from __future__ import annotations

import hashlib
import json
import logging
import multiprocessing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from PIL import Image, ImageDraw
from torch.utils.data import DataLoader, Dataset

from lightning_speedkit.checks import check_bool, check_int, check_number, is_int
from lightning_speedkit.report import atomic_directory, cache_dir

log = logging.getLogger(__name__)

__all__ = [
    "CLASSES",
    "DecodedShapes",
    "DemoDataModule",
    "ShapeAugment",
    "ShapesDataset",
    "default_cache_dir",
    "ensure_shapes",
    "ensure_streaming",
    "render_shape",
]

CLASSES = ("circle", "square", "triangle", "plus", "ring", "hbar", "vbar", "diamond", "cross", "frame")
_FORMAT_VERSION = 2
_MEAN = 0.5
_STD = 0.25


def render_shape(index: int, image_size: int = 64, seed: int = 0) -> tuple[Image.Image, int]:
    """Draw sample ``index``: one of ten shapes with random colours, size, position and pixel noise.

    The result depends only on ``(index, image_size, seed)``, so every process draws the same data set.

    Example:
        >>> image, label = render_shape(3, image_size=64)
        >>> image.size, CLASSES[label]
        ((64, 64), 'plus')
    """
    label = index % len(CLASSES)
    rng = np.random.default_rng([seed, index])
    background = rng.integers(0, 256, size=3)
    # Every channel of the foreground differs from the background by at least 64, so the shape stays visible.
    foreground = (background + rng.integers(64, 193, size=3)) % 256
    image = Image.new("RGB", (image_size, image_size), tuple(int(c) for c in background))
    draw = ImageDraw.Draw(image)
    fill = tuple(int(c) for c in foreground)

    margin = image_size // 8 + 1  # keeps the shape inside any random crop of 7/8 of the image
    radius = int(rng.integers(image_size // 8, image_size // 4 - 1))
    cx = int(rng.integers(margin + radius, image_size - margin - radius + 1))
    cy = int(rng.integers(margin + radius, image_size - margin - radius + 1))
    r, t = radius, max(2, radius // 3)
    box = (cx - r, cy - r, cx + r, cy + r)
    name = CLASSES[label]
    if name == "circle":
        draw.ellipse(box, fill=fill)
    elif name == "square":
        draw.rectangle(box, fill=fill)
    elif name == "triangle":
        draw.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=fill)
    elif name == "plus":
        draw.rectangle((cx - r, cy - t // 2, cx + r, cy + t // 2), fill=fill)
        draw.rectangle((cx - t // 2, cy - r, cx + t // 2, cy + r), fill=fill)
    elif name == "ring":
        draw.ellipse(box, outline=fill, width=t)
    elif name == "hbar":
        draw.rectangle((cx - r, cy - t, cx + r, cy + t), fill=fill)
    elif name == "vbar":
        draw.rectangle((cx - t, cy - r, cx + t, cy + r), fill=fill)
    elif name == "diamond":
        draw.polygon([(cx, cy - r), (cx + r, cy), (cx, cy + r), (cx - r, cy)], fill=fill)
    elif name == "cross":
        draw.line((cx - r, cy - r, cx + r, cy + r), fill=fill, width=t)
        draw.line((cx - r, cy + r, cx + r, cy - r), fill=fill, width=t)
    else:  # frame
        draw.rectangle(box, outline=fill, width=t)

    noise = rng.normal(0.0, float(rng.uniform(4.0, 16.0)), size=(image_size, image_size, 3))
    pixels = np.clip(np.asarray(image, dtype=np.float32) + noise, 0, 255).astype(np.uint8)
    return Image.fromarray(pixels), label


def default_cache_dir() -> Path:
    """Where generated data lives: `lightning_speedkit.report.cache_dir` (``$SPEEDKIT_CACHE_DIR``, or ``~/.cache``)."""
    return cache_dir()


def ensure_shapes(num_images: int, image_size: int = 64, seed: int = 0, root: str | Path | None = None) -> Path:
    """Write ``num_images`` JPEG files and a manifest once; later calls (and other processes) reuse them.

    The files are written into a private temporary directory that is renamed into place in one step, so a crash
    or a concurrent writer never leaves a half-written data set behind.

    Returns:
        The directory holding ``00000.jpg ...`` and ``manifest.json``.

    Raises:
        ValueError: if ``num_images`` is smaller than the number of classes or ``image_size`` is below 16.
    """
    check_int("num_images", num_images, low=len(CLASSES))  # one per class
    check_int("image_size", image_size, low=16)
    root = Path(root) if root is not None else default_cache_dir()
    final = root / f"shapes-v{_FORMAT_VERSION}-n{num_images}-s{image_size}-seed{seed}"
    if (final / "manifest.json").is_file():
        return final

    with atomic_directory(final) as tmp:
        labels = []
        for index in range(num_images):
            image, label = render_shape(index, image_size, seed)
            image.save(tmp / f"{index:05d}.jpg", format="JPEG", quality=90)
            labels.append(label)
        manifest = {"version": _FORMAT_VERSION, "classes": list(CLASSES), "labels": labels, "seed": seed}
        (tmp / "manifest.json").write_text(json.dumps(manifest))
    log.info("Demo images ready in %s", final)
    return final


class DecodedShapes(Dataset[tuple[np.ndarray[Any, Any], int]]):
    """Opens and decodes one JPEG per sample: ``(uint8 HxWx3 pixels, label)``, before any augmentation.

    Args:
        directory: A directory made by :func:`ensure_shapes`.
        indices: Which samples of the directory belong to this split.
    """

    def __init__(self, directory: str | Path, indices: Sequence[int]) -> None:
        self.directory = Path(directory)
        self.indices = list(indices)
        self._manifest = (self.directory / "manifest.json").read_text()
        self.labels: list[int] = json.loads(self._manifest)["labels"]

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, item: int) -> tuple[np.ndarray[Any, Any], int]:
        index = self.indices[item]
        with Image.open(self.directory / f"{index:05d}.jpg") as image:
            return np.asarray(image.convert("RGB")), self.labels[index]

    def cache_fingerprint(self) -> str:
        """Identifies the files and the split, for :class:`~lightning_speedkit.data.CachedDataset`."""
        return hashlib.sha256(f"{self.directory.resolve()}|{self._manifest}|{self.indices}".encode()).hexdigest()


def ensure_streaming(decoded: DecodedShapes, directory: str | Path) -> Path:
    """Litdata's copy of a split's decoded images under ``directory/litdata``, written once; later calls reuse it.

    Written with `~lightning_speedkit.data.write_streaming` (1 MB chunks; forked workers where the platform has
    them), named by the split's fingerprint, so another split or other images get their own copy.
    """
    from lightning_speedkit.data.streaming import StreamingFormatError, check_streaming_dir, write_streaming

    target = Path(directory) / "litdata" / decoded.cache_fingerprint()[:16]
    try:
        return check_streaming_dir(target)
    except StreamingFormatError as error:
        damaged = target.exists()  # an interrupted or cleaned-up copy: written again (the write is staged)
        if damaged:
            log.warning("Demo streaming copy %s is damaged (%s); writing it again", target, error)
        fork = "fork" in multiprocessing.get_all_start_methods()
        method = "fork" if fork else None
        return write_streaming(decoded, target, chunk_bytes="1MB", start_method=method, overwrite=damaged)


class ShapeAugment:
    """Crop (random when training, centred otherwise), flip (training only) and normalise decoded pixels.

    Args:
        crop_size: Side of the square crop fed to the model.
        train: Random crop and horizontal flip when ``True``.
    """

    def __init__(self, crop_size: int, train: bool) -> None:
        self.crop_size = crop_size
        self.train = train

    def __call__(self, sample: tuple[np.ndarray[Any, Any], int]) -> tuple[torch.Tensor, int]:
        """Augment one decoded ``(pixels, label)`` sample into ``(normalised CHW tensor, label)``."""
        pixels, label = sample
        size, crop = pixels.shape[0], self.crop_size
        if self.train:
            top, left = (int(v) for v in torch.randint(0, size - crop + 1, (2,)))
        else:
            top = left = (size - crop) // 2
        pixels = pixels[top : top + crop, left : left + crop]
        if self.train and bool(torch.rand(()) < 0.5):
            pixels = pixels[:, ::-1]
        tensor = torch.from_numpy(np.ascontiguousarray(pixels)).permute(2, 0, 1).float().div_(255.0)
        return tensor.sub_(_MEAN).div_(_STD), label


class ShapesDataset(Dataset[tuple[torch.Tensor, int]]):
    """Opens and decodes one JPEG per sample, then crops, flips and normalises it, as a torchvision pipeline would.

    Args:
        directory: A directory made by :func:`ensure_shapes`.
        indices: Which samples of the directory belong to this split.
        crop_size: Side of the square crop fed to the model.
        train: Random crop and horizontal flip when ``True``; centre crop otherwise.
    """

    def __init__(self, directory: str | Path, indices: Sequence[int], crop_size: int, train: bool) -> None:
        self.decoded = DecodedShapes(directory, indices)
        self.augment = ShapeAugment(crop_size, train)

    @property
    def indices(self) -> list[int]:
        """The image indices of this split."""
        return self.decoded.indices

    def __len__(self) -> int:
        return len(self.decoded)

    def __getitem__(self, item: int) -> tuple[torch.Tensor, int]:
        return self.augment(self.decoded[item])


class DemoDataModule(L.LightningDataModule):
    """The demo data: ``num_images`` generated shape images, 80/20 train/validation split.

    The defaults are the naive baseline users start from: ``batch_size=32``, ``num_workers=0``, no ``pin_memory``.

    Args:
        num_images: Images generated (train + validation).
        image_size: Side of the stored images in pixels.
        crop_size: Side of the crops fed to the model (default: 7/8 of ``image_size``).
        batch_size: Samples per batch (a speedkit ``BatchSizeFinder`` may change it).
        num_workers: DataLoader worker processes.
        pin_memory: Page-locked host memory for faster host-to-device copies.
        val_fraction: Share of the images kept for validation.
        seed: Seed of the generated images and of the split.
        root: Cache directory for the images (default: :func:`default_cache_dir`).
        cache: Serve decoded images from a packed memory-mapped file
            (:class:`~lightning_speedkit.data.CachedDataset`, built once next to the images) instead of decoding a
            JPEG per sample; augmentation still runs per sample.
        streaming: Stream the decoded images from litdata's format (`ensure_streaming`, written once next to the
            images) through a litdata ``StreamingDataLoader``, as a run beyond one machine would (needs the
            ``[streaming]`` extra); augmentation runs per sample. Takes precedence over ``cache``.

    Example:
        >>> import tempfile
        >>> dm = DemoDataModule(num_images=20, batch_size=4, root=tempfile.mkdtemp())
        >>> dm.prepare_data(); dm.setup("fit")
        >>> x, y = next(iter(dm.train_dataloader()))
        >>> tuple(x.shape), tuple(y.shape)
        ((4, 3, 56, 56), (4,))
    """

    def __init__(
        self,
        num_images: int = 5000,
        image_size: int = 64,
        crop_size: int | None = None,
        batch_size: int = 32,
        num_workers: int = 0,
        pin_memory: bool = False,
        val_fraction: float = 0.2,
        seed: int = 0,
        root: str | Path | None = None,
        cache: bool = False,
        streaming: bool = False,
    ) -> None:
        super().__init__()
        check_int("num_images", num_images, low=len(CLASSES))  # one image per class at least
        check_int("image_size", image_size, low=16)
        crop_size = crop_size if crop_size is not None else image_size * 7 // 8
        if not is_int(crop_size, low=1) or crop_size > image_size:
            raise ValueError(f"`crop_size` must be an int in [1, image_size={image_size}] or None, got {crop_size!r}.")
        check_number("val_fraction", val_fraction, 0, 1, open_low=True, open_high=True)
        check_int("batch_size", batch_size)
        check_int("num_workers", num_workers, low=0)
        check_bool("pin_memory", pin_memory)
        check_bool("cache", cache)
        check_bool("streaming", streaming)
        self.save_hyperparameters(ignore=["root"])
        self.num_images, self.image_size, self.crop_size = num_images, image_size, crop_size
        self.batch_size, self.num_workers, self.pin_memory = batch_size, num_workers, pin_memory
        self.val_fraction, self.seed, self.root, self.cache = val_fraction, seed, root, cache
        self.streaming = streaming
        self.train_set: Dataset[tuple[torch.Tensor, int]] | None = None
        self.val_set: Dataset[tuple[torch.Tensor, int]] | None = None

    def prepare_data(self) -> None:
        """Generate the images once, and with ``streaming`` their litdata copies (Lightning: one process a node)."""
        directory = ensure_shapes(self.num_images, self.image_size, self.seed, self.root)
        if self.streaming:
            for indices in self._splits():
                ensure_streaming(DecodedShapes(directory, indices), directory)

    def setup(self, stage: str) -> None:
        """Split the images into train and validation sets, the same way on every rank."""
        directory = ensure_shapes(self.num_images, self.image_size, self.seed, self.root)
        train, val = self._splits()
        self.train_set = self._split(directory, train, train=True)
        self.val_set = self._split(directory, val, train=False)

    def _splits(self) -> tuple[list[int], list[int]]:
        """The image indices of the train and validation splits, from the seed."""
        order = torch.randperm(self.num_images, generator=torch.Generator().manual_seed(self.seed)).tolist()
        num_val = max(1, int(self.num_images * self.val_fraction))
        return order[num_val:], order[:num_val]

    def _split(self, directory: Path, indices: Sequence[int], train: bool) -> Dataset[tuple[torch.Tensor, int]]:
        if self.streaming:
            from lightning_speedkit.data.streaming import streaming_dataset

            source = ensure_streaming(DecodedShapes(directory, indices), directory)
            augment = ShapeAugment(self.crop_size, train)
            dataset: Dataset[tuple[torch.Tensor, int]] = streaming_dataset(
                source, shuffle=train, seed=self.seed, transform=augment
            )
            return dataset
        if not self.cache:
            return ShapesDataset(directory, indices, self.crop_size, train)
        from lightning_speedkit.data import CachedDataset

        augment = ShapeAugment(self.crop_size, train)
        return CachedDataset(DecodedShapes(directory, indices), directory / "packed", transform=augment)

    def _loader(
        self, dataset: Dataset[tuple[torch.Tensor, int]] | None, shuffle: bool
    ) -> DataLoader[tuple[torch.Tensor, int]]:
        if dataset is None:
            raise RuntimeError("DemoDataModule: call `setup()` before asking for a dataloader.")
        if self.streaming:  # the dataset shuffles itself, by epoch
            from litdata import StreamingDataLoader  # type: ignore[import-untyped]

            loader: DataLoader[tuple[torch.Tensor, int]] = StreamingDataLoader(
                dataset, batch_size=self.batch_size, num_workers=self.num_workers, pin_memory=self.pin_memory
            )
            return loader
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            shuffle=shuffle,
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
            persistent_workers=self.num_workers > 0,
        )

    def train_dataloader(self) -> DataLoader[tuple[torch.Tensor, int]]:
        """Shuffled training batches with per-sample augmentation."""
        return self._loader(self.train_set, shuffle=True)

    def val_dataloader(self) -> DataLoader[tuple[torch.Tensor, int]]:
        """Validation batches, centre-cropped, in a fixed order."""
        return self._loader(self.val_set, shuffle=False)
