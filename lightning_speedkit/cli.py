"""The ``speedkit`` command: ``doctor``, ``demo`` (the main job) and ``bench``."""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from lightning_speedkit.__about__ import __version__

__all__ = ["MAX_SEEDS", "build_parser", "main"]

_DESCRIPTION = "lightning_speedkit: make PyTorch Lightning training fast without rewriting the model."

MAX_SEEDS = 64
"""The most seeds one ``speedkit demo --seeds`` call runs (each trains the model twice)."""

# DemoConfig's fields, by the flag that sets each: a config error names the flag the user typed.
_FLAGS = {"num_images": "--num-images", "max_epochs": "--max-epochs", "target_acc": "--target-acc",
          "batch_size": "--batch-size", "num_workers": "--num-workers", "width": "--width", "seed": "--seed",
          "lr": "--lr", "cache_dir": "--cache-dir", "seeds": "--seeds"}  # fmt: skip


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line on stderr and exit status 2 (argparse's own status), no usage."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser, one sub-parser per subcommand."""
    parser = _Parser(prog="speedkit", description=_DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True, parser_class=_Parser)

    doctor = commands.add_parser(
        "doctor",
        help="show this machine's hardware and software and what speedkit would choose",
        description="Print torch/lightning/CUDA versions, each GPU (compute capability, memory, bf16, tensor cores),"
        " whether NVML answers, CPU cores and bf16-relevant ISA features, and the recommended precision, strategy"
        " and num_workers.",
    )
    doctor.add_argument("--json", action="store_true", help="print machine-readable JSON instead of text")

    demo = commands.add_parser(
        "demo",
        help="train the demo workload twice (naive baseline, then speedkit) to a target accuracy, side by side",
        description="Generate the demo images (cached after the first run), then train the small ResNet twice to the"
        " same target val_acc within the same epoch budget: the naive baseline (plain Trainer, a JPEG decoded per"
        " sample, num_workers 0, fp32, AdamW at a constant LR of 1e-3) and speedkit (preset(lr='auto') with the"
        " library's defaults, on a packed cache of decoded images whose build is counted), with the same model, seed,"
        " data and LR. Prints a side-by-side table (time to target, throughput, data wait, diagnosis, accuracy,"
        " speed-up) and writes demo.json and demo.png. With --seeds, runs every seed (the two sides in alternating"
        " order) and ends with the median and worst speed-up.",
    )
    demo.add_argument(
        "--quick", action="store_true", help="the small run: 1,200 images, the whole 15-epoch budget (about a minute)"
    )
    demo.add_argument("--out", default="speedkit_out", help="directory for demo.json/png (default: %(default)s)")
    demo.add_argument(
        "--only",
        choices=["baseline", "cache", "channels_last", "speedkit"],
        help="train one variant instead of both (no comparison)",
    )
    demo.add_argument(
        "--ablation",
        action="store_true",
        help="also train 'cache' (baseline + packed cache) and 'channels_last' (+ ChannelsLast), to show what each"
        " part contributes",
    )
    demo.add_argument("--num-images", type=int, help="images generated (train + validation)")
    demo.add_argument("--max-epochs", type=int, help="the epoch budget of both runs (default 8)")
    demo.add_argument("--target-acc", type=float, help="stop when val_acc reaches this")
    demo.add_argument("--batch-size", type=int, help="samples per batch")
    demo.add_argument("--num-workers", type=int, help="DataLoader worker processes")
    demo.add_argument("--width", type=int, help="channels of the model's first stage")
    demo.add_argument("--seed", type=int, help="seed for data, split and weights")
    demo.add_argument("--seeds", help="run several seeds, e.g. 0-4 or 0,2,5, and summarise the speed-ups")
    demo.add_argument("--lr", type=float, help="the AdamW LR both runs are given (default 1e-3)")
    demo.add_argument(
        "--data",
        choices=("files", "streaming"),
        help="files: JPEGs decoded per sample (default); streaming: both runs stream from litdata's format"
        " (pip install 'lightning-speedkit[streaming]')",
    )
    demo.add_argument("--cache-dir", help="where generated images are kept (default: $SPEEDKIT_CACHE_DIR or ~/.cache)")
    commands.add_parser(
        "forget",
        help="forget every lever decision remembered across runs (the next runs probe again)",
        description="Remove the lever decisions speedkit remembers between runs ($SPEEDKIT_DECISIONS_DIR, or"
        " $SPEEDKIT_CACHE_DIR/decisions, default ~/.cache/lightning_speedkit/decisions); `speedkit doctor` lists them.",
    )
    from lightning_speedkit.bench import add_arguments as add_bench_arguments

    add_bench_arguments(
        commands.add_parser(
            "bench",
            help="run the repository's benchmarks and collect their tables into one report",
            description="Run each script in benchmarks/ (in a checkout of the repository) in its own process and"
            " write report.md and report.json with every table and JSON result.",
        )
    )
    return parser


def _flagged(error: ValueError) -> str:
    """A config error with each backticked field named by its flag (`max_epochs` -> --max-epochs)."""
    return re.sub(r"`(\w+)`", lambda m: _FLAGS.get(m.group(1), f"`{m.group(1)}`"), str(error)).rstrip(".")


def _writable_dir(flag: str, value: str) -> str | None:
    """Why ``value`` cannot be (made) a directory to write in, naming ``flag``; None when it can."""
    if not value.strip():
        return f"{flag} must be a directory, got {value!r}"
    path = Path(value)
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as err:
        return f"{flag} must be a directory this user can write to, got {value!r} ({err.strerror or err})"
    return None


def _demo_plan(args: argparse.Namespace) -> tuple[Any, list[int] | None]:
    """Check every demo flag before any work: the config and the seeds, or a ValueError naming the flag."""
    from lightning_speedkit.demo.run import DemoConfig, parse_seeds

    overrides = {
        key: value
        for key, value in {
            "num_images": args.num_images,
            "max_epochs": args.max_epochs,
            "target_acc": args.target_acc,
            "batch_size": args.batch_size,
            "num_workers": args.num_workers,
            "width": args.width,
            "seed": args.seed,
            "lr": args.lr,
            "cache_dir": args.cache_dir,
            "data": args.data,
        }.items()
        if value is not None
    }
    config = DemoConfig.quick(**overrides) if args.quick else DemoConfig(**overrides)
    seeds = None
    if args.seeds is not None:
        seeds = parse_seeds(args.seeds, most=MAX_SEEDS)
        if args.only or args.ablation or args.seed is not None:
            raise ValueError(
                "`seeds` runs baseline and speedkit on every seed; it takes no --only, --ablation or --seed."
            )
    return config, seeds


def _demo(args: argparse.Namespace) -> int:
    from lightning_speedkit.demo.run import ABLATION, VARIANTS, format_report, format_seeds, run_demo, run_seeds

    try:
        config, seeds = _demo_plan(args)
    except ValueError as err:
        return _fail(_flagged(err))
    for flag, value in (("--out", args.out), ("--cache-dir", args.cache_dir)):
        problem = None if value is None else _writable_dir(flag, value)
        if problem:
            return _fail(problem)
    if seeds is not None:
        print(f"speedkit demo: baseline and speedkit on seeds {args.seeds} to val_acc {config.target_acc:.2f} ...")
        report = run_seeds(config, seeds, out_dir=args.out)
        print(format_seeds(report))
        print(f"wrote {args.out}/demo.json")
        return 0

    variants = (args.only,) if args.only else ABLATION if args.ablation else VARIANTS
    print(f"speedkit demo: training {' and '.join(variants)} to val_acc {config.target_acc:.2f} ...", flush=True)
    report = run_demo(config, out_dir=args.out, variants=variants)
    print(format_report(report))
    written = [f"{args.out}/demo.json", *([report["plot"]] if report.get("plot") else [])]
    print(f"wrote {', '.join(written)}")
    return 0


def _fail(message: str) -> int:
    """One line on stderr, exit status 2: what argparse does for a bad flag, for a bad value found after parsing."""
    print(f"speedkit demo: error: {message}", file=sys.stderr)
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``speedkit`` command; returns the process exit code."""
    args = build_parser().parse_args(argv)
    if args.command == "doctor":
        from lightning_speedkit import doctor

        return doctor.main(json_output=args.json)
    if args.command == "forget":
        from lightning_speedkit.trials.memory import DecisionMemory

        memory = DecisionMemory()
        count = memory.forget()
        print(f"speedkit forget: {count} remembered decision(s) removed from {memory.root}")
        return 0
    if args.command == "bench":
        from lightning_speedkit.bench import run_from_args

        return run_from_args(args)
    return _demo(args)
