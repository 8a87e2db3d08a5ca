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


class _Meta:
    def __init__(self, name: str, t: torch.Tensor) -> None:
        self.name, self.dtype, self.shape = name, t.dtype, tuple(t.shape)


class _ShortSource:
    """A vLLM WeightSource whose pass leaves out 'b' once `short` is set, though metadata() declares it."""

    def __init__(self) -> None:
        self.tensors = {"a": torch.ones(4), "b": torch.full((4,), 2.0)}
        self.short = False

    def metadata(self) -> list[_Meta]:
        return [_Meta(n, t) for n, t in self.tensors.items()]

    def __iter__(self):  # noqa: ANN204 - a generator, as vLLM's sources
        yield from ((n, t) for n, t in self.tensors.items() if not (self.short and n == "b"))


class _ServingLlm(_FakeLlm):
    """Also serves vLLM's update calls: `update_weights` receives one refit (a failure is vLLM's 500)."""

    def start_weight_update(self) -> None:
        pass

    def update_weights(self, request: dict) -> None:
        self.receivers[0].receive()

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        pass

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        return True


def test_a_source_yielding_fewer_tensors_than_declared_fails_at_once_naming_it() -> None:
    from refit import State
    from refit.integrations.vllm.weight_source import StreamSource

    llm, source = _ServingLlm(fail=False), _ShortSource()
    llm_engine = {"a": torch.zeros(4), "b": torch.zeros(4)}
    llm.init_weight_transfer_engine = lambda request: _join(llm, llm_engine, request)  # type: ignore[method-assign]
    stream = StreamSource(source)
    settings = Settings(timeout_s=60.0, connect_timeout_s=600.0)
    driver = VllmRefit(llm, Sender(stream, transport="shm", num_receivers=1, settings=settings))
    stream.begin_round()
    driver.refit(1)
    source.short = True
    stream.begin_round()
    t = time.monotonic()
    with pytest.raises(RefitError, match="without yielding 'b'"):
        driver.refit(2)
    assert time.monotonic() - t < 30, "the workers waited out the timeout for a tensor the trainer never had"
    engine = llm.receivers[0].engine
    assert (engine.weights.state, engine.weights.version) == (State.FAILED, 1)
    for r in llm.receivers:
        r.close()
    driver.close()


def _join(llm: _FakeLlm, tensors: dict, request: dict) -> None:
    info = request["init_info"]
    r = Receiver(ModuleEngine(tensors), info["rendezvous"], settings=Settings(timeout_s=info["timeout_s"]))
    r.connect()
    llm.receivers.append(r)


@pytest.mark.slow  # importing vLLM takes tens of seconds
def test_vllms_contract_words_say_what_is_missing() -> None:
    """vLLM's own tests and users' code match these words: 'not initialized', 'requires a WeightSource'."""
    pytest.importorskip("vllm")
    from refit.integrations.vllm.backend import RefitUpdateInfo, RefitWeightTransferEngine
    from refit.integrations.vllm.trainer import RefitTrainerInitInfo, RefitTrainerWeightTransferEngine

    worker = object.__new__(RefitWeightTransferEngine)  # as vLLM holds it before init_weight_transfer_engine
    with pytest.raises(RefitError, match="not initialized"):
        worker.receive_weights(RefitUpdateInfo(version=1))
    with pytest.raises(ValueError, match="requires a WeightSource"):
        RefitTrainerWeightTransferEngine.trainer_init(RefitTrainerInitInfo(rank=0), client=None)
