"""benchmarks/_lr_free.py: the opt-in optimizers lr_tasks --lr-free measures, in real fits."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import lightning as L
import pytest
import torch
from conftest import load_benchmark
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

pytest.importorskip("prodigyopt")
pytest.importorskip("schedulefree")
pytest.importorskip("dadaptation")


@pytest.fixture(scope="module")
def free() -> ModuleType:
    """The helper module, loaded by path."""
    return load_benchmark("_lr_free")


class _Net(L.LightningModule):
    def __init__(self, optimizer: Callable[..., torch.optim.Optimizer] | None = None) -> None:
        super().__init__()
        self.net = nn.Linear(4, 2)
        self.optimizer = optimizer or (lambda params: torch.optim.SGD(params, lr=0.1))
        self.seen: list[torch.Tensor] = []  # the weights each validation epoch saw

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return nn.functional.cross_entropy(self.net(batch[0]), batch[1])

    def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        if batch_idx == 0:
            self.seen.append(self.net.weight.detach().clone())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return self.optimizer(self.parameters())


def _fit(model: L.LightningModule, callbacks: list[L.Callback], epochs: int = 2) -> L.Trainer:
    data = TensorDataset(torch.randn(32, 4), torch.randint(0, 2, (32,)))
    trainer = L.Trainer(
        max_epochs=epochs,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=callbacks,
    )
    trainer.fit(model, DataLoader(data, batch_size=8), DataLoader(data, batch_size=8))
    return trainer


@pytest.mark.parametrize("variant", ["preset_prodigy", "preset_dadapt", "preset_schedulefree"])
def test_the_swapped_optimizer_keeps_the_weight_decay_of_the_models_own(free: ModuleType, variant: str) -> None:
    """The demo's AdamW decays by 1e-4 (not AdamW's default 0.01), and the swapped optimizer does too."""
    from lightning_speedkit.demo import DemoClassifier

    model = DemoClassifier(lr=1e-3, crop_size=16)
    assert model.configure_optimizers().param_groups[0]["weight_decay"] == 1e-4
    free.swap_optimizer(model, variant)
    model.trainer = L.Trainer(max_steps=20, logger=False, enable_checkpointing=False)  # for the warmup's length
    swapped = model.configure_optimizers()
    assert type(swapped).__module__.split(".")[0] in ("prodigyopt", "dadaptation", "schedulefree")
    assert swapped.param_groups[0]["weight_decay"] == 1e-4


def test_prodigy_replaces_the_optimizer_at_lr_one_and_estimates_its_step(free: ModuleType) -> None:
    """preset_prodigy: the fit trains with Prodigy at lr=1.0, whatever the user's LR, and its step estimate grows."""
    from prodigyopt import Prodigy

    torch.manual_seed(0)
    model = _Net()
    free.swap_optimizer(model, "preset_prodigy")
    trainer = _fit(model, [])
    (optimizer,) = trainer.optimizers
    assert isinstance(optimizer, Prodigy)
    group = optimizer.param_groups[0]
    assert group["lr"] == 1.0
    assert group["weight_decay"] == 0.0  # the model's own SGD has none
    assert group["d"] > 1e-6  # d0: the estimate moved


@pytest.mark.parametrize(
    ("own", "kind", "decouple"),
    [
        (lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9), "DAdaptSGD", None),
        (lambda params: torch.optim.Adam(params, lr=0.05), "DAdaptAdam", False),
        (lambda params: torch.optim.AdamW(params, lr=0.05), "DAdaptAdam", True),
    ],
    ids=["sgd", "adam", "adamw"],
)
def test_dadapt_replaces_the_optimizer_at_lr_one_and_estimates_its_step(
    free: ModuleType, own: Callable[..., torch.optim.Optimizer], kind: str, decouple: bool | None
) -> None:
    """preset_dadapt: D-Adaptation at lr=1.0 whatever the user's LR, SGD's momentum kept, AdamW's decay decoupled."""
    import dadaptation

    torch.manual_seed(0)
    model = _Net(own)
    free.swap_optimizer(model, "preset_dadapt")
    trainer = _fit(model, [])
    (optimizer,) = trainer.optimizers
    assert type(optimizer) is getattr(dadaptation, kind)
    group = optimizer.param_groups[0]
    assert group["lr"] == 1.0
    assert group["d"] > 1e-6  # d0: the estimate moved
    if decouple is None:
        assert group["momentum"] == 0.9
    else:
        assert group["decouple"] is decouple


@pytest.mark.parametrize(
    ("own", "kind"),
    [
        (lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9), "SGDScheduleFree"),
        (lambda params: torch.optim.Adam(params, lr=0.05), "AdamWScheduleFree"),
    ],
    ids=["sgd", "adam"],
)
def test_schedulefree_trains_at_the_users_lr_and_validates_at_its_average(
    free: ModuleType, own: Callable[..., torch.optim.Optimizer], kind: str
) -> None:
    """preset_schedulefree: the user's LR, a 5% warmup; validation and the fit's end see the evaluation point."""
    import schedulefree

    torch.manual_seed(0)
    model = _Net(own)
    free.swap_optimizer(model, "preset_schedulefree")
    trainer = _fit(model, [free.ScheduleFreeModes()])
    (optimizer,) = trainer.optimizers
    assert type(optimizer) is getattr(schedulefree, kind)
    group = optimizer.param_groups[0]
    assert group["lr"] == 0.05
    assert group["warmup_steps"] == 1  # 5% of 2 epochs x 4 steps, rounded up
    assert not group["train_mode"]  # the fit left the averaged weights in the model
    assert torch.equal(model.seen[-1], model.net.weight)  # the last validation saw the weights the fit left
    optimizer.train()  # the training point differs from the average after real steps
    assert not torch.equal(model.seen[-1], model.net.weight)


def test_without_the_mode_callback_validation_sees_the_training_point(free: ModuleType) -> None:
    """The callback is what moves validation to the average: without it validation sees the training point."""
    torch.manual_seed(0)
    model = _Net(lambda params: torch.optim.AdamW(params, lr=0.05))
    free.swap_optimizer(model, "preset_schedulefree")
    trainer = _fit(model, [], epochs=1)
    (optimizer,) = trainer.optimizers
    assert optimizer.param_groups[0]["train_mode"]
    assert torch.equal(model.seen[-1], model.net.weight)  # the training point, never swapped out
    optimizer.eval()  # the average differs from it after real steps
    assert not torch.equal(model.seen[-1], model.net.weight)


def test_unknown_variant_is_refused(free: ModuleType) -> None:
    """A variant that is not an LR-free one is a clear error naming it."""
    message = "`variant` must be one of preset_prodigy, preset_dadapt, preset_schedulefree, got 'adam'"
    with pytest.raises(ValueError, match=message):
        free.swap_optimizer(_Net(), "adam")
