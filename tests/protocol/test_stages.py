"""Stages registered from outside the package (refit.stages.register) run in real refits, both halves, bitwise;
an engine that has not registered one refuses the handshake naming it; a stage that does not undo its step
is caught by the fingerprint."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
from threaded import Peer, refit_both

from refit import HandshakeError, ModuleEngine, ModuleSource, RefitError, Sender, Settings, stages
from refit.protocol.wire import Bucket
from refit.topology.receiver import Receiver
from refit.topology.stats import RefitStats

BF16 = torch.bfloat16
SETTINGS = Settings(bucket_bytes=64 << 10, timeout_s=60.0)


class Mask(stages.Stage):
    """XOR every wire byte with a key that changes per bucket: the bytes on the wire are not the tensors'."""

    name = "mask"
    calls: dict[str, int] = {"out": 0, "in": 0}

    def _key(self, b: int) -> int:
        return (0x5A + 37 * b) & 0xFF or 1

    def outgoing(self, b: int, buf: torch.Tensor, nbytes: int) -> tuple[int, Bucket]:
        Mask.calls["out"] += 1
        buf[:nbytes].bitwise_xor_(self._key(b))
        return nbytes, Bucket(0)

    def incoming(self, b: int, buf: torch.Tensor, nbytes: int, flags: Bucket) -> torch.Tensor | None:
        Mask.calls["in"] += 1
        buf[:nbytes].bitwise_xor_(self._key(b))
        return None


class Forgetful(Mask):
    """Masks on the way out, forgets to unmask on the way in."""

    name = "forgetful"

    def incoming(self, b: int, buf: torch.Tensor, nbytes: int, flags: Bucket) -> torch.Tensor | None:
        return None


@pytest.fixture(autouse=True)
def _registered() -> Iterator[None]:
    stages.register("mask", Mask)
    stages.register("forgetful", Forgetful)
    Mask.calls.update({"out": 0, "in": 0})
    yield


def _trainer() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {
        "embed.weight": torch.randn(256, 300, generator=g),  # 150 KiB in bf16: spans three buckets
        "mlp.weight": torch.randn(64, 96, generator=g),
        "norm.weight": torch.randn(500, generator=g),
    }


def _holds(engine: ModuleEngine, live: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(engine.tensor(n), t.to(BF16).to(engine.tensor(n).dtype)) for n, t in live.items())


@contextlib.contextmanager
def _session(live: dict[str, torch.Tensor], **options: object) -> Iterator[tuple[Sender, Peer, ModuleEngine]]:
    sender = Sender(ModuleSource(live, wire_dtype=BF16), transport="shm", settings=SETTINGS, **options)
    engine = ModuleEngine({n: torch.zeros_like(t) for n, t in live.items()})
    peer = Peer(Receiver(engine, sender.rendezvous(), settings=SETTINGS))
    peer.ask("connect")
    try:
        yield sender, peer, engine
    finally:
        sender.close()
        peer.stop()


def _refit(sender: Sender, peer: Peer, version: int) -> tuple:
    return refit_both(sender, peer, version)


@pytest.mark.parametrize("delta", [False, True])
def test_a_stage_registered_from_outside_runs_both_halves_in_a_real_refit_bitwise(delta: bool) -> None:
    live = _trainer()
    with _session(live, stages=["mask"], delta=delta) as (sender, peer, engine):
        for version in (1, 2, 3):
            with torch.no_grad():
                live["embed.weight"][version, :7] += 1.0  # a sparse change: delta buckets go masked too
            stats, got = _refit(sender, peer, version)
            assert isinstance(stats, RefitStats) and isinstance(got, RefitStats), (stats, got)
            assert _holds(engine, live), f"version {version}"
            assert engine.weights.version == version
        assert sender.manifest is not None
        assert sender.manifest.stages == (("delta", "mask") if delta else ("mask",))
        assert stats.delta == delta
        assert Mask.calls["out"] == Mask.calls["in"] == 3 * sender.manifest.num_buckets


def test_an_engine_without_the_stage_refuses_the_handshake_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    live = _trainer()
    with _session(live, stages=["mask"]) as (sender, peer, engine):
        monkeypatch.setattr(stages, "registered", lambda name: name != "mask")  # as in an engine's own process
        stats, got = _refit(sender, peer, 1)
        assert isinstance(stats, HandshakeError) and isinstance(got, HandshakeError)
        assert "stage(s) mask" in str(stats) and "refit.stages.register" in str(stats)
        assert engine.weights.version is None


def test_a_stage_that_does_not_undo_its_step_fails_the_fingerprint() -> None:
    live = _trainer()
    with _session(live, stages=["forgetful"]) as (sender, peer, engine):
        stats, got = _refit(sender, peer, 1)
        assert isinstance(stats, RefitError) and "fingerprint check failed" in str(stats)
        assert isinstance(got, RefitError) and engine.weights.state.value == "failed"


def test_register_refuses_a_bad_name_or_class() -> None:
    with pytest.raises(ValueError, match="stage name"):
        stages.register("Bad Name", Mask)
    with pytest.raises(ValueError, match="subclass of refit.stages.Stage"):
        stages.register("plain", object)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not registered"):
        Sender(ModuleSource(_trainer()), transport="shm", stages=["nobody"])


def test_a_full_bucket_moving_fewer_bytes_than_the_manifest_fails_the_refit_without_the_fingerprint(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A sender whose bucket header claims fewer bytes without a resizing flag: the receiver refuses the bucket
    (the checksum would only cover the short prefix, and the tail is whatever the slot held before)."""
    from refit.topology.send_path import SendPath

    outgoing = SendPath._outgoing

    def short(self: SendPath, b: int, slot: int) -> tuple[int, Bucket]:
        nbytes, flags = outgoing(self, b, slot)
        return (nbytes - 4096, flags) if b == 0 and not Bucket.DELTA & flags else (nbytes, flags)

    monkeypatch.setattr(SendPath, "_outgoing", short)
    live = _trainer()
    with _session(live, stages=["mask"], delta=True, verify=None) as (sender, peer, engine):
        stats, got = _refit(sender, peer, 1)
        assert isinstance(stats, RefitError) and "disagrees with the manifest" in str(stats)
        assert isinstance(got, RefitError) and engine.weights.version is None


def test_a_delta_payload_in_a_refit_that_named_no_base_is_refused() -> None:
    from refit.errors import IntegrityError
    from refit.layout.planner import plan
    from refit.layout.spec import TensorSpec
    from refit.stages.delta import DeltaStage

    m = plan([TensorSpec("w", (1024,), torch.bfloat16)], capacity=4096)
    engine_half = DeltaStage(m, torch.device("cpu"), trainer=False)
    buf = torch.zeros(4096, dtype=torch.uint8)
    assert engine_half.accept(2, None) is None  # a full refit
    with pytest.raises(IntegrityError, match="named no base version"):
        engine_half.incoming(0, buf, 16, Bucket.DELTA | Bucket.KEPT)


def test_a_stage_that_resizes_without_its_flag_is_refused_on_the_trainer() -> None:
    class Shrink(Mask):
        name = "shrink"

        def outgoing(self, b: int, buf: torch.Tensor, nbytes: int) -> tuple[int, Bucket]:
            return nbytes - 256, Bucket(0)

    stages.register("shrink", Shrink)
    live = _trainer()
    with _session(live, stages=["shrink"]) as (sender, peer, engine):
        peer.ask("receive")
        with pytest.raises(ValueError, match="stage shrink made bucket 0"):
            sender.refit(1)


def test_the_manifests_stage_rules_are_checked_where_the_options_are_made() -> None:
    source = ModuleSource(_trainer(), wire_dtype=BF16)
    with pytest.raises(ValueError, match=r"name 'mask' twice; a manifest lists each stage once"):
        Sender(source, transport="shm", settings=SETTINGS, stages=["mask", "mask"])
    many = [f"s{i}" for i in range(16)]
    for name in many:
        stages.register(name, Mask)
    try:
        with pytest.raises(ValueError, match=r"17 stages given \(delta counts as one\); a manifest lists at most 16"):
            Sender(source, transport="shm", settings=SETTINGS, stages=many, delta=True)
        Sender(source, transport="shm", settings=SETTINGS, stages=many).close()  # 16 is the most
    finally:
        for name in many:
            stages._REGISTRY.pop(name, None)


def test_a_stage_the_engines_statements_add_and_the_options_name_too_is_refused() -> None:
    from refit.topology.options import stage_rules

    with pytest.raises(ValueError, match=r"adds stage\(s\) \['fp8'\].*name 'fp8' too.*drop it from stages"):
        stage_rules(("fp8",), ("mask", "fp8"))
    with pytest.raises(ValueError, match="at most 16: name fewer stages"):
        stage_rules(("fp8", "lora"), tuple(f"s{i}" for i in range(15)))
    stage_rules(("fp8",), ("mask",))
