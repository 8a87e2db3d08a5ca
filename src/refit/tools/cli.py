"""Command line: `refit demo`, `refit bench`, `refit plan`, `refit doctor`, `refit verify-root`, one module each in
refit.tools.commands, registered in COMMANDS.

Mistakes a user can make get one line naming the problem and the fix, and exit code 2.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from collections.abc import Callable

from rich.console import Console
from rich.markup import escape

from refit.log import configure, get_logger
from refit.settings import check_environment, unknown_variables
from refit.tools.commands import bench, demo, doctor, plan, verify_root
from refit.tools.commands.common import Help, Parser, common_options, json_through_a_file, writable
from refit.tools.console import console_for, silence_libraries

log = get_logger("cli")

COMMANDS = (demo, bench, plan, doctor, verify_root)
"""The subcommands, in `refit --help`'s order: each a module with `add_parser(sub, common)`, whose parser sets
`func` to its `run(args, console)`. A new command is one module and one entry here."""


def _check_bucket_bytes(args: argparse.Namespace) -> None:
    """Refused here, in the option's terms: the engine would fail only when it joins, naming env variables."""
    from refit.layout.planner import DEFAULT_ALIGNMENT

    value = getattr(args, "bucket_bytes", None)
    if value is not None and value < DEFAULT_ALIGNMENT:
        raise ValueError(
            f"--bucket-bytes {value} is below the alignment of {DEFAULT_ALIGNMENT} bytes; "
            f"give at least {DEFAULT_ALIGNMENT}"
        )


def build_parser() -> argparse.ArgumentParser:
    common = common_options()
    from refit import __version__

    parser = Parser(
        prog="refit",
        parents=[common],
        formatter_class=Help,
        description="Move trained weights into a running inference engine.",
        epilog="New here? `refit doctor` says which transports work on this machine; `refit demo` shows a refit.",
    )
    parser.add_argument("--version", action="version", version=f"refit {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_parser(sub, common)
    return parser


def _quiet_threads() -> None:
    """Trainer and engine processes share the cores; spinning OpenMP workers would steal them from the peer.
    Must run before torch is imported (OpenMP reads these once); explicit settings win."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.environ.setdefault("KMP_BLOCKTIME", "0")


def _command(args: argparse.Namespace) -> Callable[[argparse.Namespace, Console], int]:
    """The command's function; `bench --engine vllm` writes its own `--json` file, so `--json` alone reaches
    stdout through one."""
    if args.command == "bench" and args.func is not bench.run:
        return lambda a, c: json_through_a_file(a, args.func, c)
    return args.func


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread: the command unwinds as on Ctrl-C (its engine and workers closed),
    then exits 143 with one line."""


def _on_sigterm(_signum: int, _frame: object) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM ends the process at once
    raise Terminated


def main(argv: list[str] | None = None) -> int:
    if threading.current_thread() is not threading.main_thread():
        return _main(argv)
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        return _main(argv)
    except Terminated:  # before the command began
        console_for(stderr=True).print("terminated", highlight=False)
        return 143
    finally:
        signal.signal(signal.SIGTERM, previous)


def _main(argv: list[str] | None) -> int:
    _quiet_threads()
    argv = sys.argv[1:] if argv is None else argv
    if _asks_quiet(argv):
        silence_libraries()
    try:  # before the parser: its imports read some of the variables
        settings = check_environment()
    except ValueError as e:
        return _usage_error(e)
    args = build_parser().parse_args(argv)
    args.settings = settings
    args.verbosity = -1 if getattr(args, "quiet", False) else getattr(args, "verbose", 0)
    configure(args.verbosity)
    for message in unknown_variables():
        console_for(stderr=True, quiet=args.verbosity < 0).print(f"[yellow]warning:[/] {escape(message)}")
    json_out = getattr(args, "json", None) == "-"
    if json_out:  # stdout carries the JSON alone: vLLM's logs (shown with -v) go to stderr
        os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    console = console_for(stderr=json_out, quiet=args.verbosity < 0)
    from refit.errors import RefitError

    try:
        for option in ("json", "plot"):  # every output path, on every command, before any work
            writable(getattr(args, option, None), f"--{option}")
        _check_bucket_bytes(args)
        if args.command == "bench":
            bench.check(args)
        return _command(args)(args, console)
    except ValueError as e:
        return _usage_error(e)
    except RefitError as e:
        log.debug("refit failed", exc_info=True)
        console_for(stderr=True).print(f"[red]refit failed:[/] {escape(str(e))}", highlight=False)
        return 1
    except KeyboardInterrupt as e:  # Ctrl-C: the children got the same SIGINT and end silently (refit.tools.children)
        terminated = isinstance(e, Terminated)
        console_for(stderr=True).print("terminated" if terminated else "interrupted", highlight=False)
        return 143 if terminated else 130


def _asks_quiet(argv: list[str]) -> bool:
    """-q, seen before the parser runs: the parser's imports load torch, which may warn as it loads."""
    options = argv[: argv.index("--")] if "--" in argv else argv
    return "-q" in options or "--quiet" in options


def _usage_error(e: ValueError) -> int:
    console_for(stderr=True).print(f"[red]error:[/] {escape(str(e))}", highlight=False)
    return 2


if __name__ == "__main__":
    sys.exit(main())
