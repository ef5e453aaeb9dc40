"""Bad input to the pruning package: a ValueError naming the argument and the value, before any training step."""

from __future__ import annotations

import ast
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from conftest import TinyClassifier, tiny_trainer
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import nn
from typing_extensions import override

import lightning_speedkit.pruning as pruning
from lightning_speedkit.pruning import StructuredPruning, load_pruned_checkpoint, pruning_history

NET, X = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2)), torch.zeros(1, 4)
PACKAGE = Path(pruning.__file__).parent


class StepCounter(Callback):
    """Counts the training batches that started."""

    def __init__(self) -> None:
        self.batches = 0

    @override
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        """Count one batch."""
        self.batches += 1


@pytest.fixture(scope="module")
def pruned_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The last checkpoint of a fit that pruned TinyClassifier's hidden layer to half."""
    root = tmp_path_factory.mktemp("pruned")
    L.seed_everything(0, verbose=False)
    callbacks = [
        StructuredPruning(amount=0.5, start_epoch=1, finetune_epochs=0, round_to=None, latency_batch_sizes=()),
        ModelCheckpoint(dirpath=root, filename="pruned"),
    ]
    tiny_trainer(root, max_epochs=2, enable_checkpointing=True, callbacks=callbacks).fit(TinyClassifier())
    return root / "pruned.ckpt"


def _raises_naming(argument: str, shown: str, call: Callable[[], Any]) -> str:
    """Run ``call``; it must raise ValueError naming `argument` and showing the value after "got"."""
    with pytest.raises(ValueError, match=f"`{re.escape(argument)}`") as caught:
        call()
    assert re.search(r"got .*" + re.escape(shown), str(caught.value)), str(caught.value)
    return str(caught.value)


# ---------------------------------------------------------------- StructuredPruning's constructor


def test_one_string_for_ignored_layers_is_refused_not_split_into_characters() -> None:
    """`ignored_layers="net.0"` is a ValueError that shows the list to write, not a complaint about layer 'n'."""
    message = _raises_naming("ignored_layers", "'net.0'", lambda: StructuredPruning(amount=0.5, ignored_layers="net.0"))
    assert "['net.0']" in message


@pytest.mark.parametrize(("value", "shown"), [(nn.Linear(2, 2), "Linear(...)"), (["net.0", ""], "['net.0', '']")])
def test_ignored_layers_of_the_wrong_kind_are_refused(value: Any, shown: str) -> None:
    """A bare module (iterable for a Sequential) or an empty name in `ignored_layers` is refused in the constructor."""
    _raises_naming("ignored_layers", shown, lambda: StructuredPruning(amount=0.5, ignored_layers=value))


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        ("x", "'x'"),
        (torch.tensor(1.0), "a tensor of shape ()"),
        ((), "()"),
        ([1, 2], "[1, 2]"),
        ({1: torch.zeros(1, 4)}, "{1: Tensor[1, 4]}"),
    ],
)
def test_example_input_of_the_wrong_type_is_refused_in_the_constructor(value: Any, shown: str) -> None:
    """An `example_input` that is not a tensor with a batch dimension (or a tuple/list/dict holding one) is refused."""
    _raises_naming("example_input", shown, lambda: StructuredPruning(amount=0.5, example_input=value))


@pytest.mark.parametrize(("value", "shown"), [(1, "1"), ("1", "'1'"), ({1}, "{1}")])
def test_latency_batch_sizes_that_is_not_a_list_is_refused(value: Any, shown: str) -> None:
    """`latency_batch_sizes=1` is a ValueError naming it (a list is documented; `[1]` is one batch size)."""
    _raises_naming("latency_batch_sizes", shown, lambda: StructuredPruning(amount=0.5, latency_batch_sizes=value))


def test_empty_monitor_name_is_refused() -> None:
    """`monitor=""` is refused in the constructor (None is how to report no metric)."""
    _raises_naming("monitor", "''", lambda: StructuredPruning(amount=0.5, monitor=""))


# ---------------------------------------------------------------- StructuredPruning in a fit


def test_example_input_of_the_wrong_shape_fails_at_fit_start_naming_it(tmp_path: Path) -> None:
    """A tensor the model cannot take fails before any training step, naming `example_input` and its shape."""
    counter = StepCounter()
    callback = StructuredPruning(amount=0.5, example_input=torch.randn(3), latency_batch_sizes=())
    trainer = tiny_trainer(tmp_path, max_epochs=2, callbacks=[callback, counter])
    with pytest.raises(ValueError, match=r"`example_input` must be an input TinyClassifier accepts, got a tensor of "):
        trainer.fit(TinyClassifier())
    assert counter.batches == 0


def test_example_input_that_fits_trains_and_prunes(tmp_path: Path) -> None:
    """A good `example_input` passes the fit-start check, and the model keeps its train mode for training."""
    model = TinyClassifier()
    model.example_input_array = None
    callback = StructuredPruning(amount=0.5, round_to=None, example_input=torch.randn(2, 16), latency_batch_sizes=())
    tiny_trainer(tmp_path, max_epochs=2, callbacks=[callback]).fit(model)
    assert model.net[0].out_features == 16
    assert model.training


def test_unlogged_monitor_fails_at_the_first_validation_listing_the_logged_metrics(tmp_path: Path) -> None:
    """A `monitor` that is not logged fails at the end of the first validation, before the first pruning step."""
    model = TinyClassifier()
    callback = StructuredPruning(amount=0.5, start_epoch=1, monitor="no_such_metric", latency_batch_sizes=())
    trainer = tiny_trainer(tmp_path, max_epochs=3, callbacks=[callback])
    with pytest.raises(ValueError, match="`monitor` must be a metric") as caught:
        trainer.fit(model)
    assert "got 'no_such_metric'; logged: 'train_loss', 'val_loss'" in str(caught.value)
    assert pruning_history(model) == []
    assert trainer.current_epoch == 0


def test_unlogged_monitor_without_validation_is_a_warning_at_the_report(tmp_path: Path) -> None:
    """With no validation to check it against, an unlogged `monitor` is said once, when the report is made."""
    callback = StructuredPruning(amount=0.5, monitor="no_such_metric", round_to=None, latency_batch_sizes=())
    trainer = tiny_trainer(tmp_path, max_epochs=2, limit_val_batches=0, callbacks=[callback])
    with pytest.warns(UserWarning, match="`monitor` 'no_such_metric' was never logged") as caught:
        trainer.fit(TinyClassifier())
    assert sum("was never logged" in str(w.message) for w in caught) == 1
    assert callback.report()["finished"]


def test_a_logged_training_metric_can_be_the_monitor(tmp_path: Path) -> None:
    """The check at the first validation accepts any logged metric, a training one included."""
    callback = StructuredPruning(amount=0.5, start_epoch=1, monitor="train_loss", round_to=None, latency_batch_sizes=())
    tiny_trainer(tmp_path, max_epochs=3, callbacks=[callback]).fit(TinyClassifier())
    assert callback.report()["metric_after"] is not None


# ---------------------------------------------------------------- load_pruned_checkpoint


@pytest.mark.parametrize(("value", "shown"), [(None, "None"), ("m", "'m'"), (5, "5"), (TinyClassifier, "class")])
def test_load_into_something_that_is_not_a_module_is_refused(pruned_checkpoint: Path, value: Any, shown: str) -> None:
    """`model` that is not a module instance (None, a name, a number, the class itself) is a ValueError naming it."""
    _raises_naming("model", shown, lambda: load_pruned_checkpoint(value, pruned_checkpoint))


def test_missing_checkpoint_names_the_argument_and_the_path(tmp_path: Path) -> None:
    """A missing file is a FileNotFoundError whose message names `checkpoint_path` and the path."""
    missing = tmp_path / "missing.ckpt"
    with pytest.raises(
        FileNotFoundError, match=f"`checkpoint_path` must be an existing .*, got '{re.escape(str(missing))}'"
    ):
        load_pruned_checkpoint(TinyClassifier(), missing)


@pytest.mark.parametrize(("value", "shown"), [("", "''"), (5, "5"), (None, "None"), (b"x.ckpt", "b'x.ckpt'")])
def test_checkpoint_path_that_is_not_a_path_is_refused(value: Any, shown: str) -> None:
    """An empty path or a value that is not a str/Path is a ValueError naming it, not a "corrupted checkpoint"."""
    message = _raises_naming("checkpoint_path", shown, lambda: load_pruned_checkpoint(TinyClassifier(), value))
    assert "must be the path of a checkpoint file" in message


def test_checkpoint_path_of_a_directory_says_so(tmp_path: Path) -> None:
    """A directory is named as one, not reported as a truncated or corrupted checkpoint."""
    message = _raises_naming(
        "checkpoint_path", str(tmp_path), lambda: load_pruned_checkpoint(TinyClassifier(), tmp_path)
    )
    assert "which is a directory" in message


@pytest.mark.parametrize(("value", "shown"), [("yes", "'yes'"), (None, "None"), (1, "1")])
def test_strict_that_is_not_a_bool_is_refused(pruned_checkpoint: Path, value: Any, shown: str) -> None:
    """`strict="yes" | None | 1` is a ValueError naming `strict` (1 is not True here)."""
    _raises_naming("strict", shown, lambda: load_pruned_checkpoint(TinyClassifier(), pruned_checkpoint, strict=value))


@pytest.mark.parametrize(("value", "shown"), [("x", "'x'"), (5, "5"), (torch.tensor(1.0), "shape ()")])
def test_example_input_of_the_wrong_type_is_refused_on_an_unpruned_checkpoint(
    tmp_path: Path, value: Any, shown: str
) -> None:
    """On a checkpoint with no pruning state, where it is never used, a wrong `example_input` is still refused."""
    path = tmp_path / "plain.ckpt"
    torch.save({"state_dict": TinyClassifier().state_dict()}, path)
    _raises_naming("example_input", shown, lambda: load_pruned_checkpoint(TinyClassifier(), path, example_input=value))


def test_example_input_of_the_wrong_shape_is_named(pruned_checkpoint: Path) -> None:
    """A tensor the model cannot take is a ValueError naming `example_input`, not a tracing error about a layer."""
    wrong = torch.zeros(1, 3)
    _raises_naming(
        "example_input",
        "a tensor of shape (1, 3)",
        lambda: load_pruned_checkpoint(TinyClassifier(), pruned_checkpoint, example_input=wrong),
    )


def test_checkpoint_of_another_model_names_the_model(pruned_checkpoint: Path) -> None:
    """A history naming layers the given model lacks is a ValueError naming `model`, not an AttributeError."""
    other = nn.Sequential(nn.Linear(16, 4))
    message = _raises_naming("model", "Sequential", lambda: load_pruned_checkpoint(other, pruned_checkpoint))
    assert "'net.0'" in message


@pytest.mark.parametrize("history", ["abc", [("net.0", True)], [("net.0", "yes", [0])]])
def test_malformed_pruning_state_names_the_file(tmp_path: Path, pruned_checkpoint: Path, history: Any) -> None:
    """A checkpoint whose pruning history is malformed gets one ValueError naming `checkpoint_path` and the file."""
    checkpoint = torch.load(pruned_checkpoint, weights_only=True)
    key = next(k for k in checkpoint["callbacks"] if k.startswith("StructuredPruning"))
    checkpoint["callbacks"][key]["history"] = history
    path = tmp_path / "malformed.ckpt"
    torch.save(checkpoint, path)
    message = _raises_naming(
        "checkpoint_path", "malformed.ckpt", lambda: load_pruned_checkpoint(TinyClassifier(), path)
    )
    assert "`history`" in message


def test_empty_file_names_the_file(tmp_path: Path) -> None:
    """A zero-byte file (a copy cut off at once) is one ValueError naming the file."""
    path = tmp_path / "empty.ckpt"
    path.write_bytes(b"")
    _raises_naming("checkpoint_path", "empty.ckpt", lambda: load_pruned_checkpoint(TinyClassifier(), path))


# ---------------------------------------------------------------- the functions


PLAN = {"model": NET, "example_input": X, "ratio": 0.5}
CASES: list[tuple[Callable[..., Any], dict[str, Any], str, str]] = [
    (pruning.plan_pruning, {**PLAN, "ignored_layers": "2"}, "ignored_layers", "'2'"),
    (pruning.plan_pruning, {**PLAN, "ignored_layers": ["9"]}, "ignored_layers", "['9']"),
    (pruning.plan_pruning, {**PLAN, "ratio": 1.5}, "ratio", "1.5"),
    (pruning.plan_pruning, {**PLAN, "ratio": True}, "ratio", "True"),
    (pruning.plan_pruning, {**PLAN, "importance": "taylor"}, "importance", "'taylor'"),
    (pruning.plan_pruning, {**PLAN, "round_to": 0}, "round_to", "0"),
    (pruning.plan_pruning, {**PLAN, "model": "net"}, "model", "'net'"),
    (pruning.pruned_copy, {"model": NET, "example_input": "x", "ratio": 0.5}, "example_input", "'x'"),
    (pruning.count_macs_params, {"model": "m", "example_input": X}, "model", "'m'"),
    (pruning.output_layer_names, {"model": NET, "example_input": None}, "example_input", "None"),
    (pruning.unsupported_layer_names, {"model": 5}, "model", "5"),
    (pruning.pruning_history, {"model": None}, "model", "None"),
    (pruning.apply_pruning_history, {"model": NET, "example_input": X, "history": "abc"}, "history", "'abc'"),
    (pruning.apply_pruning_history, {"model": NET, "example_input": X, "history": [("9", True, [0])]}, "history", "9"),
    (pruning.replay_pruning_history, {"model": NET, "example_input": X, "history": 5}, "history", "5"),
    (pruning.channel_step_ratio, {"amount": 0.5, "step": 0, "steps": 0}, "steps", "0"),
    (pruning.channel_step_ratio, {"amount": 0.5, "step": 2, "steps": 2}, "step", "2"),
    (pruning.channel_step_ratio, {"amount": 1.5, "step": 0, "steps": 1}, "amount", "1.5"),
    (pruning.cpu_latency_ms, {"model": NET, "example_input": X, "batch_size": 0}, "batch_size", "0"),
    (pruning.device_latency_ms, {"model": NET, "example_input": X, "device": "gpu"}, "device", "'gpu'"),
    (pruning.latency_speedup, {"reference": NET, "candidate": NET, "example_input": X, "rounds": 0}, "rounds", "0"),
    (pruning.latency_speedup, {"reference": NET, "candidate": None, "example_input": X}, "candidate", "None"),
    (pruning.search_target, {"model": NET, "example_input": X, "target": 1.5, "kind": "flops"}, "kind", "'flops'"),
    (pruning.search_target, {"model": NET, "example_input": X, "target": -1.0}, "target", "-1.0"),
    (pruning.search_pruning_ratio, {"model": NET, "example_input": X, "target_macs": 0}, "target_macs", "0"),
    (pruning.search_latency_ratio, {"model": NET, "example_input": X, "target_speedup": "2"}, "target_speedup", "'2'"),
    (pruning.find_attention, {"model": None}, "model", "None"),
    (pruning.update_head_counts, {"model": NET, "layers": "qkv"}, "layers", "'qkv'"),
]


@pytest.mark.parametrize(
    ("function", "kwargs", "argument", "shown"), CASES, ids=[f"{c[0].__name__}-{c[2]}={c[3]}" for c in CASES]
)
def test_function_refuses_bad_input_naming_it(
    function: Callable[..., Any], kwargs: dict[str, Any], argument: str, shown: str
) -> None:
    """Each public function of the pruning package raises ValueError naming the argument and the value received."""
    _raises_naming(argument, shown, lambda: function(**kwargs))


# ---------------------------------------------------------------- the package's shape


def test_no_import_circle_between_the_pruning_modules() -> None:
    """No module of the pruning package imports (even for typing) one that imports it back, directly or not."""
    graph: dict[str, set[str]] = {}
    for path in PACKAGE.glob("*.py"):
        found = {
            node.module.rsplit(".", 1)[-1]
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("lightning_speedkit.pruning.")
        }
        graph[path.stem] = found

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        return any(n == goal or (n not in seen and reaches(n, goal, seen | {n})) for n in graph.get(start, ()))

    assert [m for m in graph if m != "__init__" and reaches(m, m, set())] == []


def test_the_default_monitor_unlogged_is_a_warning_not_an_error(tmp_path: Path) -> None:
    """A module that logs no ``val_loss`` still prunes under the default `monitor`: one warning, no error."""

    class LogsOther(TinyClassifier):
        def validation_step(self, batch: Any, batch_idx: int) -> None:
            x, y = batch
            self.log("val/loss", torch.nn.functional.cross_entropy(self(x), y))

    callback = StructuredPruning(amount=0.5, start_epoch=1, round_to=None, latency_batch_sizes=())
    with pytest.warns(UserWarning, match="`monitor` 'val_loss' was never logged"):
        tiny_trainer(tmp_path, max_epochs=3, callbacks=[callback]).fit(LogsOther())
    assert callback.report()["finished"]


class TwoInputs(TinyClassifier):
    """A model of two inputs fed ``(x, z, y)`` batches, with no ``example_input_array``."""

    def __init__(self) -> None:
        super().__init__()
        self.example_input_array = None

    @override
    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return super().forward(x + z)

    @override
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, z, y = batch
        return nn.functional.cross_entropy(self(x, z), y)

    @override
    def train_dataloader(self) -> Any:
        x = torch.randn(32, 16)
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x, (x[:, 0] > 0).long()), batch_size=8)


def test_a_batch_whose_first_item_is_not_the_whole_input_is_named_at_the_first_batch_not_at_start_epoch(
    tmp_path: Path,
) -> None:
    """Without ``example_input`` the first item of the first batch is the example: checked before any step.

    A two-input model failed with a bare ``TypeError`` from the MAC counter at the first batch of ``start_epoch``,
    after the epochs before it had trained.
    """
    counter = StepCounter()
    callback = StructuredPruning(amount=0.5, start_epoch=2, latency_batch_sizes=(), monitor=None)
    trainer = tiny_trainer(tmp_path, max_epochs=4, callbacks=[callback, counter], limit_val_batches=0)
    with pytest.raises(ValueError, match=r"`example_input` must be an input TwoInputs accepts.*missing 1 required"):
        trainer.fit(TwoInputs())
    assert counter.batches == 0


def test_max_steps_that_ends_the_fit_before_the_pruning_epochs_is_refused_before_any_step(tmp_path: Path) -> None:
    """``max_steps`` ending the fit before ``start_epoch`` is refused, as a short ``max_epochs`` is (nothing pruned)."""
    counter = StepCounter()
    callback = StructuredPruning(amount=0.5, start_epoch=5, latency_batch_sizes=())
    trainer = tiny_trainer(tmp_path, max_epochs=-1, max_steps=20, callbacks=[callback, counter])
    with pytest.raises(ValueError, match=r"`max_steps`=20 ends it in epoch 2 \(8 optimizer steps an epoch\)"):
        trainer.fit(TinyClassifier())
    assert counter.batches == 0


class StopAtEpoch(Callback):
    """Stops the fit at the end of epoch ``epoch``, as early stopping would."""

    def __init__(self, epoch: int) -> None:
        self.epoch = epoch

    @override
    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Stop at the epoch."""
        trainer.should_stop = trainer.current_epoch >= self.epoch


def test_a_fit_stopped_before_the_first_pruning_step_warns_that_nothing_was_pruned(tmp_path: Path) -> None:
    """A fit that ends early, before ``start_epoch``, says nothing was pruned rather than ending silently."""
    callback = StructuredPruning(amount=0.5, start_epoch=2, latency_batch_sizes=())
    trainer = tiny_trainer(tmp_path, max_epochs=4, callbacks=[callback, StopAtEpoch(0)])
    with pytest.warns(UserWarning, match=r"ended after 1 epoch\(s\), before the first pruning step at `start_epoch`=2"):
        trainer.fit(TinyClassifier())
    assert callback.report() == {}
