"""DataLoader settings tuned on real training steps: `DataLoaderTuner`, and the loader rebuild it stands on.

`lightning_speedkit.dataloader.rebuild` holds the pure part (the four settings, the candidates, `rebuild_dataloader`
and `LoaderSettings`, the settings as a trial setting); `lightning_speedkit.dataloader.streaming` the same for a litdata
``StreamingDataLoader`` (rebuilt with its state); `lightning_speedkit.dataloader.callback` the callback.
"""

from lightning_speedkit.dataloader.callback import DataLoaderTuner
from lightning_speedkit.dataloader.rebuild import (
    LoaderSettings,
    NotRebuildableError,
    complete_settings,
    default_candidates,
    loader_settings,
    rebuild_dataloader,
    settings_name,
)

__all__ = [
    "DataLoaderTuner",
    "LoaderSettings",
    "NotRebuildableError",
    "complete_settings",
    "default_candidates",
    "loader_settings",
    "rebuild_dataloader",
    "settings_name",
]
