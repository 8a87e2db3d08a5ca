"""Console: rich consoles for the tools' human output, wrapped only on a terminal."""

from __future__ import annotations

import sys
from typing import TextIO

from rich.console import Console

WIDE = 1000
"""Console width when the stream is not a terminal: lines and tables are never wrapped in pipes and files."""


def console_on(stream: TextIO) -> Console:
    """A Console on `stream` that wraps only on a terminal (a pipe or a file gets whole lines)."""
    return Console(file=stream, width=None if stream.isatty() else WIDE)


def console_for(*, stderr: bool = False) -> Console:
    """A Console on stdout (or stderr) that wraps only on a terminal."""
    return console_on(sys.stderr if stderr else sys.stdout)
