"""VllmRefit when vLLM's side fails: the driver reports vLLM's own error at once and stays usable."""

from __future__ import annotations

import time

import pytest
import torch

from refit import ModuleSource, Sender, Settings
from refit.engines.module import ModuleEngine
from refit.errors import RefitError
from refit.integrations.vllm.driver import VllmRefit
from refit.topology.receiver import Receiver


class _FakeLlm:
    """Stands for a `vllm.LLM`: `init_weight_transfer_engine` fails on its first call, then connects a receiver."""

    def __init__(self, fail: bool) -> None:
        self.fail = fail
        self.receivers: list[Receiver] = []

    def init_weight_transfer_engine(self, request: dict) -> None:
        if self.fail:
            self.fail = False
            raise ValueError("bad weight_transfer_config (from vLLM)")
        info = request["init_info"]
        r = Receiver(
            ModuleEngine({"w": torch.zeros(4)}),
            info["rendezvous"],
            settings=Settings(timeout_s=info["timeout_s"]),
        )
        r.connect()
        self.receivers.append(r)


def _sender() -> Sender:
    settings = Settings(timeout_s=60.0, connect_timeout_s=600.0)
    return Sender(ModuleSource({"w": torch.ones(4)}), transport="shm", num_receivers=1, settings=settings)


def test_connect_fails_within_seconds_with_vllms_error_and_the_driver_connects_again() -> None:
    llm = _FakeLlm(fail=True)
    driver = VllmRefit(llm, _sender())
    t = time.monotonic()
    with pytest.raises(RefitError, match="bad weight_transfer_config") as info:
        driver.connect()
    assert time.monotonic() - t < 60, "waited for the Sender's connect timeout after vLLM had already failed"
    assert isinstance(info.value.__cause__, ValueError)
    driver.sender = _sender()  # the failed connect closed its Sender; the driver takes a new one
    driver.connect()
    assert driver.sender.transport is not None and len(llm.receivers) == 1
    for r in llm.receivers:
        r.close()
    driver.close()
