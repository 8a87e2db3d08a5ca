"""What every command shares: its parser's classes and option types, `--json` out, output paths checked
before the work, the checks of packages, transports and the listen address, and the bucket setting."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Callable
from typing import NoReturn

from rich.console import Console


def emit_json(doc: object, path: str) -> None:
    """`--json` alone prints to stdout; `--json FILE` writes the file (the human output stays on stdout)."""
    text = json.dumps(doc, indent=2)
    if path == "-":
        sys.stdout.write(text + "\n")
        sys.stdout.flush()
    else:
        with open(path, "w") as f:
            f.write(text + "\n")


def writable(path: str | None, option: str) -> None:
    """Fail before the work, not after it, when an output file cannot be written."""
    if path and path != "-":
        if os.path.isdir(path):
            example = os.path.join(path, "out.png" if option == "--plot" else "out.json")
            raise ValueError(f"{option} {path} is a directory; pass a file path, e.g. {example}")
        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
            raise ValueError(
                f"{option} {path}: cannot write into {folder}; pass a path in an existing, writable folder"
            )


def need(module: str, what: str, install: str) -> None:
    from refit.tools.doctor import installed

    if not installed(module):
        raise ValueError(f"{what} needs {module}, which is not installed; {install}")


NIXL_MISSING = (
    "transport 'nixl' needs NVIDIA NIXL, which is not installed; pip install -e '.[nixl]' from the refit checkout "
    "(nixl-cu12), or pip install nixl-cu13 (CUDA 13), or use another transport"
)


def check_transport(name: str) -> None:
    """Refused before any process starts: a worker would fail later, with its own traceback."""
    from refit import transports
    from refit.tools.doctor import nixl_installed

    reason = transports.unavailable(name)
    if reason:
        raise ValueError(reason)
    if name == "nixl" and not nixl_installed():
        raise ValueError(NIXL_MISSING)


def check_listen(args: argparse.Namespace) -> None:
    """The commands that run a Sender listen on REFIT_IFNAME or REFIT_HOST: refused now, not as an OSError."""
    from refit.tools.doctor import listen_problem

    problem, fix = listen_problem(args.settings)
    if problem:
        raise ValueError(f"{problem}; {fix}")


def bucket_bytes(args: argparse.Namespace, default: int) -> int:
    """--bucket-bytes, else REFIT_BUCKET_BYTES, else the command's own default."""
    if args.bucket_bytes is not None:
        return args.bucket_bytes
    return default if args.settings.bucket_bytes is None else args.settings.bucket_bytes


def ints(text: str, option: str) -> list[int]:
    try:
        return [int(r) for r in text.split(",")]
    except ValueError:
        raise ValueError(f"{option} takes comma-separated integers, e.g. 1,2,4; got {text!r}") from None


def json_through_a_file(
    args: argparse.Namespace, run: Callable[[argparse.Namespace, Console], int], console: Console
) -> int:
    """Runs a bench mode that writes `--json` to a file itself; `--json` alone then goes to stdout through one."""
    if args.json != "-":
        return run(args, console)
    with tempfile.TemporaryDirectory() as tmp:
        args.json = os.path.join(tmp, "bench.json")
        code = run(args, console)
        if os.path.exists(args.json):
            with open(args.json) as f:
                emit_json(json.load(f), "-")
    return code


class Help(argparse.HelpFormatter):
    """Shows every option's default, except where there is none to show."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "%(default)" in text or action.default in (None, False, argparse.SUPPRESS) or not action.option_strings:
            return text
        return text + " (default: %(default)s)"


def command_parser(sub, common: argparse.ArgumentParser, name: str, **kwargs) -> argparse.ArgumentParser:  # type: ignore[no-untyped-def]
    """A subcommand's parser: -v/-q from `common`, every option's default in its help."""
    return sub.add_parser(name, parents=[common], formatter_class=Help, **kwargs)


def common_options() -> argparse.ArgumentParser:
    """-v/-q, accepted before or after the subcommand."""
    p = Parser(add_help=False)
    p.add_argument(
        "-v",
        "--verbose",
        action="count",
        default=argparse.SUPPRESS,
        help="more log lines on stderr: -v INFO (and vLLM's own logs), -vv DEBUG (per bucket)",
    )
    p.add_argument(
        "-q",
        "--quiet",
        action="store_true",
        default=argparse.SUPPRESS,
        help="errors only: no tables, no progress, no warnings, and vLLM, transformers, torch, NIXL and UCX "
        "at their error level; a library's C++ code that writes to the terminal itself can still print",
    )
    return p


def json_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--json",
        nargs="?",
        const="-",
        metavar="FILE",
        help="print the results as JSON to stdout (the human output goes to stderr), or write them to FILE "
        "(the human output stays on stdout)",
    )


def at_least_one(text: str) -> int:
    """An argparse type: a count of processes or a parallel size, never 0 (0 is not 'unset')."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1 or str(value) != text.strip().lstrip("+"):
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return value


def at_least_zero(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text!r}")
    return value


class Parser(argparse.ArgumentParser):
    """Every usage mistake is one line on stderr and exit code 2, like the CLI's own checks."""

    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"error: {self.prog}: {message}; see {self.prog} --help\n")
        raise SystemExit(2)
