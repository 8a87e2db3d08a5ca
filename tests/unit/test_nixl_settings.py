"""The UCX settings the nixl transport chooses, without NIXL installed: the error mode and cuda_ipc's GET."""

from __future__ import annotations

import os

import pytest

from refit.transports import nixl


def test_ucx_runs_without_its_peer_failure_mode_unless_told(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("REFIT_NIXL_ERROR_MODE", raising=False)
    assert nixl.backend_params("UCX") == {"ucx_error_handling_mode": "none"}
    monkeypatch.setenv("REFIT_NIXL_ERROR_MODE", "peer")
    assert nixl.backend_params("UCX") == {"ucx_error_handling_mode": "peer"}
    assert nixl.backend_params("LIBFABRIC") == {}


def test_a_wrong_error_mode_is_refused_with_the_variable_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REFIT_NIXL_ERROR_MODE", "strict")
    with pytest.raises(ValueError, match="REFIT_NIXL_ERROR_MODE must be 'none' or 'peer', got 'strict'"):
        nixl.backend_params("UCX")


def test_cuda_ipc_get_is_turned_on_only_where_the_environment_is_silent(monkeypatch: pytest.MonkeyPatch) -> None:
    key = "UCX_CUDA_IPC_ENABLE_GET_ZCOPY"
    monkeypatch.delenv(key, raising=False)
    nixl._ucx_defaults()
    assert os.environ[key] == "on"
    monkeypatch.setenv(key, "auto")
    nixl._ucx_defaults()
    assert os.environ[key] == "auto"
