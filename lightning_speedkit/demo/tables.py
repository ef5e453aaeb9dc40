"""The demo's tables: one run's side-by-side comparison, and the per-seed summary."""

from __future__ import annotations

from typing import Any

__all__ = ["format_report", "format_seeds"]


def format_report(report: dict[str, Any]) -> str:
    """The side-by-side table of :func:`run_demo`'s report."""
    config, runs = report["config"], report["runs"]
    names = list(runs)

    def seconds(value: float | None) -> str:
        return f"{value:.1f} s" if value is not None else "not reached"

    rows: list[tuple[str, ...]] = [
        ("", *names),
        (f"time to val_acc {config['target_acc']:.2f}", *(seconds(runs[n]["time_to_target_s"]) for n in names)),
        ("epochs", *(str(runs[n]["epochs"]) for n in names)),
        ("train samples/s", *(f"{runs[n]['samples_per_s']:.0f}" for n in names)),
        ("data wait", *(f"{100 * runs[n]['data_wait_fraction']:.1f}%" for n in names)),
        ("diagnosis", *(str(runs[n]["diagnosis"]) for n in names)),
        ("final val_acc", *(f"{runs[n]['final_val_acc'] or 0:.3f}" for n in names)),
        ("precision", *(str(runs[n]["choices"]["precision"]) for n in names)),
        ("optimizer update", *(str(runs[n]["choices"].get("optimizer", "not used")) for n in names)),
        ("peak LR", *(f"{runs[n]['lr']:g}" for n in names)),
        ("LR schedule", *(str(runs[n]["schedule"]) for n in names)),
        ("max epochs", *(str(runs[n]["max_epochs"]) for n in names)),
        ("LR decided", *(_short(runs[n]["choices"]["lr_reason"]) for n in names)),
        ("probes", *(_probes(runs[n]["choices"]) for n in names)),
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [
        f"demo workload: {config['num_images']} images {config['image_size']}px, width {config['width']},"
        f" batch {config['batch_size']}, AdamW"
    ]
    lines += _machine(report)
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    if report.get("speedup") is not None:
        lines.append(f"speed-up (time to target, baseline / speedkit): {report['speedup']:.2f}x")
    for name in names:
        lines.append(f"{name} diagnosis: {runs[name]['advice']}")
    return "\n".join(lines)


def _machine(report: dict[str, Any]) -> list[str]:
    """The line naming the CPU a report's figures come from (none for a file written before it was recorded).

    Example:
        >>> _machine({"machine": {"cpu": "AMD EPYC", "cores": 2, "isa": "AVX512", "isa_limit": "", "bf16": []}})
        ['on AMD EPYC: 2 cores, torch ISA AVX512, bf16 instructions: none']
        >>> _machine({})
        []
    """
    machine = report.get("machine")
    if not machine:
        return []
    limit = f", {machine['isa_limit']}" if machine["isa_limit"] else ""
    return [
        f"on {machine['cpu'] or 'an unnamed CPU'}: {machine['cores']} cores, torch ISA {machine['isa']}{limit},"
        f" bf16 instructions: {' '.join(machine['bf16']) or 'none'}"
    ]


def _short(text: str, width: int = 60) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def _probes(choices: dict[str, Any]) -> str:
    """What the probes cost, in all and by lever (``"none"`` for a run without any)."""
    probes = choices.get("probes") or {}
    if not probes:
        return "none"
    parts = ", ".join(f"{name} {seconds:.1f}" for name, seconds in probes.items())
    return f"{choices['probe_s']:.1f} s ({parts})"


def format_seeds(report: dict[str, Any]) -> str:
    """The per-seed table of `run_seeds` and its closing speed-up line."""
    config = report["config"]

    def cell(run: dict[str, Any]) -> str:
        reached = run["time_to_target_s"]
        return f"{reached:.1f} s ({run['epochs']} ep)" if reached else f"not reached ({run['final_val_acc'] or 0:.3f})"

    lines = [
        f"demo workload: {config['num_images']} images {config['image_size']}px, batch {config['batch_size']},"
        f" AdamW at {config['lr']:g}, budget {config['max_epochs']} epochs, target val_acc {config['target_acc']:.2f}",
    ]
    lines += _machine(report)
    lines += [
        f"{'seed':<6}{'baseline':<22}{'speedkit':<22}{'speed-up':>9}  speedkit chose",
    ]
    for row in report["seeds"]:
        chose = row["speedkit"]["choices"]
        picked = f"{chose['precision']}, {chose['channels_last']} layout, {chose.get('optimizer', 'not used')} update"
        picked += f", LR {chose['lr']:.2g}"
        picked += f", probes {chose['probe_s']:.1f} s"
        if chose.get("rollbacks"):
            picked += f", {chose['rollbacks']} rollback(s)"
        speedup = f"{'>=' if row.get('speedup_at_least') else ''}{row['speedup']:.2f}x"  # baseline missed: a bound
        lines.append(f"{row['seed']:<6}{cell(row['baseline']):<22}{cell(row['speedkit']):<22}{speedup:>9}  {picked}")
    s = report["summary"]
    lines.append(
        f"speed-up over seeds: median {s['median']:.2f}x, worst {s['worst']:.2f}x, reached {s['reached']}/{s['total']}"
    )
    return "\n".join(lines)
