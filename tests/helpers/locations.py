"""Where things are, for tests that start processes: this folder (the helper scripts), the repository, its src/."""

from __future__ import annotations

import os

HELPERS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HELPERS))
SRC = os.path.join(ROOT, "src")
EXAMPLES = os.path.join(ROOT, "examples")


def helper(name: str) -> str:
    """The path of the helper script `name` (e.g. "peer.py")."""
    path = os.path.join(HELPERS, name)
    assert os.path.isfile(path), path
    return path


def pythonpath(*extra: str) -> str:
    """A PYTHONPATH for a child process: the helpers, then `extra`, then this process's sys.path."""
    import sys

    return os.pathsep.join([HELPERS, *extra, *sys.path])
