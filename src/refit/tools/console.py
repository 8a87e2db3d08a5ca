"""Console: rich consoles for the tools' human output, wrapped only on a terminal, silent with -q."""

from __future__ import annotations

import os
import sys
import warnings
from typing import TextIO

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

WIDE = 1000
"""Console width when the stream is not a terminal: lines and tables are never wrapped in pipes and files."""


def console_on(stream: TextIO, *, quiet: bool = False) -> Console:
    """A Console on `stream` that wraps only on a terminal (a pipe or a file gets whole lines); `quiet`
    (-q) prints nothing."""
    return Console(file=stream, width=None if stream.isatty() else WIDE, quiet=quiet)


def console_for(*, stderr: bool = False, quiet: bool = False) -> Console:
    """A Console on stdout (or stderr) that wraps only on a terminal."""
    return console_on(sys.stderr if stderr else sys.stdout, quiet=quiet)


def progress_console(*, quiet: bool = False) -> Console:
    """Where progress goes: stderr, and only when it is a terminal and not -q (a pipe or a log gets none)."""
    return Console(file=sys.stderr, quiet=quiet or not sys.stderr.isatty())


def progress(*, quiet: bool = False) -> Progress:
    """A transient rich Progress on `progress_console`: spinner, step, bar, count, elapsed time."""
    columns = (
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    return Progress(*columns, console=progress_console(quiet=quiet), transient=True)


QUIET_ENV = {"PYTHONWARNINGS": "ignore", "NIXL_LOG_LEVEL": "ERROR", "UCX_LOG_LEVEL": "error"}
"""With -q, set unless already set: every warning off, and NIXL's and UCX's own logs (Python and C++) at
their error level, in this process and the children that inherit the environment."""


def silence_libraries() -> None:
    """-q: errors only. Must run before torch is imported (it warns as it loads, e.g. without NumPy)."""
    for name, value in QUIET_ENV.items():
        os.environ.setdefault(name, value)
    warnings.simplefilter("ignore")
