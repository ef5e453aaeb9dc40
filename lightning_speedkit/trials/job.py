"""What decides a lever's decision: the fingerprint of a job, under which `lightning_speedkit.trials.memory` keeps it.

The model's structure, one sample's shapes, the loader's settings (the user's, under a rebuild of ours), devices,
precision as built, accumulation, optimizers and schedulers, the device and its ISA, and the versions: see
`lightning_speedkit.trials.memory` for why each is in it.
"""

from __future__ import annotations

import copy
import hashlib
import json
import weakref
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from lightning_speedkit.__about__ import __version__
from lightning_speedkit.hardware import cpu_info
from lightning_speedkit.schedule import scheduler_names
from lightning_speedkit.trials.loaders import peek_train_loader

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["BUILT_FROM", "fingerprint", "fingerprint_key", "read_fingerprint"]


def fingerprint_key(print_: Mapping[str, Any]) -> str:
    """The directory name of a fingerprint: the first 20 hex digits of the SHA-256 of its canonical JSON.

    Example:
        >>> fingerprint_key({"a": 1}) == fingerprint_key({"a": 1}), len(fingerprint_key({"a": 1}))
        (True, 20)
    """
    canonical = json.dumps(print_, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:20]


def _device(trainer: pl.Trainer) -> dict[str, Any]:
    device = trainer.strategy.root_device
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        name = torch.cuda.get_device_name(index)
        return {"type": "cuda", "name": name, "capability": list(torch.cuda.get_device_capability(index))}
    cpu = cpu_info()
    isa = {"capability": cpu.torch_capability, "flags": list(cpu.flags), "forced": cpu.isa_limit}
    return {"type": device.type, "name": cpu.model, "cores": cpu.available_cores, **isa}


def _model(module: torch.nn.Module) -> dict[str, Any]:
    """Module types and every parameter's and buffer's name, shape and dtype, hashed (a model can be large)."""
    layout = [(name, type(sub).__name__) for name, sub in module.named_modules()]
    tensors = [(name, list(t.shape), str(t.dtype)) for name, t in (*module.named_parameters(), *module.named_buffers())]
    return {"class": type(module).__name__, "structure": fingerprint_key({"layout": layout, "tensors": tensors})}


def _shapes(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return [list(value.shape), str(value.dtype)]
    if isinstance(value, Mapping):
        return {str(k): _shapes(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (list, tuple)):
        return [_shapes(v) for v in value]
    return type(value).__name__  # a number, a string, None or anything else: its type


_SAMPLES: weakref.WeakKeyDictionary[Any, dict[int, Any]] = weakref.WeakKeyDictionary()
_BUILT_PRECISION: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()
"""Per Trainer, its precision when first fingerprinted: a remembered precision put in place at fit start, before other
levers fingerprint the run, is a decision, not the job (as `BUILT_FROM` is for the loader)."""


def _sample(trainer: pl.Trainer, dataset: Any) -> Any:
    """One sample's shapes and dtypes, read once per fit and dataset (every lever's fingerprint shares the read)."""
    seen = _SAMPLES.setdefault(trainer, {})
    if id(dataset) not in seen:
        try:
            seen[id(dataset)] = _shapes(dataset[0]) if dataset is not None and len(dataset) > 0 else None
        except Exception:  # an iterable dataset, or one that cannot be indexed: its type and settings must do
            seen[id(dataset)] = None
    return seen[id(dataset)]


def _length(dataset: Any) -> int | None:
    """The dataset's length (a batch size found for more samples may not fit fewer), None without one."""
    try:
        return len(dataset)
    except TypeError:
        return None


BUILT_FROM = "_speedkit_built_from"
"""The attribute of a loader speedkit rebuilt that holds the settings of the user's loader it was built from: the
fingerprint is the user's job, so a remembered loader decision applied before another lever fingerprints the run
does not make that lever's fingerprint another."""


def _loader(trainer: pl.Trainer) -> dict[str, Any]:
    """The train loader's settings and one sample's shapes, read without changing the run (`peek_train_loader`)."""
    return copy.deepcopy(peek_train_loader(trainer, _read_loader))  # the kept read stays as it was read


def _read_loader(trainer: pl.Trainer) -> dict[str, Any]:
    fit_loop = trainer.fit_loop
    if fit_loop._combined_loader is None:
        fit_loop.setup_data()
    combined = fit_loop._combined_loader
    loaders = list(combined.flattened) if combined is not None else []
    found: dict[str, Any] = {"loaders": len(loaders)}
    if loaders:
        loader = loaders[0]
        found.update(
            type=type(loader).__name__,
            batch_size=getattr(loader, "batch_size", None),
            num_workers=getattr(loader, "num_workers", None),
            pin_memory=getattr(loader, "pin_memory", None),
            persistent_workers=getattr(loader, "persistent_workers", None),
            prefetch_factor=getattr(loader, "prefetch_factor", None),
            drop_last=getattr(loader, "drop_last", None),
            dataset=type(getattr(loader, "dataset", None)).__name__,
        )
        found.update(getattr(loader, BUILT_FROM, None) or {})  # the user's settings, under our rebuild
        dataset = getattr(loader, "dataset", None)
        found["sample"], found["length"] = _sample(trainer, dataset), _length(dataset)
    return found


def fingerprint(trainer: pl.Trainer, lever: str) -> dict[str, Any]:
    """What decides a lever's decision in this run (see the module docstring); ``lever`` is its ``state_key``."""
    import lightning

    return {
        "lever": lever,
        "model": _model(trainer.lightning_module),
        "data": _loader(trainer),
        "devices": {"world_size": trainer.world_size, "num_nodes": trainer.num_nodes},
        "precision": _BUILT_PRECISION.setdefault(trainer, str(trainer.precision)),
        "accumulate_grad_batches": trainer.accumulate_grad_batches,
        "limits": [str(trainer.limit_train_batches), str(trainer.val_check_interval), trainer.check_val_every_n_epoch],
        "optimizers": [type(optimizer).__name__ for optimizer in trainer.optimizers],
        "schedulers": scheduler_names(trainer),
        "device": _device(trainer),
        "versions": {"torch": torch.__version__, "lightning": lightning.__version__, "speedkit": __version__},
    }


def read_fingerprint(trainer: pl.Trainer, lever: str) -> tuple[dict[str, Any] | None, str]:
    """This run's `fingerprint`, read once at fit start for the decision memory and for `Lever.holds`.

    Returns:
        The fingerprint and ``""``, or None and why it could not be read (a model or loader it cannot read).
    """
    try:
        return fingerprint(trainer, lever), ""
    except Exception as err:  # decide as without memory, and with no job to compare
        return None, f"{type(err).__name__}: {err}"
