"""Loggers for speedkit runs: a W&B logger that groups ``speedkit/*``, and the run summary of every report."""

from __future__ import annotations

import logging
import netrc
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import lightning.pytorch as pl
from lightning.pytorch.loggers import CSVLogger, Logger, WandbLogger
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lightning_speedkit.hooks import LeanCallback
from lightning_speedkit.report import collect_reports, flatten_reports, write_json_atomic

log = logging.getLogger(__name__)

__all__ = ["RunSummary", "SpeedkitWandbLogger", "choose_logger", "speedkit_wandb_logger", "wandb_is_offline"]


def wandb_is_offline(environ: Mapping[str, str] | None = None) -> bool:
    """Whether W&B should run offline: ``WANDB_MODE`` says so, or there is no API key.

    A key is ``WANDB_API_KEY``, or what ``wandb login`` wrote for the W&B host (``WANDB_BASE_URL``, default
    ``https://api.wandb.ai``) into the netrc file (``NETRC``, else ``~/.netrc`` or ``~/_netrc`` under ``HOME``):
    most users log in once that way and set no variable.

    Example:
        >>> wandb_is_offline({}), wandb_is_offline({"WANDB_API_KEY": "x"}), wandb_is_offline({"WANDB_MODE": "offline"})
        (True, False, True)
    """
    env = os.environ if environ is None else environ
    if env.get("WANDB_MODE", "") in ("offline", "dryrun"):
        return True
    return not (env.get("WANDB_API_KEY") or _netrc_has_key(env))


def _netrc_has_key(env: Mapping[str, str]) -> bool:
    """Whether the netrc file named by ``env`` holds credentials for the W&B host (an unreadable file: no)."""
    if env.get("NETRC"):  # wandb's order: NETRC, then ~/.netrc, then ~/_netrc
        paths = [Path(env["NETRC"]).expanduser()]
    else:
        home = env.get("HOME") or env.get("USERPROFILE")
        paths = [Path(home) / ".netrc", Path(home) / "_netrc"] if home else []
    host = urlsplit(env.get("WANDB_BASE_URL") or "https://api.wandb.ai").netloc
    for path in paths:
        if path.is_file():
            try:
                credentials = netrc.netrc(path).authenticators(host) if host else None
                return bool(credentials and credentials[2])  # the key is the password
            except (netrc.NetrcParseError, OSError):
                return False
    return False


def speedkit_wandb_logger(save_dir: str | os.PathLike[str] = ".", project: str = "speedkit", **kwargs: Any) -> Logger:
    """A ``WandbLogger`` that runs offline without an API key (`wandb_is_offline`; ``wandb sync`` uploads later).

    Raises:
        ImportError: Without wandb (``pip install "lightning-speedkit[wandb]"``).
    """
    try:
        import wandb  # noqa: F401
    except ImportError as error:
        raise ImportError('W&B logging needs wandb: pip install "lightning-speedkit[wandb]"') from error
    kwargs.setdefault("offline", wandb_is_offline())
    return SpeedkitWandbLogger(project=project, save_dir=str(save_dir), **kwargs)


_STARTED_RUNS: set[str] = set()
"""The ids of the W&B runs this process's `SpeedkitWandbLogger` objects started."""


class SpeedkitWandbLogger(WandbLogger):
    """A ``WandbLogger`` that logs into a run of its own, not into one an earlier speedkit logger left open.

    Lightning's ``WandbLogger`` logs into ``wandb.run`` when one is open, and nothing finishes the run of a fit: in a
    notebook, the second `~lightning_speedkit.preset` Trainer logged into the first one's run (its steps, back at 0
    after the first's last, dropped by W&B; its ``speedkit/*`` summary mixed with the first's). This one finishes
    such a run before it starts its own. A run the user opened (their own ``wandb.init``) is still the one used.
    """

    @property  # type: ignore[override]
    def experiment(self) -> Any:
        """The run: Lightning's, after finishing an open run that another speedkit logger started."""
        if self._experiment is not None:
            return self._experiment
        import wandb

        open_run = wandb.run
        if open_run is not None and open_run.id in _STARTED_RUNS:
            open_run.finish()
            open_run = None
        experiment = WandbLogger.experiment.fget(self)  # type: ignore[attr-defined]
        if open_run is None and self._experiment is not None:  # rank zero started a run (other ranks get a dummy)
            _STARTED_RUNS.add(self._experiment.id)
        return experiment


def choose_logger(
    logger: Logger | Sequence[Logger] | bool | str, root: Any
) -> tuple[Logger | list[Logger] | bool, str]:
    """The logger `~lightning_speedkit.preset` gives the Trainer, and a one-line reason.

    ``"auto"`` or True: W&B when wandb is installed (`speedkit_wandb_logger`), else CSV; ``"wandb"``: W&B or an
    ImportError; ``"csv"``: CSV; False: none; a Logger (or a list of them): yours. Files go under ``root`` (the
    Trainer's ``default_root_dir``), else the working directory.

    Raises:
        ValueError: For any other ``logger`` (``1`` is not True).
        ImportError: For ``"wandb"`` without wandb installed.

    Example:
        >>> choose_logger(False, None)
        (False, 'none, as asked')
        >>> choose_logger(1, None)
        Traceback (most recent call last):
        ...
        ValueError: `logger` must be 'auto', 'wandb', 'csv', True, False, a Logger or a list of them, got 1.
    """
    if isinstance(logger, Logger):
        return logger, "as asked: yours"
    if isinstance(logger, (list, tuple)) and logger and all(isinstance(one, Logger) for one in logger):
        return list(logger), "as asked: yours"
    if logger is False:
        return False, "none, as asked"
    if not (logger is True or (isinstance(logger, str) and logger in ("auto", "wandb", "csv"))):  # 1 is not True
        raise ValueError(
            f"`logger` must be 'auto', 'wandb', 'csv', True, False, a Logger or a list of them, got {logger!r}."
        )
    save_dir = str(root) if root is not None else os.getcwd()
    if logger == "csv":
        return CSVLogger(save_dir=save_dir, name="speedkit"), "CSV, as asked: metrics.csv"
    try:
        chosen = speedkit_wandb_logger(save_dir=save_dir)
    except ImportError:
        if logger == "wandb":
            raise
        return CSVLogger(save_dir=save_dir, name="speedkit"), "wandb not installed: metrics.csv"
    mode = "offline (no WANDB_API_KEY, no `wandb login`)" if getattr(chosen, "_offline", False) else "online"
    source = "W&B, as asked" if logger == "wandb" else "wandb installed"
    return chosen, f"{source}: {mode}, speedkit/* grouped on trainer/global_step"


class RunSummary(LeanCallback):
    """At the end of fit, gather the ``report()`` of every callback that has one into the run summary.

    Every callback with a ``report()`` method (the `~lightning_speedkit.report.Reports` protocol) contributes the
    dict it returns, under its class name (a second instance of a class as ``Name#2``); empty dicts are left out. A
    callback whose ``report`` is not a method, or whose ``report()`` returns something other than a dict, is left
    out with one warning naming it: the fit has finished, and a summary is no reason to fail it.

    Writes ``speedkit_summary.json`` (atomically) into the first logger's ``log_dir`` (else the Trainer's
    ``default_root_dir``) and, for a W&B logger, puts the flattened scalars and labels
    (`~lightning_speedkit.report.flatten_reports`: ``speedkit/<Callback>/<key>``) into the run summary and groups
    ``speedkit/*`` metrics on ``trainer/global_step``. Rank zero only; `report` returns what was gathered. A
    ``fast_dev_run`` writes nothing (as Lightning's loggers and checkpoints), but `report` has it.
    """

    def __init__(self) -> None:
        self.summary: dict[str, Any] = {}

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for logger in trainer.loggers if trainer.is_global_zero else ():
            define = getattr(getattr(logger, "experiment", None), "define_metric", None)
            if isinstance(logger, WandbLogger) and callable(define):  # Lightning's, or preset's (a subclass)
                define("speedkit/*", step_metric="trainer/global_step")

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        others = [c for c in trainer.callbacks if not isinstance(c, RunSummary)]  # type: ignore[attr-defined]
        reports, problems = collect_reports(others)
        for problem in problems:
            rank_zero_warn(f"RunSummary: {problem}.")
        self.summary = reports
        if not trainer.is_global_zero or trainer.fast_dev_run:  # type: ignore[attr-defined]  # a dry run: no file
            return
        directory = Path(trainer.loggers[0].log_dir or trainer.default_root_dir) if trainer.loggers else None
        directory = directory or Path(trainer.default_root_dir)
        write_json_atomic(reports, directory / "speedkit_summary.json")
        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger):
                logger.experiment.summary.update(flatten_reports(reports))  # type: ignore[attr-defined]

    def report(self) -> dict[str, Any]:
        """The reports gathered at the end of the last fit, by callback class name (empty before one)."""
        return dict(self.summary)
