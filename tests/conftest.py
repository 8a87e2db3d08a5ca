"""Shared fixtures. The scripts tests start as processes, and the helpers they share, live in tests/helpers/,
which is put on sys.path here (and on the PYTHONPATH of every process a helper starts)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

HELPERS = Path(__file__).resolve().parent / "helpers"
if str(HELPERS) not in sys.path:
    sys.path.insert(0, str(HELPERS))


# gloo runs in the full tier only: each case starts its processes again, and the fast tier's budget is 5 minutes.
@pytest.fixture(params=["shm", pytest.param("gloo", marks=pytest.mark.slow)])
def transport(request: pytest.FixtureRequest) -> str:
    return request.param
