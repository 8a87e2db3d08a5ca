"""StreamSource: a vLLM-style WeightSource (metadata() plus one fresh pass of (name, tensor) per round, in its
own order) feeding a real Sender and Receiver. No vLLM needed: the adapter uses those two methods only."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch
from torch import nn

from refit import RefitError, Sender, Settings
from refit.engines.module import ModuleEngine
from refit.integrations.vllm.weight_source import StreamSource
from refit.topology.receiver import Receiver


@dataclass(frozen=True)
class Meta:  # the fields of vLLM's ParamMeta
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]


class ParamStream:
    """Like vLLM's ModuleSource: named_parameters() in module order (not name order); counts its passes."""

    def __init__(self, module: nn.Module, *, extra: tuple[str, ...] = ()) -> None:
        self.module, self.extra, self.passes = module, extra, 0

    def metadata(self) -> list[Meta]:
        metas = [Meta(n, p.dtype, tuple(p.shape)) for n, p in self.module.named_parameters()]
        return metas + [Meta(n, torch.float32, (2,)) for n in self.extra]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        self.passes += 1
        yield from ((n, p.detach()) for n, p in self.module.named_parameters())


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.LayerNorm(64))


def test_each_refit_takes_one_pass_and_the_engine_equals_the_live_module_bitwise() -> None:
    trainer, engine_model = _model(0), _model(1)
    stream = ParamStream(trainer)
    source = StreamSource(stream)
    sender = Sender(source, transport="shm", settings=Settings(bucket_bytes=8192, timeout_s=60.0), verify="strict")
    engine = ModuleEngine(engine_model)
    errors: list[BaseException] = []

    def serve() -> None:
        with Receiver(engine, sender.rendezvous(), settings=Settings(timeout_s=60.0)) as r:
            try:
                while r.receive() is not None:
                    pass
            except BaseException as e:  # noqa: BLE001 - handed to the test's thread
                errors.append(e)

    t = threading.Thread(target=serve)
    t.start()
    try:
        for version in (1, 2):
            source.begin_round()
            stats = sender.refit(version)
            source.end_round(drain=False)
            assert stream.passes == version  # one pass per refit, the strict verification's reads included
            assert stats.num_buckets > 3 and not stats.unverified_names
            live, held = dict(trainer.named_parameters()), dict(engine_model.named_parameters())
            assert all(torch.equal(held[n], live[n]) for n in live)
            with torch.no_grad():
                for p in trainer.parameters():
                    p.add_(1.0)  # the next refit must carry what the trainer holds then
    finally:
        sender.close()
        t.join()
    assert not errors and engine.weights.version == 2


def test_a_name_metadata_declares_but_the_pass_never_yields_is_named() -> None:
    source = StreamSource(ParamStream(_model(0), extra=("ghost.weight",)))
    source.begin_round()
    assert len(source.tensors(["3.bias", "0.weight"])) == 2  # yielded later and earlier than asked: both held
    with pytest.raises(ValueError, match=r"ended without yielding 'ghost.weight', which its metadata\(\) declares"):
        source.tensors(["ghost.weight"])
    source.end_round(drain=True)
    with pytest.raises(RefitError, match="outside a round"):
        source.tensors(["0.weight"])


def test_something_that_is_not_a_weight_source_is_refused() -> None:
    with pytest.raises(ValueError, match=r"source must be a vLLM WeightSource \(metadata\(\) and iteration"):
        StreamSource({"a": torch.zeros(2)})
