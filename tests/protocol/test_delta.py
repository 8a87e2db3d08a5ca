"""Delta refits (`Sender(delta=True)`): only the wire chunks that changed since the version every receiver
committed move, and every refit still leaves each engine holding, bitwise, the trainer's live tensors in the
wire dtype. Receivers run in threads of the test process (tests/helpers/threaded.py) over real shm and gloo
transports; every outcome is waited for as an event."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
from threaded import Peer, RowsEngine

from refit import ModuleEngine, ModuleSource, RefitError, Sender, Settings
from refit.stages.delta import REPRIME, REPROBE, Costs, DeltaStage, WireImage, payload_nbytes
from refit.topology.receiver import Receiver
from refit.topology.stats import RefitStats

BF16 = torch.bfloat16
BUCKET = 512 << 10
"""Bucket capacity: a one-chunk delta (64 KiB and its table) is well under half of a full bucket."""
SETTINGS = Settings(bucket_bytes=BUCKET, timeout_s=60.0)
SLOW_LINK = Costs.known(link=1.0, per_op=0.0, per_byte=0.0)
"""A link far slower than the scan: every bucket that may go as a delta is compared (in-process shm and gloo
are faster than the scan, and a measured choice would send them full)."""


def _trainer() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {
        "embed.weight": torch.randn(512, 512, generator=g),  # 512 KiB in bf16: one bucket of its own
        "mlp.weight": torch.randn(256, 384, generator=g),
        "norm.weight": torch.randn(1000, generator=g),
    }


def _engine(live: dict[str, torch.Tensor]) -> ModuleEngine:
    return ModuleEngine({n: torch.zeros_like(t) for n, t in live.items()})


def _assert_holds(engine: ModuleEngine, live: dict[str, torch.Tensor]) -> None:
    """The engine (fp32) holds the trainer's live tensors cast to bf16, bitwise."""
    _assert_holds_in(engine, live, BF16)


def _assert_holds_in(engine: ModuleEngine, live: dict[str, torch.Tensor], wire: torch.dtype) -> None:
    for name, t in live.items():
        got = engine.tensor(name)
        want = t.to(wire).to(got.dtype)
        assert torch.equal(got.view(-1).view(torch.uint8), want.view(-1).view(torch.uint8)), f"{name} differs"


class Session:
    """A delta Sender over `live` and receivers in threads; `refit(v)` runs one on every peer."""

    def __init__(
        self,
        live: dict[str, torch.Tensor],
        *,
        transport: str,
        receivers: int = 1,
        engines: list[tuple[ModuleEngine, dict]] | None = None,
        **options,
    ) -> None:
        """`engines`: (engine, Receiver keyword arguments) of each receiver; default `receivers` plain ones."""
        self.live = live
        self.check = True
        """Check every plain engine against `live` in bf16 after each refit."""
        engines = engines or [(_engine(live), {}) for _ in range(receivers)]
        self.sender = Sender(
            ModuleSource(live, wire_dtype=BF16),
            transport=transport,
            num_receivers=len(engines),
            settings=SETTINGS,
            delta=True,
            **({"delta_costs": SLOW_LINK} | options),
        )
        self.peers: list[Peer] = []
        for engine, args in engines:
            self.add(engine, **args)

    def add(self, engine: ModuleEngine, **receiver_args) -> Peer:
        peer = Peer(Receiver(engine, self.sender.rendezvous(), settings=SETTINGS, **receiver_args))
        peer.ask("connect")
        self.peers.append(peer)
        return peer

    def refit(self, version: int) -> tuple[RefitStats, list[object]]:
        for p in self.peers:
            p.ask("receive")
        try:
            stats = self.sender.refit(version)
        except RefitError as e:
            outcomes = [p.outcome() for p in self.peers]
            raise RefitError(f"{e} | receivers: {outcomes}") from e
        outcomes = [p.outcome() for p in self.peers]
        for o in outcomes:
            assert isinstance(o, RefitStats), o
        for p in self.peers:
            if self.check and p.receiver.staging is None and not isinstance(p.engine, RowsEngine):
                _assert_holds(p.engine, self.live)
        return stats, outcomes

    def close(self) -> None:
        self.sender.close()
        for p in self.peers:
            p.stop()


@contextlib.contextmanager
def session(live: dict[str, torch.Tensor], **kw) -> Iterator[Session]:
    s = Session(live, **kw)
    try:
        yield s
    finally:
        s.close()


def _full(stats: RefitStats) -> bool:
    return not stats.delta and stats.wire_bytes == stats.full_bytes


@pytest.mark.parametrize("transport", ["shm", "gloo"])
def test_after_a_small_change_only_its_chunks_move(transport: str) -> None:
    live = _trainer()
    with session(live, transport=transport) as s:
        first, _ = s.refit(1)
        assert _full(first)
        sizes = s.sender.manifest.bucket_nbytes
        assert len(sizes) >= 2
        empty = [payload_nbytes(nb, 0) for nb in sizes]  # an unchanged bucket moves its table alone
        same, got = s.refit(2)
        assert same.delta and same.wire_bytes == sum(empty) and got[0].wire_bytes == same.wire_bytes
        live["embed.weight"][0, 3] += 1.0  # one value of the first bucket (embed.weight fills it)
        live["embed.weight"][7, 9] += 1.0
        two, got = s.refit(3)
        assert two.delta and two.wire_bytes == payload_nbytes(sizes[0], 2) + sum(empty[1:])
        assert got[0].wire_bytes == two.wire_bytes
        live["embed.weight"].add_(1.0)  # every value of one bucket: that bucket goes full, the rest as deltas
        most, _ = s.refit(4)
        assert most.delta and most.wire_bytes == sizes[0] + sum(empty[1:])
        for version in range(5, 6 + REPRIME):  # found dense: sent full and not kept, until kept again
            live["embed.weight"][1, version] += 1.0
            stats, _ = s.refit(version)
            first = sizes[0] if version < 5 + REPRIME else payload_nbytes(sizes[0], 1)
            assert stats.wire_bytes == first + sum(empty[1:])


def test_after_a_failed_refit_the_next_is_full_and_correct() -> None:
    live = _trainer()
    with session(live, transport="shm", receivers=2) as s:
        s.refit(1)
        s.refit(2)
        broken = s.peers[1].engine
        inner = broken.load_digested
        armed = {"on": True}

        def load_digested(tensors):  # noqa: ANN001, ANN202 - as the engine's
            if armed["on"]:
                armed["on"] = False
                raise RuntimeError("the engine ran out of memory")
            return inner(tensors)

        broken.load_digested = load_digested  # type: ignore[method-assign]
        live["mlp.weight"][5] *= 3.0
        for p in s.peers:
            p.ask("receive")
        with pytest.raises(RefitError, match="out of memory"):
            s.sender.refit(3)
        outcomes = [p.outcome() for p in s.peers]
        assert isinstance(outcomes[0], RefitStats) and isinstance(outcomes[1], RefitError)
        # receiver 0 committed 3, receiver 1 did not: never a delta against a version one of them lacks
        retry, _ = s.refit(3)
        assert _full(retry)
        live["norm.weight"][0] = 5.0
        again, _ = s.refit(4)
        assert again.delta and again.wire_bytes < again.full_bytes


def test_a_joiner_gets_a_full_refit_and_then_deltas_resume() -> None:
    live = _trainer()
    with session(live, transport="shm", elastic=True) as s:
        s.refit(1)
        assert s.refit(2)[0].delta
        joiner = s.add(_engine(live))
        joiner.join()
        assert s.sender.await_receivers(2, timeout_s=60.0)
        live["mlp.weight"][0, 0] = 2.0
        joined, got = s.refit(3)
        assert _full(joined) and got[1].wire_bytes == joined.full_bytes
        live["mlp.weight"][0, 1] = 2.0
        after, _ = s.refit(4)
        assert after.delta and after.wire_bytes < after.full_bytes / 4


def test_a_dtype_change_starts_a_full_epoch_and_a_replaced_tensor_is_followed() -> None:
    live = _trainer()
    with session(live, transport="shm") as s:
        s.refit(1)
        fresh = live["mlp.weight"].clone()  # new storage, same values but one
        fresh[1, 1] = -4.0
        live["mlp.weight"] = fresh
        replaced, _ = s.refit(2)
        assert replaced.delta and replaced.wire_bytes < replaced.full_bytes / 4
        live["norm.weight"] = live["norm.weight"].double()  # the wire dtype stays bf16: no new epoch
        s.refit(3)
        s.sender.source.set_wire_dtype("norm.weight", torch.float32)  # another wire dtype: a new epoch
        s.check = False  # the bf16 check does not hold for norm.weight now
        switched, _ = s.refit(4)
        assert switched.handshake and _full(switched)
        _assert_holds_in(s.peers[0].engine, {"norm.weight": live["norm.weight"]}, torch.float32)
        live["embed.weight"][9, 9] = 0.5
        after, _ = s.refit(5)
        assert after.delta and after.wire_bytes < after.full_bytes / 4
        _assert_holds_in(s.peers[0].engine, {"embed.weight": live["embed.weight"]}, BF16)


def _image(receiver: Receiver) -> WireImage:
    """The engine half's committed wire image (the delta stage of the receiver's epoch)."""
    assert receiver.path is not None
    stage = receiver.path.stages[0]
    assert isinstance(stage, DeltaStage)
    return stage.image


def test_a_receiver_behind_refuses_the_delta_and_the_retry_is_full() -> None:
    live = _trainer()
    with session(live, transport="shm") as s:
        s.refit(1)
        image = _image(s.peers[0].receiver)
        image.version = 0  # as if it had missed version 1: the sender still thinks it holds 1
        live["norm.weight"][3] = 1.5
        s.peers[0].ask("receive")
        with pytest.raises(RefitError, match=r"refused a delta refit of version 2 against base version 1"):
            s.sender.refit(2)
        assert isinstance(s.peers[0].outcome(), RefitError)
        retry, _ = s.refit(2)
        assert _full(retry)


def test_a_lost_chunk_fails_the_fingerprint_check_and_the_refit() -> None:
    live = _trainer()
    with session(live, transport="shm") as s:
        s.refit(1)
        _image(s.peers[0].receiver).images[0][100] ^= (
            0xFF  # a chunk that will not move: the image no longer holds version 1
        )
        live["norm.weight"][3] = 1.5
        s.peers[0].ask("receive")
        with pytest.raises(RefitError, match="fingerprint check failed"):
            s.sender.refit(2)
        assert isinstance(s.peers[0].outcome(), RefitError)
        assert _full(s.refit(2)[0])


def test_staged_receivers_take_deltas_into_staging() -> None:
    live = _trainer()
    with session(live, transport="shm", engines=[(_engine(live), {}), (_engine(live), {"staged": True})]) as s:
        staged = s.peers[1]
        for version in (1, 2, 3):
            live["embed.weight"][version, 0] = float(version)
            stats, _ = s.refit(version)
            assert stats.delta == (version > 1)
            assert staged.receiver.apply_staged()
            _assert_holds(staged.engine, live)


def test_rows_engines_take_deltas_of_their_rows() -> None:
    live = _trainer()
    rows_engine = RowsEngine({n: torch.zeros_like(t) for n, t in live.items()}, "mlp.weight", 64, 128)
    with session(live, transport="gloo", engines=[(_engine(live), {}), (rows_engine, {})]) as s:
        rows = s.peers[1]
        for version in (1, 2):
            live["mlp.weight"][70, version] = 9.0
            stats, _ = s.refit(version)
            assert stats.delta == (version > 1)
            got = rows.engine.tensor("mlp.weight")
            assert torch.equal(got, live["mlp.weight"][64:128].to(BF16).float())


def test_delta_refuses_zero_copy_and_a_threshold_outside_0_to_1() -> None:
    with pytest.raises(ValueError, match="delta=True cannot be combined with zero_copy"):
        Sender(ModuleSource(_trainer()), transport="cuda-ipc", delta=True, zero_copy=True)
    with pytest.raises(ValueError, match=r"delta_threshold \(1.5\) must be within 0..1"):
        Sender(ModuleSource(_trainer()), delta=True, delta_threshold=1.5)


SPAN = 64 << 10
"""A bucket of 64 KiB: the spanning tensor below fills three of them."""


@pytest.mark.parametrize("verify", [None, "fingerprint"])
def test_a_tensor_spanning_buckets_that_change_densely_and_sparsely_is_loaded_whole(verify: str | None) -> None:
    """Each bucket of a spanning tensor may go a different way (kept and a delta, found dense and sent full);
    the engine is handed the whole tensor as the trainer holds it, whichever way each part went."""
    g = torch.Generator().manual_seed(3)
    live = {"span.weight": torch.randn(3 * 256, 128, generator=g), "norm.weight": torch.randn(64, generator=g)}
    settings = Settings(bucket_bytes=SPAN, timeout_s=60.0)
    engine = _engine(live)
    sender = Sender(
        ModuleSource(live, wire_dtype=BF16),
        transport="shm",
        settings=settings,
        delta=True,
        verify=verify,
        delta_costs=SLOW_LINK,
    )
    peer = Peer(Receiver(engine, sender.rendezvous(), settings=settings))
    peer.ask("connect")
    try:
        for version in range(1, 9):
            if version > 1:
                rows = slice(256, 512) if version % 2 else slice(0, 256)
                live["span.weight"][rows] += torch.randn(256, 128, generator=g)  # one bucket, densely
                live["span.weight"][700, version] += 1.0  # another, in one value
                live["span.weight"][10 if version % 2 else 300, version] += 1.0
            peer.ask("receive")
            sender.refit(version)
            assert isinstance(peer.outcome(), RefitStats)
            assert engine.weights.version == version
            _assert_holds(engine, live)
        assert sender.manifest is not None and sender.manifest.num_buckets >= 3
    finally:
        sender.close()
        peer.stop()


def test_a_sparse_change_at_the_sampling_stride_is_not_judged_dense() -> None:
    """The density sample must not alias with the tensors' layout: tensors of 256 bytes where only the first
    value changes (under 1 % of values) still go as a delta, and so does a refit in which nothing changed."""
    live = {f"t{i}": torch.randn(128) for i in range(512)}  # 256 bytes each in bf16: 128 KiB
    with session(live, transport="shm") as s:
        s.refit(1)
        for version in range(2, 6):
            for t in live.values():
                t[0] += 1.0
            stats, _ = s.refit(version)
            assert stats.delta and stats.wire_bytes < stats.full_bytes / 4, (version, stats.wire_bytes)
            same, _ = s.refit(version + 100)
            assert same.delta and same.wire_bytes < same.full_bytes / 100


def test_a_fast_link_sends_every_bucket_full_and_unkept_and_a_slow_one_gets_a_delta_after_one_reprime() -> None:
    """Delta chooses itself: with the link costed faster than the scan, every bucket goes full, uncompared, and
    neither image copies it (no cost beyond a full refit); when the link turns slow the next refit keeps every
    bucket again, and the one after is a delta against them, bitwise right."""
    live = _trainer()
    costs = Costs.known(link=0.0, per_op=1.0, per_byte=0.0)
    with session(live, transport="shm", delta_costs=costs) as s:
        first, _ = s.refit(1)
        assert first.buckets == {"full-base": first.num_buckets}
        for version in (2, 3):
            live["embed.weight"][version, 0] += 1.0
            live["norm.weight"][version] += 1.0
            fast, _ = s.refit(version)
            assert fast.delta and fast.wire_bytes == fast.full_bytes
            assert fast.buckets == {"full-link": fast.num_buckets} and fast.num_full_by_choice == fast.num_buckets
            assert fast.num_delta_buckets == 0 and fast.num_full_dense == 0
        costs.set(link=1.0, per_op=0.0, per_byte=0.0)
        live["embed.weight"][8, 8] = 0.25
        again, _ = s.refit(4)
        assert again.buckets == {"full-reprime": again.num_buckets} and again.wire_bytes == again.full_bytes
        live["embed.weight"][9, 9] = 0.5
        slow, got = s.refit(5)  # the session checks each engine bitwise against `live`
        sizes = s.sender.manifest.bucket_nbytes
        assert slow.buckets == {"delta": len(sizes)} and slow.num_delta_buckets == len(sizes)
        assert slow.wire_bytes == payload_nbytes(sizes[0], 1) + sum(payload_nbytes(nb, 0) for nb in sizes[1:])
        assert got[0].wire_bytes == slow.wire_bytes


def test_buckets_left_full_by_a_fast_link_are_kept_again_and_scanned_once_the_probe_is_due() -> None:
    """Full by choice is not forever: the scan is timed anew every REPROBE refits (a busier link, or a cheaper
    scan, would be seen), and a bucket the link left unkept is kept again just before."""
    live = _trainer()
    with session(live, transport="shm", delta_costs=Costs.known(link=0.0, per_op=1.0, per_byte=0.0)) as s:
        s.refit(1)
        ways = []
        for version in range(2, REPROBE + 3):
            live["norm.weight"][version % 8] += 1.0
            ways.append(set(s.refit(version)[0].buckets))
        assert ways[: REPROBE - 1] == [{"full-link"}] * (REPROBE - 1)
        assert ways[REPROBE - 1] == {"full-reprime"}
        assert ways[REPROBE] & {"delta", "full-dense-scan"}, ways[REPROBE]  # its first bucket is scanned


def test_a_delta_that_the_receiver_takes_long_to_scatter_is_costed_beyond_its_bytes() -> None:
    """What a delta bucket waits beyond its payload's link time (the receiver's scatter) is measured, and
    counts against the delta: a delta's bytes alone would say it pays."""
    costs = Costs()
    costs.moved(1000, 1.0)  # 1 ms per byte over the link
    costs.scanned(1000, 0.1)
    assert costs.after(1000) == 0.0
    costs.decoded(1000, 2.0)
    assert costs.after(1000) == pytest.approx(2.0) and costs.after(500) == pytest.approx(1.0)
    costs.decoded(1000, -1.0)  # noise below the link time is no negative cost
    assert 0 < costs.after(1000) < 2.0


def test_the_stats_name_why_each_bucket_went_full() -> None:
    live = _trainer()
    with session(live, transport="shm") as s:
        s.refit(1)
        live["embed.weight"].add_(1.0)  # every value of the first bucket: its sample says dense
        stats, _ = s.refit(2)
        rest = stats.num_buckets - 1
        assert stats.buckets == {"full-dense-sample": 1, "delta": rest}
        assert stats.num_full_dense == 1 and stats.num_delta_buckets == rest and stats.num_full_by_choice == 0
        assert s.refit(3)[0].buckets == {"full-unkept": 1, "delta": rest}
        assert stats.to_json()["buckets"] == stats.buckets


def test_a_measured_session_scans_its_first_bucket_before_it_knows_the_scan() -> None:
    """Without given costs, the first delta refit has timed the link (from the full one) but not the scan: its
    first bucket is compared, whatever the others then choose."""
    live = _trainer()
    with session(live, transport="shm", delta_costs=None) as s:
        s.refit(1)
        assert s.sender.delta_costs.link is not None and s.sender.delta_costs.scan(BUCKET) is None
        live["norm.weight"][0] = 3.0
        stats, _ = s.refit(2)
        assert stats.buckets.get("delta", 0) >= 1 and sum(stats.buckets.values()) == stats.num_buckets
        assert s.sender.delta_costs.scan(BUCKET) is not None
