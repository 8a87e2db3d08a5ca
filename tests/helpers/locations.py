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


def child_json(name: str, args: list[str], tag: str, *, timeout: float = 900) -> dict:
    """Run helper script `name` with `args` in its own process, vLLM in its default multiprocess mode (no
    VLLM_ENABLE_V1_MULTIPROCESSING), and return the JSON of its output line starting with `@@<tag> `."""
    import json
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    out = subprocess.run(
        [sys.executable, helper(name), *args], env=env, capture_output=True, text=True, timeout=timeout
    )
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith(f"@@{tag} ")), None)
    assert line is not None, out.stderr[-3000:]
    return json.loads(line[len(tag) + 3 :])
