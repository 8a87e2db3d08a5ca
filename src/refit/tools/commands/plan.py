"""`refit plan`: a model's buckets, digest and memory before a run, from a preset or a config.json."""

from __future__ import annotations

import argparse

from rich.console import Console

from refit.tools.choices import PRESETS
from refit.tools.commands.common import at_least_one, at_least_zero, command_parser, emit_json, json_option


def run(args: argparse.Namespace, console: Console) -> int:
    from refit.tools.plan import plan_report, show_plan

    r = plan_report(args)
    if args.json:
        emit_json(r, args.json)
    return show_plan(r, args, console)


def add_parser(sub, common: argparse.ArgumentParser) -> None:  # type: ignore[no-untyped-def]
    planp = command_parser(
        sub,
        common,
        "plan",
        help="show the manifest and predicted memory for a model before a run",
        description="Plan a model's refit without moving any weights: its buckets, manifest digest and "
        "the memory each side will allocate, from a preset's shapes or a config.json.",
        epilog=f"presets: {', '.join(PRESETS)}",
    )
    planp.add_argument("--preset", default="qwen2-7b", help=f"synthetic shapes of a known model: {', '.join(PRESETS)}")
    planp.add_argument("--config", help="a transformers config.json to take the shapes from (instead of --preset)")
    planp.add_argument("--dtype", default="bfloat16", help="wire dtype of every tensor")
    planp.add_argument("--layers", type=int, help="keep only the model's first N layers (default: all)")
    planp.add_argument(
        "--ratio",
        type=float,
        help="fraction of free memory for the buffers (default: REFIT_BUFFER_MEMORY_RATIO, else 0.2)",
    )
    planp.add_argument(
        "--bucket-bytes", type=int, help="bucket capacity in bytes (default: REFIT_BUCKET_BYTES, else from --ratio)"
    )
    planp.add_argument(
        "--staging-bytes",
        type=at_least_zero,
        help="also show how Receiver(staged=True, staging_bytes=N) splits a refit: what staging holds, what the "
        "pause covers",
    )
    planp.add_argument(
        "--trainer-ranks",
        type=at_least_one,
        help="also show bytes and time per GPU for broadcast, per-rank and M:N with this many FSDP2 ranks",
    )
    planp.add_argument(
        "--delta", action="store_true", help="also show the memory delta refits add (the committed wire image)"
    )
    planp.add_argument("--engine-tp", type=at_least_one, default=1, help="engine tensor-parallel size (M:N figures)")
    planp.add_argument("--engine-ep", type=at_least_one, default=1, help="engine expert-parallel groups (M:N figures)")
    json_option(planp)
    planp.set_defaults(func=run)
