"""benchmarks/lr_tasks.py: the target and time-to-target arithmetic, and a quick run's JSON."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from conftest import load_benchmark


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    """The benchmark script, loaded by path."""
    return load_benchmark("lr_tasks")


def _timeline(*accs: float) -> list[dict[str, float]]:
    """A timeline with one point per second: epoch ``i`` at ``i + 1`` seconds with ``accs[i]``."""
    return [{"epoch": i, "seconds": float(i + 1), "val_acc": acc} for i, acc in enumerate(accs)]


@pytest.mark.parametrize(
    ("accs", "target", "expected"),
    [
        ((0.5, 0.6, 0.7), 0.8, None),  # a miss
        ((0.5, 0.85, 0.9), 0.8, 2.0),  # a hit at the second epoch
        ((0.5, 0.8), 0.8, 2.0),  # reaching the target exactly counts
        ((0.9, 0.5), 0.8, 1.0),  # the first hit, even if the run falls back later
        ((), 0.8, None),  # no validation at all
    ],
)
def test_time_to_target_is_the_first_validation_at_or_above_the_target(
    bench: ModuleType, accs: tuple[float, ...], target: float, expected: float | None
) -> None:
    """Time to target: the seconds of the first point with val_acc >= target, None when no point reaches it."""
    assert bench.time_to_target(_timeline(*accs), target) == expected


def test_target_comes_from_the_grid_lr_with_the_best_mean_peak(bench: ModuleType) -> None:
    """The best grid LR has the highest mean peak; the target is margin x its lowest seed's peak, to 3 places."""
    peaks = {0.1: [0.70, 0.72, 0.71], 1.0: [0.95, 0.90, 0.93], 10.0: [0.99, 0.20, 0.30]}
    assert bench.task_target(peaks, margin=0.98) == (1.0, round(0.98 * 0.90, 3))
    assert bench.task_target({1.0: [0.5]}, margin=1.0) == (1.0, 0.5)


@pytest.mark.parametrize(
    ("naive", "variant", "ratio", "is_later"),
    [
        (4.0, 2.0, 2.0, False),
        (2.0, 2.1, 2.0 / 2.1, False),  # 5% later: inside the noise allowance
        (2.0, 2.5, 0.8, True),
        (2.0, None, 0.0, True),  # the variant missed: infinitely late
        (None, 3.0, "naive missed", False),
        (None, None, "both missed", False),
    ],
)
def test_speedup_and_later_count_a_miss_as_infinitely_long(
    bench: ModuleType, naive: float | None, variant: float | None, ratio: float | str, is_later: bool
) -> None:
    """Naive time over the variant's, a miss infinite; 'later' only beyond the 10% noise allowance."""
    got = bench.speedup(naive, variant)
    assert got == pytest.approx(ratio) if isinstance(ratio, float) else got == ratio
    assert bench.later(naive, variant, noise=0.10) is is_later


@pytest.mark.parametrize(
    ("naive", "variant", "is_later"),
    [
        ([1.0, 1.1], 1.2, False),  # within 10% of the slower naive fit
        ([1.0, 1.1], 1.3, True),
        ([1.1, 1.1, 1.5, 1.5], 1.4, False),  # re-runs nudged 2 and 3 ulps crossed an epoch later: within the noise
        ([1.0, None], None, False),  # a naive fit that missed: nothing is later than the noise
        ([1.0, 1.0], None, True),  # a miss is later than every naive fit that reached
    ],
)
def test_later_than_every_compares_with_the_slowest_naive_fit(
    bench: ModuleType, naive: list[float | None], variant: float | None, is_later: bool
) -> None:
    """Beyond the noise means later than the slowest of every naive fit (a miss among them: never)."""
    assert bench.later_than_every(naive, variant) is is_later


def test_nudge_by_more_ulps_moves_further_from_the_same_start(bench: ModuleType) -> None:
    """Each re-run's nudge is another rounding-level start: n ulps up is n steps of nextafter."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    one, three = nn.Linear(3, 2), nn.Linear(3, 2)
    three.load_state_dict(one.state_dict())
    start = one.weight.detach().clone()
    bench.nudge_weights(one)
    bench.nudge_weights(three, ulps=3)
    up = torch.nextafter(start, torch.full_like(start, math.inf))
    assert torch.equal(one.weight, up)
    for _ in range(2):
        up = torch.nextafter(up, torch.full_like(up, math.inf))
    assert torch.equal(three.weight, up)


def test_oracle_is_the_fastest_grid_lr_that_reached_and_over_handles_misses(bench: ModuleType) -> None:
    """The oracle ignores grid LRs that missed; auto/oracle is infinite for a missed auto run."""
    assert bench.oracle_time([None, 3.0, 2.5, None]) == 2.5
    assert bench.oracle_time([None, None]) is None
    assert bench.over(3.0, 2.0) == 1.5
    assert math.isinf(bench.over(None, 2.0))


def test_nudge_moves_each_nonzero_weight_one_ulp_and_leaves_zeros_and_buffers(bench: ModuleType) -> None:
    """The nudged naive fit starts from the same model to any user: every non-zero weight one float ulp up."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    with torch.no_grad():
        model[0].bias.zero_()
    before = {name: p.detach().clone() for name, p in model.state_dict().items()}
    bench.nudge_weights(model)
    after = model.state_dict()
    weight = before["0.weight"]
    assert torch.equal(after["0.weight"], torch.nextafter(weight, torch.full_like(weight, math.inf)))
    assert not torch.equal(after["0.weight"], weight)
    assert torch.equal(after["0.bias"], before["0.bias"])  # zeros stay zeros: no denormal
    assert torch.equal(after["1.running_mean"], before["1.running_mean"])  # buffers are not parameters
    assert torch.allclose(after["0.weight"], weight, rtol=1e-6, atol=0)


def test_quick_without_out_never_writes_the_committed_result(bench: ModuleType) -> None:
    """--quick with no --out writes to a new temp dir; --out is used as given."""
    path = bench.out_path(None, quick=True)
    assert path != bench.DEFAULT_OUT
    assert path.parent.is_dir()
    assert bench.out_path(None, quick=False) == bench.DEFAULT_OUT
    assert bench.out_path("x/y.json", quick=True) == Path("x/y.json")


def test_unknown_task_is_refused(bench: ModuleType) -> None:
    """--tasks naming no known task stops with a usage error."""
    with pytest.raises(SystemExit):
        bench.main(["--quick", "--tasks", "resnet"])


def test_quick_run_records_every_variant_with_its_timeline_and_the_summary(bench: ModuleType, tmp_path: Path) -> None:
    """A quick run of two tasks (about 4 s) writes every run (timeline, time to target) and the summaries."""
    out = tmp_path / "lr_tasks.json"
    bench.main(["--quick", "--tasks", "mlp,conv", "--threads", "1", "--out", str(out)])
    result: dict[str, Any] = json.loads(out.read_text())
    assert result["config"]["margin"] == 0.98
    assert result["config"]["seeds"] == [0]
    assert set(result["config"]["tasks"]) == {"mlp", "conv"}
    assert result["config"]["tasks"]["mlp"]["right_lr"] > 0
    assert {"cpu", "isa"} <= set(result["machine"])
    assert len(result["load_average"]["before"]) == len(result["load_average"]["after"]) == 3

    runs = result["runs"]
    assert len(runs) == 2 * 2 * 4  # tasks x user LRs x variants; the quick grid (1x) is the naive fit at 1x
    assert {r["variant"] for r in runs} == {"naive", "preset", "preset_auto", "naive_nudged"}
    for run in runs:
        assert run["timeline"], run
        assert {"epoch", "seconds", "val_acc"} <= set(run["timeline"][0])
        assert run["reached"] == (run["time_to_target_s"] is not None)
        assert run["peak_val_acc"] >= run["final_val_acc"]
        assert run["fit_s"] >= run["timeline"][-1]["seconds"]
        if run["variant"] not in ("naive", "naive_nudged"):
            assert {"levers", "lr_finder", "warmup"} <= set(run["decisions"])
            assert run["chosen_lr"] > 0

    for name, task in result["tasks"].items():
        assert 0 < task["target"] <= max(r["peak_val_acc"] for r in runs if r["task"] == name)
        assert task["oracle_s"]["0"] is not None  # the best grid LR reaches the target by construction
        assert len(task["cells"]) == 2
        for cell in task["cells"]:
            assert {"naive_s", "preset_s", "preset_auto_s", "oracle_s", "preset_vs_naive", "auto_vs_naive"} <= set(cell)
            assert cell["preset_later_than_both"] <= cell["preset_later"]  # the slower naive fit is the later one
    summary = result["summary"]
    assert summary["cells"] == 4
    assert summary["noise_allowance"] == 0.10
    assert 0 <= summary["preset_later_than_naive"] <= 4
    assert 0 <= summary["auto_later_than_naive"] <= 4
    assert summary["preset_later_than_both_naive_fits"] <= summary["preset_later_than_naive"]
    assert "auto_over_oracle_median_over_tasks" in summary
    assert "lr_free" not in summary  # without --lr-free, the JSON is as before
    assert "rechecks" not in result  # without --recheck, nothing ran again
    assert "preset_later_repeated" not in summary
    assert all("recheck" not in cell for task in result["tasks"].values() for cell in task["cells"])
    assert all("over_oracle_median" not in task for task in result["tasks"].values())


def test_recheck_fits_only_the_late_cells_again_and_says_whether_the_lateness_repeats(
    bench: ModuleType, tmp_path: Path
) -> None:
    """--recheck-from: the late cell (preset only) runs naive, naive nudged 2 ulps and preset again; nothing else runs.

    The lateness counts beyond the noise only when it is also later than every naive fit.
    """
    first = tmp_path / "lr_tasks.json"
    bench.main(["--quick", "--tasks", "mlp", "--threads", "1", "--out", str(first)])
    result: dict[str, Any] = json.loads(first.read_text())
    for index, cell in enumerate(result["tasks"]["mlp"]["cells"]):
        cell["preset_later"], cell["auto_later"] = index == 1, False  # as if preset was late in the second cell
        average = "preset_auto_average"  # as if the run had --average, whose medians the JSON holds as text
        cell |= {f"{average}_s": None, f"{average}_later": False, f"{average}_later_than_both": False}
    result["tasks"]["mlp"]["over_oracle_median"] = {"preset_auto_average": "inf"}
    first.write_text(json.dumps(result))
    out = tmp_path / "rechecked.json"
    bench.main(["--recheck-from", str(first), "--recheck", "1", "--threads", "1", "--out", str(out)])
    rechecked: dict[str, Any] = json.loads(out.read_text())
    assert rechecked["runs"] == result["runs"]
    late = rechecked["tasks"]["mlp"]["cells"][1]
    again = rechecked["rechecks"]
    assert sorted(r["variant"] for r in again) == ["naive", "naive_nudged", "preset"]
    assert [r["nudge_ulps"] for r in again if r["variant"] == "naive_nudged"] == [2]  # not the first run's nudge
    assert {(r["factor"], r["seed"], r["recheck"]) for r in again} == {(late["factor"], late["seed"], 0)}
    assert set(late["recheck"]) == {"naive_s", "naive_nudged_s", "preset_s"}
    assert isinstance(late["preset_later_repeated"], bool)
    naive = [late["naive_s"], late["naive_nudged_s"], *late["recheck"]["naive_s"], *late["recheck"]["naive_nudged_s"]]
    assert late["preset_later_than_every"] == bench.later_than_every(naive, late["preset_s"])
    assert "recheck" not in rechecked["tasks"]["mlp"]["cells"][0]
    summary = rechecked["summary"]
    assert summary["preset_later_repeated"] == int(late["preset_later_repeated"])
    assert summary["auto_later_repeated"] == 0
    beyond = late["preset_later_repeated"] and late["preset_later_than_every"]
    assert summary["preset_later_beyond_noise"] == int(beyond)
    assert rechecked["config"]["recheck"] == 1
    assert summary["average"]["preset_auto_average"]["over_oracle_median_over_tasks"] == "inf"
    with pytest.raises(SystemExit):
        bench.main(["--recheck-from", str(first)])  # a re-check needs --recheck N
    with pytest.raises(SystemExit):
        bench.main(["--recheck-from", str(first), "--recheck", "1", "--seeds", "0"])  # the file's own cells only
    with pytest.raises(ValueError, match="re-checked already"):
        bench.main(["--recheck-from", str(out), "--recheck", "1"])


def test_lr_free_run_adds_the_three_optimizers_to_every_cell_and_counts_them(bench: ModuleType, tmp_path: Path) -> None:
    """--lr-free: each cell also runs preset() with Prodigy, D-Adaptation and Schedule-Free, counted like auto."""
    pytest.importorskip("prodigyopt")
    pytest.importorskip("schedulefree")
    pytest.importorskip("dadaptation")
    out = tmp_path / "lr_free.json"
    bench.main(["--quick", "--tasks", "mlp", "--threads", "1", "--lr-free", "--out", str(out)])
    result: dict[str, Any] = json.loads(out.read_text())
    free_variants = ["preset_prodigy", "preset_dadapt", "preset_schedulefree"]
    assert result["config"]["variants"] == [*bench.VARIANTS, *free_variants]
    runs = result["runs"]
    assert len(runs) == 2 * 7  # user LRs x variants
    prodigy = [r for r in runs if r["variant"] == "preset_prodigy"]
    assert len(prodigy) == 2
    assert all(r["prodigy_d"] > 1e-6 for r in prodigy)  # its estimate grew from d0
    assert all(r["optimizer"] == "Prodigy" and r["chosen_lr"] is None for r in prodigy)  # the user's LR unused
    assert all(r["lr_argument"] is False and r["decisions"]["lr_finder"] is None for r in prodigy)
    dadapt = [r for r in runs if r["variant"] == "preset_dadapt"]
    assert all(r["optimizer"] == "DAdaptSGD" and r["chosen_lr"] is None for r in dadapt)  # the MLP trains with SGD
    assert all(r["dadapt_d"] > 1e-6 for r in dadapt)
    free = [r for r in runs if r["variant"] == "preset_schedulefree"]
    assert {r["optimizer"] for r in free} == {"SGDScheduleFree"}  # the MLP task trains with SGD
    assert all(r["chosen_lr"] == r["lr"] for r in free)
    assert all(r["decisions"]["warmup"] is None for r in free)  # preset(warmup=False): the optimizer needs none

    (task,) = result["tasks"].values()
    assert set(task["over_oracle_median"]) == set(free_variants)
    for cell in task["cells"]:
        for variant in free_variants:
            assert f"{variant}_s" in cell
            assert cell[f"{variant}_later_than_both"] <= cell[f"{variant}_later"]
    counts = result["summary"]["lr_free"]
    assert set(counts) == set(free_variants)
    for variant, count in counts.items():
        later = sum(c[f"{variant}_later"] for c in task["cells"])
        assert count["later_than_naive"] == later
        assert "over_oracle_median_over_tasks" in count


def test_average_run_adds_the_averaged_variant_to_every_cell_and_counts_it(bench: ModuleType, tmp_path: Path) -> None:
    """--average: each cell also runs preset(lr="auto", average=True), counted against naive and preset_auto."""
    out = tmp_path / "average.json"
    bench.main(["--quick", "--tasks", "mlp", "--threads", "1", "--average", "--out", str(out)])
    result: dict[str, Any] = json.loads(out.read_text())
    assert result["config"]["variants"] == [*bench.VARIANTS, "preset_auto_average"]
    averaged = [r for r in result["runs"] if r["variant"] == "preset_auto_average"]
    assert len(averaged) == 2  # one per user LR
    assert all(r["lr_argument"] == "auto" and r["decisions"]["lr_finder"] is not None for r in averaged)
    assert all(0.0 < r["decisions"]["average"]["decay"] < 1.0 for r in averaged)  # set from the run's epochs
    plain = [r for r in result["runs"] if r["variant"] == "preset_auto"]
    assert all(r["decisions"]["average"] is None for r in plain)
    (task,) = result["tasks"].values()
    assert all("preset_auto_average_s" in cell for cell in task["cells"])
    counts = result["summary"]["average"]["preset_auto_average"]
    assert {"later_than_naive", "later_than_preset_auto"} <= set(counts)
    assert "lr_free" not in result["summary"]


def test_torch_threads_are_put_back_even_when_the_run_fails(bench: ModuleType) -> None:
    """The harness's `torch_threads` (lr_tasks' and fused_optimizer's --threads) restores torch's threads on errors."""
    import torch

    def failing_fit() -> None:
        with bench.torch_threads(1):
            assert torch.get_num_threads() == 1
            raise RuntimeError("a fit failed")

    before = torch.get_num_threads()
    with pytest.raises(RuntimeError, match="a fit failed"):
        failing_fit()
    assert torch.get_num_threads() == before
    with bench.torch_threads(None):  # None: as they are
        assert torch.get_num_threads() == before


def test_schedule_run_trains_every_fit_under_the_users_schedule(bench: ModuleType, tmp_path: Path) -> None:
    """--schedule linear: every fit trains under Hugging Face's linear warmup and decay, and the JSON says so.

    `lr="auto"` leaves such a run's LR as it is (the schedule starts at 0, a warmup: `LRFinder` skips its search).
    """
    out = tmp_path / "linear.json"
    bench.main(["--quick", "--tasks", "mlp", "--threads", "1", "--schedule", "linear", "--out", str(out)])
    result: dict[str, Any] = json.loads(out.read_text())
    assert result["config"]["schedule"] == "linear"
    assert result["config"]["tasks"]["mlp"]["schedule"] == "linear"
    auto = [r for r in result["runs"] if r["variant"] == "preset_auto"]
    assert len(auto) == 2
    for run in auto:
        finder = run["decisions"]["lr_finder"]
        assert (finder["scale"], finder["probed"]) == (1.0, False)
        assert "a warmup" in finder["reason"]


def test_with_schedule_steps_the_users_lr_every_step(bench: ModuleType, tmp_path: Path) -> None:
    """The "linear" schedule rises from 0 over its warmup, then falls; "cosine" falls from the LR.

    "constant" is the model as it was; an unknown one is refused.
    """
    import lightning as L

    task = bench.TASKS["mlp"]
    seen: dict[str, list[float]] = {}

    class Lrs(L.Callback):
        def __init__(self, name: str) -> None:
            self.lrs = seen.setdefault(name, [])

        def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
            self.lrs.append(trainer.optimizers[0].param_groups[0]["lr"])

    for name in ("linear", "cosine"):
        small = bench.dataclasses.replace(task, samples=400, max_epochs=2)
        model = bench.with_schedule(task.make_model(task, 0.02), name)
        trainer = bench.quiet_trainer("cpu", devices=1, max_epochs=2, callbacks=[Lrs(name)], limit_val_batches=0)
        trainer.fit(model, small.make_data(small, 0, tmp_path))
    linear, cosine = seen["linear"], seen["cosine"]
    assert len(linear) == len(cosine) == 10  # 320 training samples in batches of 64, twice
    assert linear[0] == 0.0  # a 1-step warmup (6% of 10, rounded up)
    assert linear[1] == pytest.approx(0.02)
    assert linear[1:] == sorted(linear[1:], reverse=True)
    assert cosine[0] == pytest.approx(0.02)
    assert cosine == sorted(cosine, reverse=True)
    model = task.make_model(task, 0.02)
    assert bench.with_schedule(model, "constant") is model
    with pytest.raises(ValueError, match="`schedule` must be one of constant, linear, cosine, got 'step'"):
        bench.with_schedule(model, "step")
