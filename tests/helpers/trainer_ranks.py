"""Starts the ranks of tests/helpers/fsdp_trainer.py and reads rank 0's JSON lines."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Callable

import warm


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(
    args: dict,
    *,
    world: int = 2,
    envs: list[dict] | None = None,
    script: str = "fsdp_trainer.py",
    gate: bool = False,
    within: Callable[[list[str]], list[str]] | None = None,
) -> list[subprocess.Popen]:
    """`world` trainer processes; `envs[r]` is extra environment for rank r (e.g. CUDA_VISIBLE_DEVICES).
    `gate`: rank 0's stdin is a pipe (for a script that waits on it; see `go`). `within`: the command that
    starts each one somewhere else (a network namespace: `Link.command`), as a fresh interpreter."""
    script = os.path.join(os.path.dirname(__file__), script)
    port = free_port()
    procs = []
    for rank in range(world):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), *sys.path]),
               **((envs or [{}] * world)[rank])}  # fmt: skip
        stdin = subprocess.PIPE if gate and rank == 0 else None
        stdout = subprocess.PIPE if rank == 0 else subprocess.DEVNULL
        argv = [sys.executable, script, json.dumps(args)]
        popen = warm.popen if within is None else subprocess.Popen
        procs.append(popen(within(argv) if within else argv, env=env, text=True, stdin=stdin, stdout=stdout))
    return procs


def line(proc: subprocess.Popen):
    """Rank 0's next JSON line."""
    assert proc.stdout is not None
    for text in proc.stdout:
        if text.startswith("@@rank0 "):
            return json.loads(text[len("@@rank0 ") :])
    raise AssertionError(f"rank 0 exited with {proc.wait()}")


def go(proc: subprocess.Popen) -> None:
    """Let a gated rank 0 (started with `gate=True`) go on to its next step."""
    assert proc.stdin is not None
    proc.stdin.write("go\n")
    proc.stdin.flush()
