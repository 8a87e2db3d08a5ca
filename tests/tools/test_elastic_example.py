"""examples/elastic.py runs as CI runs it: engines join, one is SIGKILLed and restarted, every refit is checked."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from locations import EXAMPLES, pythonpath

pytest.importorskip("transformers")


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["shm", "gloo"])
def test_the_elastic_example_exits_0_with_one_verified_line_per_refit(transport: str) -> None:
    env = {**os.environ, "PYTHONPATH": pythonpath()}
    done = subprocess.run(
        [sys.executable, os.path.join(EXAMPLES, "elastic.py"), "--transport", transport],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 4, lines
    expected = [
        r"refit 1: committed on A \(receiver 1\); departed: none; ",
        r"refit 2: committed on A \(receiver 1\), B \(receiver 2\); departed: none; ",
        r"refit 3: committed on B \(receiver 2\); departed: A \(receiver 1\): .*closed the connection.*; ",
        r"refit 4: committed on B \(receiver 2\), A \(restarted\) \(receiver 3\); departed: none; ",
    ]
    for line, pattern in zip(lines, expected):
        assert re.match(pattern + "weights bitwise equal to the trainer$", line), line
