"""The engine's whole state beside its weights: every buffer is sent, waived by name, or named in the handshake
(a routing table in integers, a non-persistent buffer); a target and its draft move as one version, both
committed or neither."""

from __future__ import annotations

import logging

import pytest
import torch
from threaded import refit_both, session
from torch import nn

from refit import HandshakeError, ModuleEngine, ModuleSource, RefitError, Settings, State
from refit.topology.stats import RefitStats

SETTINGS = Settings(bucket_bytes=16 << 10, timeout_s=60.0)


class Routed(nn.Module):
    """A layer with a routing table (int64, persistent) and an expert map kept off checkpoints (non-persistent)."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.proj = nn.Linear(32, 48)
        self.register_buffer("routing", torch.randint(0, 8, (64,), generator=g))
        self.register_buffer("expert_map", torch.randint(0, 8, (16,), generator=g, dtype=torch.int32), persistent=False)


def _session(source: ModuleSource, engine: ModuleEngine, **options: object):  # noqa: ANN202
    return session(source, engine, SETTINGS, **options)


def _remap(m: Routed, version: int) -> None:
    """The trainer's step: new weights, and a new routing table and expert map (as load balancing does)."""
    g = torch.Generator().manual_seed(100 + version)
    with torch.no_grad():
        m.proj.weight.add_(torch.randn(m.proj.weight.shape, generator=g))
        m.routing.copy_(torch.randint(0, 8, m.routing.shape, generator=g))
        m.expert_map.copy_(torch.randint(0, 8, m.expert_map.shape, generator=g, dtype=torch.int32))


def test_a_non_persistent_buffer_the_trainer_does_not_send_is_named_with_both_fixes(
    caplog: pytest.LogCaptureFixture,
) -> None:
    trainer, held = Routed(0), Routed(1)
    with caplog.at_level(logging.WARNING, logger="refit"):
        with _session(ModuleSource(trainer), ModuleEngine(held)) as (sender, peer):
            _remap(trainer, 1)
            stats, got = refit_both(sender, peer, 1)
            assert isinstance(stats, RefitStats) and isinstance(got, RefitStats), (stats, got)
            assert torch.equal(held.routing, trainer.routing)  # the persistent table moves with the weights
            assert not torch.equal(held.expert_map, trainer.expert_map)  # the engine's own: not synced ...
    said = [r.getMessage() for r in caplog.records if "non-persistent" in r.getMessage()]
    assert any("receiver 1:" in m and "'expert_map'" in m for m in said), said  # ... and named, trainer
    assert any("ignore=['expert_map']" in m and "send them" in m for m in said), said  # the two fixes, engine


@pytest.mark.parametrize("verify", ["fingerprint", None])
def test_a_source_sending_non_persistent_buffers_keeps_them_exact(verify: str | None) -> None:
    trainer, held = Routed(0), Routed(1)
    with _session(ModuleSource(trainer, non_persistent=True, wire_dtype=torch.bfloat16), ModuleEngine(held),
                  verify=verify) as (sender, peer):  # fmt: skip
        for version in (1, 2):
            _remap(trainer, version)
            stats, got = refit_both(sender, peer, version)
            assert isinstance(stats, RefitStats) and isinstance(got, RefitStats), (stats, got)
            assert torch.equal(held.routing, trainer.routing) and torch.equal(held.expert_map, trainer.expert_map)
            assert held.expert_map.dtype == torch.int32  # sent in its own dtype, never cast
        assert sender.manifest is not None
        wire = {p.spec.name: p.spec.dtype for p in sender.manifest.entries}
        assert wire["expert_map"] == torch.int32 and wire["proj.weight"] == torch.bfloat16


def test_the_fingerprint_names_a_buffer_the_engine_loaded_wrong() -> None:
    trainer, held = Routed(0), Routed(1)
    engine = ModuleEngine(held)
    with _session(ModuleSource(trainer, non_persistent=True), engine) as (sender, peer):
        real = engine.load_digested

        def zeroed(tensors: list[tuple[str, torch.Tensor]]):  # noqa: ANN202 - as the base
            return real([(n, torch.zeros_like(t) if n == "expert_map" else t) for n, t in tensors])

        engine.load_digested = zeroed  # type: ignore[method-assign]
        _remap(trainer, 1)
        stats, got = refit_both(sender, peer, 1)
        assert isinstance(stats, RefitError) and "expert_map" in str(stats), stats
        assert engine.weights.state == State.FAILED


def test_an_engine_buffer_the_trainer_lacks_is_refused_until_waived() -> None:
    trainer, held = nn.Linear(32, 48), Routed(1)
    with _session(ModuleSource(trainer), ModuleEngine(held.proj)) as (sender, peer):  # the plain layer: fits
        assert isinstance(refit_both(sender, peer, 1)[0], RefitStats)
    prefixed = {f"proj.{n}": t for n, t in trainer.state_dict(keep_vars=True).items()}
    with _session(ModuleSource(prefixed), ModuleEngine(held)) as (sender, peer):
        stats, got = refit_both(sender, peer, 1)
        assert isinstance(stats, HandshakeError) and "routing" in str(stats) and "ignore=['routing']" in str(stats)
        assert isinstance(got, HandshakeError)
    with _session(ModuleSource(prefixed), ModuleEngine(held, ignore=["routing", "expert_map"])) as (sender, peer):
        stats, got = refit_both(sender, peer, 1)
        assert isinstance(stats, RefitStats) and isinstance(got, RefitStats), (stats, got)


def _pair(seed: int) -> nn.ModuleDict:
    torch.manual_seed(seed)
    return nn.ModuleDict({"target": nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64)), "draft": nn.Linear(64, 64)})


@pytest.mark.parametrize("staged", [False, True])
def test_a_target_and_its_draft_move_as_one_version_both_or_neither(staged: bool) -> None:
    trainer, held = _pair(0), _pair(1)
    engine = ModuleEngine(held)
    with _session(ModuleSource(trainer), engine, staged=staged) as (sender, peer):
        stats, got = refit_both(sender, peer, 1)
        assert isinstance(stats, RefitStats) and isinstance(got, RefitStats), (stats, got)
        if staged:
            assert peer.receiver.apply_staged() is True
        assert all(torch.equal(a, b) for a, b in zip(held.state_dict().values(), trainer.state_dict().values()))
        assert engine.weights.version == 1
        before = {n: t.clone() for n, t in held.state_dict().items()}
        live = engine.load_digested if not staged else peer.receiver.engine.load_digested

        def draft_wrong(tensors: list[tuple[str, torch.Tensor]]):  # noqa: ANN202 - as the base
            return live([(n, t + 1 if n.startswith("draft.") else t) for n, t in tensors])

        if staged:
            peer.receiver.engine.load_digested = draft_wrong  # type: ignore[method-assign]
        else:
            engine.load_digested = draft_wrong  # type: ignore[method-assign]
        with torch.no_grad():
            for p in trainer.parameters():
                p.add_(1.0)
        stats, got = refit_both(sender, peer, 2)
        assert isinstance(stats, RefitError) and "draft." in str(stats), stats
        if staged:  # the live target and draft both stay at version 1, untouched
            assert engine.weights.version == 1 and engine.weights.state == State.CURRENT
            assert all(torch.equal(before[n], t) for n, t in held.state_dict().items())
        else:  # both are marked failed: neither is served as version 2
            assert engine.weights.state == State.FAILED and engine.weights.version != 2
