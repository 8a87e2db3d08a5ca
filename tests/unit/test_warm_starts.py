"""The tests' warm process starts (tests/helpers/warm.py): a helper script forks from the session's server
and behaves as a fresh interpreter would; a test marked `fresh_start` gets a fresh interpreter."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import warm

SCRIPT = "import sys; print(sys.argv[1:], flush=True); sys.exit(int(sys.argv[1]))"


def _run(tmp_path, code: str) -> tuple[object, str, int]:
    script = tmp_path / "child.py"
    script.write_text(SCRIPT)
    proc = warm.popen([sys.executable, str(script), code, "x"], stdout=subprocess.PIPE, text=True)
    out = proc.stdout.read()
    return proc, out, proc.wait()


def test_a_helper_forked_warm_gets_its_own_argv_streams_and_exit_status(tmp_path) -> None:
    if os.environ.get(warm.ENV) is None:
        pytest.skip("no warm-start server in this session (REFIT_TEST_WARM=0)")
    proc, out, code = _run(tmp_path, "3")
    assert isinstance(proc, warm.WarmProcess) and out == "['3', 'x']\n" and code == 3


@pytest.mark.fresh_start
def test_a_fresh_start_test_starts_a_fresh_interpreter(tmp_path) -> None:
    assert os.environ.get(warm.ENV) is None
    proc, out, code = _run(tmp_path, "0")
    assert isinstance(proc, subprocess.Popen) and out == "['0', 'x']\n" and code == 0
