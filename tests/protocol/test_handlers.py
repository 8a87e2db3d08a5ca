"""Handlers (refit.stages.handler): what the engines state with READY and what a check carries to their commit.
One registered from outside the package reads every engine's statement at connect, may refuse the session (every
engine is told why), carries a value in COMMIT that the engine's half parses and may veto before its version reads
current; the session classes name none of them. FP8's refusals (a tied tensor) come at connect, on both sides."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence

import pytest
import torch
from threaded import Peer, refit_both, session

from refit import HandshakeError, ModuleEngine, ModuleSource, RefitError, Sender, Settings, stages
from refit.engines.base import Engine
from refit.errors import IntegrityError
from refit.layout import fp8
from refit.layout.fp8 import BlockFormat
from refit.layout.manifest import Manifest
from refit.sources.base import Source
from refit.topology.receiver import Receiver
from refit.topology.stats import RefitStats

SETTINGS = Settings(bucket_bytes=64 << 10, timeout_s=60.0)


class Tagged(ModuleEngine):
    """An engine that states a tag with READY, and vetoes any version whose COMMIT carries 'refuse'."""

    tag = "blue"

    def statement(self) -> dict:
        return {"tag": self.tag}


class Quota(stages.Handler):
    """Reads each engine's tag (refuses an engine without 'blue'), carries the version's parity in COMMIT."""

    name = "quota"
    seen: list[object] = []
    vetoes: list[int] = []

    def adapt(self, source: Source, statements: Sequence[bytes]) -> tuple[Source, tuple[str, ...]]:
        for rank, raw in enumerate(statements):
            tag = json.loads(raw or b"{}").get("tag")
            if tag != "blue":
                raise ValueError(f"receiver {rank} states tag {tag!r}, not 'blue'")
        return source, ()

    def due(self, ranks: frozenset[int]) -> object | None:
        Quota.seen.append(sorted(ranks))
        return {"veto": sum(isinstance(x, list) for x in Quota.seen) == 2}  # the second refit's

    def committed(self, ranks: list[int], carried: bool) -> None:
        Quota.seen.append(("committed", ranks, carried))

    @classmethod
    def parse(cls, value: object) -> object:
        if not (isinstance(value, dict) and isinstance(value.get("veto"), bool)):
            raise IntegrityError("COMMIT's quota must be an object with a boolean veto")
        return value["veto"]

    @classmethod
    def veto(cls, parsed: object, engine: Engine, manifest: Manifest, version: int) -> RefitError | None:
        if parsed:
            Quota.vetoes.append(version)
            return RefitError(f"quota vetoed version {version}")
        return None


@pytest.fixture
def quota() -> Iterator[None]:
    Quota.seen, Quota.vetoes = [], []
    stages.register_handler("quota", Quota)
    try:
        yield
    finally:
        stages._HANDLERS.pop("quota", None)


def _live() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {"w": torch.randn(64, 48, generator=g), "b": torch.randn(48, generator=g)}


@pytest.mark.usefixtures("quota")
def test_a_handler_registered_from_outside_reads_ready_carries_commit_and_vetoes_before_commit() -> None:
    live = _live()
    engine = Tagged({n: torch.zeros_like(t) for n, t in live.items()})
    with session(ModuleSource(live), engine, SETTINGS) as (sender, peer):
        stats, got = refit_both(sender, peer, 1)
        assert isinstance(stats, RefitStats) and isinstance(got, RefitStats), (stats, got)
        assert "quota" in stats.seconds and "quota" in got.seconds
        with torch.no_grad():
            live["w"].add_(1.0)
        stats, got = refit_both(sender, peer, 2)  # the handler's engine half vetoes this one
        assert isinstance(stats, RefitError) and "quota vetoed version 2" in str(stats), stats
        assert isinstance(got, RefitError) and engine.weights.version == 1
        stats, got = refit_both(sender, peer, 3)
        assert isinstance(stats, RefitStats) and engine.weights.version == 3
        assert all(torch.equal(engine.tensor(n), t) for n, t in live.items())
    assert Quota.vetoes == [2]
    assert Quota.seen == [[1], ("committed", [1], True), [1], [1], ("committed", [1], True)]


@pytest.mark.usefixtures("quota")
def test_a_handler_refuses_the_session_at_connect_and_every_engine_is_told_why() -> None:
    live = _live()
    engine = Tagged({n: torch.zeros_like(t) for n, t in live.items()})
    engine.tag = "red"
    with session(ModuleSource(live), engine, SETTINGS) as (sender, peer):
        stats, got = refit_both(sender, peer, 1)
        assert isinstance(stats, HandshakeError) and "receiver 0 states tag 'red'" in str(stats)
        assert isinstance(got, RefitError) and "receiver 0 states tag 'red'" in str(got), got


def test_an_engine_without_the_handler_fails_a_refit_whose_commit_carries_its_field(quota: None) -> None:
    live = _live()
    engine = Tagged({n: torch.zeros_like(t) for n, t in live.items()})
    with session(ModuleSource(live), engine, SETTINGS) as (sender, peer):
        stages._HANDLERS.pop("quota")  # the engine's process never registered it (the trainer's Sender did)
        stats, got = refit_both(sender, peer, 1)
        assert isinstance(stats, RefitError) and "unknown fields ['quota']" in str(stats), stats
        assert engine.weights.version is None


def test_register_handler_refuses_a_bad_name_or_class() -> None:
    with pytest.raises(ValueError, match="must be 1 to 32"):
        stages.register_handler("Bad Name", Quota)
    with pytest.raises(ValueError, match="named 'other'"):
        stages.register_handler("other", Quota)
    with pytest.raises(ValueError, match="subclass of refit.stages.Handler"):
        stages.register_handler("plain", object)  # type: ignore[arg-type]


def test_an_fp8_stated_tied_tensor_is_refused_at_connect_and_the_engine_is_told() -> None:
    shared = torch.randn(64, 32, generator=torch.Generator().manual_seed(1))
    source = ModuleSource({"embed.weight": shared, "lm_head.weight": shared})  # tied: one storage, one view
    f = BlockFormat()
    held = {
        "embed.weight": torch.zeros(64, 32, dtype=torch.float8_e4m3fn),
        f.scale_name("embed.weight"): torch.zeros(fp8.scale_shape((64, 32), f)),
        "lm_head.weight": torch.zeros(64, 32),
    }
    sender = Sender(source, transport="shm", settings=SETTINGS)
    peer = Peer(Receiver(ModuleEngine(held, fp8=f), sender.rendezvous(), settings=SETTINGS))
    peer.ask("connect")
    try:
        with pytest.raises(HandshakeError, match="tied to"):
            sender.connect()  # at connect, before any refit
        peer.ask("receive")
        got = peer.outcome()
        assert isinstance(got, RefitError) and "the trainer refused this engine" in str(got), got
        assert "tied to" in str(got)
    finally:
        sender.close()
        peer.stop()
