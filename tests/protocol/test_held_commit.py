"""A version waiting for its verdict or its checks never reads current, and what a peer sends after the token
proof fails that refit (or is refused) with the session alive: no huge number, malformed plan or repair index
raises anything else, and a repair never hides a malformed COMMIT."""

from __future__ import annotations

import json

import pytest
import torch
from threaded import refit_both, session

from refit import ModuleEngine, ModuleSource, RefitStats, Settings, State
from refit.checks import canary_bisect
from refit.engines.root import engine_root
from refit.engines.versions import Versions
from refit.errors import IntegrityError, PeerError
from refit.layout.planner import plan
from refit.layout.spec import TensorSpec
from refit.stages import _HANDLERS, register_handler
from refit.stages.handler import Handler
from refit.stages.lora import parse as lora_parse
from refit.topology import repair
from refit.transports.relay import Sites

SETTINGS = Settings(bucket_bytes=4 << 10, timeout_s=60.0)
HUGE = 10**400


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"w{i}": torch.randn(64, 64, generator=g) for i in range(8)} | {"n": torch.randn(16, generator=g)}


def test_a_held_commit_reads_updating_until_the_decision_and_a_failure_leaves_the_last_version() -> None:
    v = Versions()
    v.assume_current(5)
    v.begin(6)
    v.hold(6)
    v.commit(6)  # the engine's own commit
    assert v.weights.state == State.UPDATING and v.weights.version == 5 and v.weights.target == 6
    v.fail(6, "vetoed")
    assert v.weights.state == State.FAILED and v.weights.version == 5
    v.begin(7)
    v.commit(7)  # a hold does not outlive its refit
    assert v.weights.state == State.CURRENT and v.weights.version == 7


def test_a_lora_request_in_the_window_before_a_veto_gets_the_last_committed_adapter() -> None:
    peft = pytest.importorskip("peft")
    from refit.stages.lora import LoraEngine

    class M(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

    e = LoraEngine(peft.get_peft_model(M(), peft.LoraConfig(r=2, target_modules=["lin"])), keep=2)
    e.assume_current(5)
    with e.adapter() as before:
        pass
    e.begin(6)
    e.load([(s.name, torch.full(s.shape, 7.0)) for s in e.specs()])
    e.versions.hold(6)  # what the receive round does when COMMIT carries a check
    e.commit(6)
    with e.adapter() as during:  # a request thread asks between the engine's commit and the check's veto
        assert during == before
    e.fail(6, "the canary vetoed version 6")
    with e.adapter() as after:
        assert after == before
    assert e.weights.state == State.FAILED and e.weights.version == 5


class _Malformed(Handler):
    name = "test_malformed"

    def due(self, ranks: frozenset[int]) -> object | None:
        return {"x": 1}

    @classmethod
    def parse(cls, value: object) -> object:
        raise IntegrityError("test_malformed is malformed")


class _OnceWrong(ModuleEngine):
    hit = False

    def load(self, tensors: list[tuple[str, torch.Tensor]]) -> None:  # type: ignore[override]
        super().load(tensors)
        if not self.hit and any(n == "n" for n, _ in tensors):
            self.hit = True
            with torch.no_grad():
                self.tensor("n")[0] += 1.0


def test_a_repair_never_hides_a_malformed_commit() -> None:
    register_handler(_Malformed.name, _Malformed)
    try:
        engine = _OnceWrong(_tensors(1), repair=True)
        with session(ModuleSource(_tensors(0)), engine, SETTINGS) as (sender, peer):
            stats, got = refit_both(sender, peer, 1)
        assert not isinstance(stats, RefitStats) and not isinstance(got, RefitStats)
        assert engine.hit and engine.weights.state == State.FAILED
    finally:
        _HANDLERS.pop(_Malformed.name, None)


def test_huge_integers_in_statements_and_sketches_are_refused_not_raised() -> None:
    bad = {"rank": 4, "alpha": 8, "targets": {"q": [4, HUGE]}, "base": ""}
    with pytest.raises(ValueError, match="impossible LoRA adapter"):
        lora_parse(json.dumps({"lora": bad}).encode(), "receiver 1")
    assert canary_bisect.parse({"model.layers.0": [HUGE, 0.0, 0.0, 0.0, 0.0]}) is None


@pytest.mark.parametrize("plan_json", ["[[], [1, 2]]", "[[1, 2], [1.5]]", '[[1, 2], ["x"]]', "[[1], [2], [2]]", "{}"])
def test_a_malformed_relay_plan_is_refused(plan_json: str) -> None:
    with pytest.raises(PeerError, match="malformed"):
        Sites.from_json(plan_json.encode(), 3)
    assert Sites.from_json(b"[[1, 2]]", 3).members == ((1, 2),)


def test_a_repair_index_with_a_float_size_is_refused() -> None:
    m = plan([TensorSpec("a", (4, 8), torch.float32)], capacity=1 << 12)
    body = repair.pack(m, ModuleSource({"a": torch.randn(4, 8)}), ["a"])
    index = json.dumps({"tensors": [["a", 128.0]]}).encode()
    forged = repair._LEN.pack(len(index)) + index + body[-128:]
    with pytest.raises(IntegrityError):
        repair.unpack(forged, m, ["a"])


def test_an_engines_root_is_refused_when_a_refit_begins_while_it_is_read() -> None:
    engine = ModuleEngine(_tensors(0))
    engine.assume_current(3)
    m = plan([TensorSpec(n, tuple(t.shape), t.dtype) for n, t in _tensors(0).items()], capacity=1 << 16)
    assert engine_root(engine, m)[0] == 3
    held = engine.held

    def racing(name: str):  # noqa: ANN202 - what ModuleEngine.held returns
        if engine.weights.state == State.CURRENT:
            engine.begin(4)  # a refit begins on another thread mid-read
        return held(name)

    engine.held = racing  # type: ignore[method-assign]
    with pytest.raises(ValueError, match="refit began"):
        engine_root(engine, m)
    with pytest.raises(ValueError):
        engine_root(engine, m)  # updating now
