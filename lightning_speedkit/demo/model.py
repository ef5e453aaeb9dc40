"""A small ResNet-style classifier for the demo images, as a LightningModule that logs ``val_acc``."""

from __future__ import annotations

import lightning as L
import torch
from torch import nn
from torchmetrics.classification import MulticlassAccuracy
from typing_extensions import override

from lightning_speedkit.checks import check_choice, check_int, check_number

__all__ = ["DemoClassifier", "DemoResNet"]


class _BasicBlock(nn.Module):
    """Two 3x3 convolutions with a residual connection (a 1x1 projection when the shape changes)."""

    def __init__(self, in_channels: int, out_channels: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False), nn.BatchNorm2d(out_channels)
            )

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.relu(out + self.shortcut(x))


class DemoResNet(nn.Module):
    """A 3-stage ResNet: a stride-2 stem, then stages of ``width``, ``2*width``, ``4*width`` channels.

    Args:
        num_classes: Output classes.
        width: Channels of the first stage (the model-size knob).
        blocks_per_stage: Residual blocks in each stage.

    Example:
        >>> DemoResNet(width=8)(torch.zeros(2, 3, 56, 56)).shape
        torch.Size([2, 10])
    """

    def __init__(self, num_classes: int = 10, width: int = 16, blocks_per_stage: int = 1) -> None:
        super().__init__()
        check_int("num_classes", num_classes)
        check_int("width", width)
        check_int("blocks_per_stage", blocks_per_stage)
        self.stem = nn.Sequential(
            nn.Conv2d(3, width, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True)
        )
        layers: list[nn.Module] = []
        channels = width
        for stage in range(3):
            out_channels = width * 2**stage
            for block in range(blocks_per_stage):
                stride = 2 if stage > 0 and block == 0 else 1
                layers.append(_BasicBlock(channels, out_channels, stride))
                channels = out_channels
        self.stages = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Linear(channels, num_classes)

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stages(self.stem(x))
        return self.classifier(torch.flatten(self.pool(x), 1))  # type: ignore[no-any-return]


class FlatHeadNet(nn.Module):
    """One cheap convolution, gated activations and a linear head on the flattened map: a net NHWC makes slower.

    After an NHWC convolution, ``flatten`` must copy the activation back to NCHW order, and the element-wise
    backward ops run on tensors of mixed layouts; the single small convolution cannot pay for that. On 2 EPYC cores a
    training step ran 1.4-2.2x slower channels-last (``benchmarks/results/channels_last.json``), which is why
    `~lightning_speedkit.ChannelsLast` measures before it keeps NHWC.

    Example:
        >>> FlatHeadNet(crop_size=16)(torch.zeros(2, 3, 16, 16)).shape
        torch.Size([2, 10])
    """

    def __init__(self, num_classes: int = 10, width: int = 8, crop_size: int = 32) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, width, 3, padding=1)
        self.fc = nn.Linear(width * crop_size * crop_size, num_classes)

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.conv(x))
        x = nn.functional.gelu(x) * torch.sigmoid(x)
        return self.fc(x.flatten(1))  # type: ignore[no-any-return]


ARCHITECTURES = ("resnet", "flat_head")
"""The demo's networks: `DemoResNet`, and `FlatHeadNet` (the counter-example for channels-last)."""


class DemoClassifier(L.LightningModule):
    """The demo model as a LightningModule: AdamW at a constant LR, the optimizer a user would sensibly write.

    Args:
        num_classes: Output classes.
        width: Channels of the first stage.
        blocks_per_stage: Residual blocks in each stage.
        lr: AdamW learning rate.
        weight_decay: AdamW weight decay.
        crop_size: Side of the input images (sets ``example_input_array``).
        architecture: ``"resnet"`` (`DemoResNet`, the demo's) or ``"flat_head"`` (`FlatHeadNet`; ``width``
            channels, blocks unused).

    Logged metrics: ``train_loss`` (each step), ``val_loss`` and ``val_acc`` (each validation epoch).

    Example:
        >>> model = DemoClassifier(width=8)
        >>> model(model.example_input_array).shape
        torch.Size([1, 10])
    """

    def __init__(
        self,
        num_classes: int = 10,
        width: int = 16,
        blocks_per_stage: int = 1,
        lr: float = 1e-3,
        weight_decay: float = 1e-4,
        crop_size: int = 56,
        architecture: str = "resnet",
    ) -> None:
        super().__init__()
        check_number("lr", lr, 0, open_low=True)
        check_number("weight_decay", weight_decay, 0)
        check_int("crop_size", crop_size)
        check_choice("architecture", architecture, ARCHITECTURES)
        self.save_hyperparameters()
        self.lr = lr
        self.model: nn.Module = (
            DemoResNet(num_classes, width, blocks_per_stage)
            if architecture == "resnet"
            else FlatHeadNet(num_classes, width, crop_size)
        )
        self.val_acc = MulticlassAccuracy(num_classes=num_classes, average="micro")
        self.example_input_array = torch.zeros(1, 3, crop_size, crop_size)

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)  # type: ignore[no-any-return]

    @override
    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    @override
    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.val_acc(logits, y)
        self.log("val_loss", nn.functional.cross_entropy(logits, y), sync_dist=True)
        self.log("val_acc", self.val_acc, prog_bar=True)

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=self.hparams["weight_decay"])
