"""Errors are narrowed to what can be raised and keep their cause: an engine's error under the receiver's
RefitError, a transformers bug not mistaken for an unknown architecture, a cuda-ipc probe bug not
mistaken for a missing IPC, a failed stats RPC said at WARNING."""

from __future__ import annotations

import logging
import threading

import pytest
import torch

from refit import ModuleSource, RefitError, Sender, Settings
from refit.engines.module import ModuleEngine
from refit.integrations.vllm import engine as vllm_engine
from refit.integrations.vllm.driver import VllmRefit
from refit.topology.receiver import Receiver
from refit.transports import cuda_ipc


class _Broken(ModuleEngine):
    def load(self, tensors: list) -> None:
        raise ValueError("the engine's own bug")


def test_an_engine_load_error_reaches_the_receiver_as_the_cause_of_its_refit_error() -> None:
    sender = Sender(ModuleSource({"a": torch.ones(4)}), transport="shm", settings=Settings(timeout_s=60.0))
    got: list = []

    def serve() -> None:
        r = Receiver(_Broken({"a": torch.zeros(4)}), sender.rendezvous(), settings=Settings(timeout_s=60.0))
        try:
            r.receive()
        except RefitError as e:
            got.append(e)
        finally:
            r.close()

    t = threading.Thread(target=serve)
    t.start()
    with pytest.raises(RefitError, match="the engine's own bug"):
        sender.refit(1)
    sender.close()
    t.join()
    assert isinstance(got[0].__cause__, ValueError)


def test_checkpoint_shapes_falls_back_only_for_an_architecture_transformers_does_not_know(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import transformers

    def unknown(config: object) -> None:
        raise ValueError("Unrecognized configuration class")

    def bug(config: object) -> None:
        raise TypeError("a bug in the config")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_config", unknown)
    assert vllm_engine.checkpoint_shapes(object()) is None
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_config", bug)
    with pytest.raises(TypeError, match="a bug in the config"):
        vllm_engine.checkpoint_shapes(object())


class _Storage:
    def __init__(self, error: Exception) -> None:
        self.error = error

    def _share_cuda_(self) -> None:
        raise self.error


def test_cuda_ipc_falls_back_for_a_cuda_error_only(monkeypatch: pytest.MonkeyPatch) -> None:
    settings = Settings()
    for error, falls_back in ((RuntimeError("no IPC in this driver"), True), (AttributeError("a bug"), False)):
        fake = type("T", (), {"untyped_storage": lambda self, e=error: _Storage(e)})()
        monkeypatch.setattr(cuda_ipc.torch, "empty", lambda *a, f=fake, **k: f)
        if falls_back:
            assert "no IPC in this driver" in cuda_ipc.blocker(torch.device("cpu"), settings)
        else:
            with pytest.raises(AttributeError, match="a bug"):
                cuda_ipc.blocker(torch.device("cpu"), settings)


def test_a_failed_engine_seconds_rpc_is_logged_at_warning(caplog: pytest.LogCaptureFixture) -> None:
    class Llm:
        def collective_rpc(self, method: str) -> list:
            raise RuntimeError("worker has no method refit_engine_seconds")

    sender = Sender(ModuleSource({"a": torch.ones(4)}), transport="shm")
    driver = VllmRefit(Llm(), sender)
    stats = type("S", (), {"seconds": {}})()
    with caplog.at_level(logging.WARNING, logger="refit"):
        driver._add_engine_seconds(stats)
    sender.close()
    assert "refit_engine_seconds" in caplog.text and stats.seconds == {}
