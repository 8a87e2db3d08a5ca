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
def warm_starts() -> Iterator[None]:
    """One warm-start server for the session (tests/helpers/warm.py): helper scripts fork from a process that
    imported torch once. REFIT_TEST_WARM=0 turns it off (every helper a fresh interpreter); tests marked
    `fresh_start` start theirs fresh in any case (see tests/protocol/test_elastic.py for why). Off on a machine
    with an NVIDIA GPU: there `pytest -m gpu` forked warm did not finish in 240 s, and fresh in 72 s."""
    if os.environ.get("REFIT_TEST_WARM") == "0" or os.path.exists("/dev/nvidiactl"):
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


@pytest.fixture(autouse=True)
def _fresh_start(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test marked `fresh_start` starts its processes as fresh interpreters, even with a warm-start server."""
    path = os.environ.get("REFIT_TEST_WARM")
    if path is None or request.node.get_closest_marker("fresh_start") is None:
        yield
        return
    os.environ.pop("REFIT_TEST_WARM")
    try:
        yield
    finally:
        os.environ["REFIT_TEST_WARM"] = path


@pytest.fixture(scope="module")
def in_process_llms() -> Iterator[list]:
    """The in-process vLLM engines a module makes (append each), shut down at the module's teardown. vLLM
    tears down its process-global distributed state when such an engine is collected: one collected late
    (held by a reference cycle) would take the next module's world group with it mid-test."""
    llms: list = []
    yield llms
    for llm in llms:
        llm.llm_engine.engine_core.shutdown()
