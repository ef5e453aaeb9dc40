"""The ``speedkit`` command: ``doctor``, ``demo`` (the main job) and ``bench``."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from lightning_speedkit.__about__ import __version__

__all__ = ["build_parser", "main"]

_DESCRIPTION = "lightning_speedkit: make PyTorch Lightning training fast without rewriting the model."


def build_parser() -> argparse.ArgumentParser:
    """The argument parser, one sub-parser per subcommand."""
    parser = argparse.ArgumentParser(prog="speedkit", description=_DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

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
    demo.add_argument("--quick", action="store_true", help="a tiny configuration that finishes in seconds")
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
    demo.add_argument("--cache-dir", help="where generated images are kept (default: $SPEEDKIT_CACHE_DIR or ~/.cache)")
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


def _demo(args: argparse.Namespace) -> int:
    from lightning_speedkit.demo.run import DemoConfig, format_report, run_demo

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
        }.items()
        if value is not None
    }
    config = DemoConfig.quick(**overrides) if args.quick else DemoConfig(**overrides)
    from lightning_speedkit.demo.run import ABLATION, VARIANTS, format_seeds, parse_seeds, run_seeds

    if args.seeds:
        seeds = parse_seeds(args.seeds)
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


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``speedkit`` command; returns the process exit code."""
    args = build_parser().parse_args(argv)
    if args.command == "doctor":
        from lightning_speedkit import doctor

        return doctor.main(json_output=args.json)
    if args.command == "bench":
        from lightning_speedkit.bench import run_from_args

        return run_from_args(args)
    return _demo(args)
