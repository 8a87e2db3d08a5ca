"""Command line: `refit demo`, `refit bench`, `refit plan`."""

from __future__ import annotations

import argparse
import sys

from rich.console import Console


def _demo(args: argparse.Namespace, console: Console) -> int:
    from refit.demo.run import DemoConfig, run

    ok = True
    for transport in args.transport.split(","):
        cfg = DemoConfig(transport=transport.strip(), steps=args.steps, dtype_change_at=args.dtype_change_at,
                         bucket_bytes=args.bucket_bytes, layers=args.layers, hidden=args.hidden)  # fmt: skip
        ok &= run(cfg, console)
    return 0 if ok else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="refit", description="Move trained weights into a running inference engine.")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train a small LM and refit it into an engine process, verifying every refit")
    demo.add_argument("--transport", default="shm,gloo", help="comma-separated: shm, gloo (default: both)")
    demo.add_argument("--steps", type=int, default=4, help="optimizer steps, each followed by a refit")
    demo.add_argument("--dtype-change-at", type=int, default=2, help="step after which one tensor goes fp32 (-1: never)")
    demo.add_argument("--bucket-bytes", type=int, default=8 << 20, help="bucket capacity in bytes")
    demo.add_argument("--layers", type=int, default=8)
    demo.add_argument("--hidden", type=int, default=512)
    demo.set_defaults(func=_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    console = Console(width=None if sys.stdout.isatty() else 120)
    try:
        return args.func(args, console)
    except ValueError as e:
        console.print(f"[red]error:[/] {e}")
        return 2


if __name__ == "__main__":
    sys.exit(main())
