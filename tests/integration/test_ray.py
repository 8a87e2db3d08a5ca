"""The Ray example runs as a user would copy it: trainer and engine actors, refits over shm and gloo."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from locations import EXAMPLES

pytest.importorskip("ray")


@pytest.mark.slow
def test_ray_example_refits_between_actors_with_equal_generation() -> None:
    example = os.path.join(EXAMPLES, "ray_refit.py")
    # No timeout: it would bound Ray's start of four actor processes, minutes on a loaded 2-core machine.
    # Ray runs its workers at niceness 15, where any busy process on the machine starves them: use 0.
    env = {**os.environ, "RAY_worker_niceness": "0"}
    out = subprocess.run([sys.executable, example, "--transport", "shm,gloo", "--steps", "2"], capture_output=True,
                         text=True, env=env)  # fmt: skip
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert out.stdout.count("generation equal") == 4 and "all refits verified" in out.stdout
