"""ChannelsLast, the callback: a real fit converts conv nets (and only those), checkpoints and DDP keep working."""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import pytest
import torch
from conftest import TinyClassifier, load_benchmark, tiny_trainer
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, TensorDataset

from lightning_speedkit import ChannelsLast
from lightning_speedkit.demo import DemoClassifier
from lightning_speedkit.layout import has_convolutions, is_channels_last


def _images(n: int = 32, size: int = 16) -> DataLoader[tuple[torch.Tensor, ...]]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(n, 3, size, size, generator=generator)
    y = torch.randint(0, 10, (n,), generator=generator)
    return DataLoader(TensorDataset(x, y), batch_size=8)


def _fit(tmp_path: Path, callbacks: list[L.Callback], **kwargs: object) -> tuple[DemoClassifier, L.Trainer]:
    L.seed_everything(0, verbose=False)
    model = DemoClassifier(width=4, crop_size=16)
    trainer = tiny_trainer(tmp_path, max_epochs=2, callbacks=callbacks, **kwargs)
    trainer.fit(model, _images(), _images(16))
    return model, trainer


def test_fit_trains_in_channels_last_to_the_same_weights(tmp_path: Path) -> None:
    """A real fit with the callback ends with NHWC weights equal (to float tolerance) to a run without it."""
    plain, _ = _fit(tmp_path / "plain", [])
    fast, trainer = _fit(tmp_path / "fast", [ChannelsLast()])
    assert is_channels_last(fast)
    assert not is_channels_last(plain)
    assert trainer.callbacks[0].converted > 0  # type: ignore[attr-defined]
    for (name, a), b in zip(plain.state_dict().items(), fast.state_dict().values(), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-3, atol=1e-4, msg=name)


def test_checkpoint_loads_into_either_layout_and_resume_stays_channels_last(tmp_path: Path) -> None:
    """A checkpoint of an NHWC model loads into a fresh default-layout module; resuming with the callback stays NHWC."""
    model, trainer = _fit(tmp_path, [ChannelsLast()])
    path = tmp_path / "last.ckpt"
    trainer.save_checkpoint(path)
    fresh = DemoClassifier(width=4, crop_size=16)
    fresh.load_state_dict(torch.load(path, weights_only=True)["state_dict"])
    assert not is_channels_last(fresh)
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values(), strict=True))
    resumed = DemoClassifier(width=4, crop_size=16)
    tiny_trainer(tmp_path, max_epochs=3, callbacks=[ChannelsLast()]).fit(
        resumed, _images(), _images(16), ckpt_path=path
    )
    assert is_channels_last(resumed)


def test_model_without_convolutions_and_disabled_callback_are_left_alone(tmp_path: Path) -> None:
    """An MLP has nothing to convert; ``enabled=False`` converts nothing even on a conv net."""
    assert not has_convolutions(TinyClassifier())
    tiny_trainer(tmp_path, max_epochs=1, callbacks=[ChannelsLast()]).fit(TinyClassifier())
    model, _ = _fit(tmp_path, [ChannelsLast(enabled=False)])
    assert not is_channels_last(model)


class _RankState(L.Callback):
    """Writes each rank's layout and weights at the end of training."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        weights = [p.detach().flatten().tolist() for p in pl_module.parameters()]
        state = {"channels_last": is_channels_last(pl_module), "weights": weights}
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(state))


@pytest.mark.slow
@pytest.mark.ddp
def test_ddp_with_channels_last_weights_keeps_ranks_in_sync(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """2-process DDP (gloo, bucket views as preset builds them) trains NHWC weights; both ranks end identical.

    The reducer never has to copy a gradient whose strides differ from its bucket view (1x1 convs included).
    """
    strategy = DDPStrategy(start_method="spawn", process_group_backend="gloo", gradient_as_bucket_view=True)
    _fit(tmp_path, [ChannelsLast(), _RankState(tmp_path)], strategy=strategy, devices=2)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["channels_last"]
    assert ranks[1]["channels_last"]
    for a, b in zip(ranks[0]["weights"], ranks[1]["weights"], strict=True):
        assert a == pytest.approx(b, abs=1e-6)
    assert "Grad strides do not match bucket view strides" not in capfd.readouterr().err


def test_benchmark_quick_mode_compares_both_layouts_in_one_run(tmp_path: Path) -> None:
    """``benchmarks/channels_last.py --quick`` times both layouts, writes its JSON, and converts only the conv net."""
    benchmark = load_benchmark("channels_last")
    result = benchmark.main(["--quick", "--out", str(tmp_path / "channels_last.json")])
    assert json.loads((tmp_path / "channels_last.json").read_text()) == result
    converted = {row["model"]: row["tensors_converted"] for row in result["rows"]}
    assert converted["resnet"] > 0
    assert converted["mlp"] == 0
    assert all(row["nchw_ms"] > 0 and row["nhwc_ms"] > 0 for row in result["rows"])
