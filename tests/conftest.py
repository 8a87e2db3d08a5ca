"""Shared fixtures. The scripts tests start as processes, and the helpers they share, live in tests/helpers/,
which is put on sys.path here (and on the PYTHONPATH of every process a helper starts)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

HELPERS = Path(__file__).resolve().parent / "helpers"
if str(HELPERS) not in sys.path:
    sys.path.insert(0, str(HELPERS))


# gloo runs in the full tier only: each case starts its processes again, and the fast tier's budget is 5 minutes.
@pytest.fixture(params=["shm", pytest.param("gloo", marks=pytest.mark.slow)])
def transport(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="session", autouse=True)
def warm_starts(request: pytest.FixtureRequest) -> Iterator[None]:
    """One warm-start server for the fast tier (tests/helpers/warm.py): helper scripts fork from a process that
    imported torch once. The full suite starts every helper as a fresh interpreter: with warm starts one of its
    elastic gloo tests (a receiver dying mid-refit, the group formed again) failed in a clean-clone CI run, after
    a per-rank test of the same file, for a reason not found yet. REFIT_TEST_WARM=1 or 0 forces it on or off."""
    forced = os.environ.get("REFIT_TEST_WARM")
    fast = "not slow" in (request.config.option.markexpr or "")
    if forced == "0" or (forced != "1" and not fast):
        os.environ.pop("REFIT_TEST_WARM", None)
        yield
        return
    tmp = tempfile.mkdtemp(prefix="refit-warm-")
    path = os.path.join(tmp, "server.sock")
    server = subprocess.Popen(
        [sys.executable, str(HELPERS / "warm.py"), path], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert server.stdout is not None
    if server.stdout.readline().strip() == "ready":  # a server that failed to start leaves plain process starts
        os.environ["REFIT_TEST_WARM"] = path
    try:
        yield
    finally:
        os.environ.pop("REFIT_TEST_WARM", None)
        assert server.stdin is not None
        server.stdin.close()
        server.wait()
        with contextlib.suppress(OSError):
            os.unlink(path)
            os.rmdir(tmp)
