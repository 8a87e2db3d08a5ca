"""Elastic membership with receivers that hold different regions (tensor-parallel rows), in one process over
shm: per-receiver data (digest regions, payloads) follows each receiver's identity through a join, a leave, a
death and a replacement, and a refit committed on fewer than `min_receivers` fails naming who left. After every
refit each engine is compared with the trainer's live tensors (its own rows)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
from threaded import Peer, RowsEngine

from refit import ModuleSource, RefitError, Sender, Settings
from refit.topology.receiver import Receiver
from refit.topology.stats import RefitStats

ROWS = 12
"""Rows of "w"; receiver k of a session holds a third of them (a tensor-parallel slice)."""


def _trainer() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {"w": torch.randn(ROWS, 64, generator=g), "b": torch.randn(300, generator=g)}


def _slice(k: int) -> tuple[int, int]:
    return (k % 3) * ROWS // 3, (k % 3 + 1) * ROWS // 3


@contextlib.contextmanager
def _session(receivers: int, **sender_args: object) -> Iterator[tuple[Sender, dict[str, torch.Tensor], list[Peer]]]:
    tensors = _trainer()
    sender = Sender(
        ModuleSource(tensors),
        transport="shm",
        num_receivers=receivers,
        elastic=True,
        settings=Settings(bucket_bytes=4096, timeout_s=60.0),
        **sender_args,
    )
    peers = [_peer(sender, k) for k in range(receivers)]
    try:
        yield sender, tensors, peers
    finally:
        sender.close()
        for p in peers:
            p.stop()


def _peer(sender: Sender, k: int, *, connect: bool = True) -> Peer:
    start, stop = _slice(k)
    engine = RowsEngine({n: torch.zeros_like(t) for n, t in _trainer().items()}, "w", start, stop)
    peer = Peer(Receiver(engine, sender.rendezvous()))
    if connect:
        peer.ask("connect")
    return peer


def _refit(sender: Sender, tensors: dict[str, torch.Tensor], peers: list[Peer], version: int) -> RefitStats:
    """Step the trainer, refit `version` into `peers`, and check each engine's rows against the live tensors."""
    with torch.no_grad():
        for t in tensors.values():
            t.mul_(1.01).add_(0.5)
    for p in peers:
        p.ask("receive")
    stats = sender.refit(version)
    for p in peers:
        got = p.outcome()
        assert isinstance(got, RefitStats) and got.version == version, got
        e = p.engine
        assert (e.weights.state.value, e.weights.version) == ("current", version)
        assert torch.equal(e.tensor("w"), tensors["w"][e.start : e.stop]) and torch.equal(e.tensor("b"), tensors["b"])
    return stats


def _ranks(peers: list[Peer]) -> list[int]:
    return sorted(p.receiver.rank for p in peers)


@pytest.mark.parametrize("change", ["leave", "death"])
def test_a_departure_leaves_each_survivor_its_own_digests_not_its_neighbours(change: str) -> None:
    with _session(3) as (sender, tensors, peers):
        _refit(sender, tensors, peers, 1)
        gone, survivors = peers[0], peers[1:]
        if change == "leave":
            gone.ask("leave")
            assert gone.outcome() == "left"
        else:
            gone.kill()
        stats = _refit(sender, tensors, survivors, 2)  # failed on the survivors' fingerprints before
        assert stats.receivers == _ranks(survivors) and [d["receiver"] for d in stats.departed] == _ranks([gone])
        _refit(sender, tensors, survivors, 3)


def test_a_joiner_and_a_replacement_take_their_own_regions_beside_the_others() -> None:
    with _session(2) as (sender, tensors, peers):
        _refit(sender, tensors, peers, 1)
        joiner = _peer(sender, 2)
        joiner.join()
        assert sender.await_receivers(3, timeout_s=60.0)
        assert _refit(sender, tensors, [*peers, joiner], 2).receivers == _ranks([*peers, joiner])
        peers[0].ask("leave")
        assert peers[0].outcome() == "left"
        replacement = _peer(sender, 0)  # the departed one's rows, under a new rank
        replacement.join()
        assert sender.await_receivers(3, timeout_s=60.0)
        stats = _refit(sender, tensors, [peers[1], joiner, replacement], 3)
        assert stats.receivers == _ranks([peers[1], joiner, replacement]) and replacement.receiver.rank == 4
        peers.append(joiner)
        peers.append(replacement)


def test_an_elastic_refit_committed_on_fewer_than_min_receivers_fails_naming_who_left() -> None:
    with _session(1) as (sender, tensors, peers):
        _refit(sender, tensors, peers, 1)
        peers[0].ask("leave")
        assert peers[0].outcome() == "left"
        with pytest.raises(RefitError, match=r"refit of version 2 reached 0 receiver\(s\), fewer than min_receivers"):
            sender.refit(2)
        with pytest.raises(RefitError, match=r"receiver 1: the test asked it to leave"):
            sender.refit(2)  # still no receiver: the same reason, not a silent success
        late = _peer(sender, 0)
        peers.append(late)
        late.join()
        assert sender.await_receivers(1, timeout_s=60.0)
        stats = _refit(sender, tensors, [late], 2)
        assert stats.receivers == [2] and [d["receiver"] for d in stats.departed] == [1]


def test_min_receivers_zero_lets_an_empty_elastic_refit_pass_and_two_counts_the_committed() -> None:
    with _session(1, min_receivers=0) as (sender, tensors, peers):
        _refit(sender, tensors, peers, 1)
        peers[0].ask("leave")
        assert peers[0].outcome() == "left"
        assert sender.refit(2).receivers == []
    with _session(2, min_receivers=2) as (sender, tensors, peers):
        _refit(sender, tensors, peers, 1)
        peers[1].kill()
        peers[0].ask("receive")
        with pytest.raises(
            RefitError, match=r"committed on 1 receiver\(s\), fewer than min_receivers \(2\).*closed the connection"
        ):
            sender.refit(2)
        assert isinstance(peers[0].outcome(), RefitStats)  # it holds version 2 and says so; the trainer is told


def test_min_receivers_is_checked() -> None:
    source = ModuleSource(_trainer())
    with pytest.raises(ValueError, match=r"min_receivers \(-1\) must be >= 0"):
        Sender(source, transport="shm", elastic=True, min_receivers=-1)
    with pytest.raises(ValueError, match=r"min_receivers \(3\) is for an elastic Sender"):
        Sender(source, transport="shm", num_receivers=2, min_receivers=3)


def test_a_joiner_that_hung_up_after_its_ready_is_not_counted_as_ready() -> None:
    """A joiner killed after its READY (its bytes still unread) is gone: await_receivers does not count it, so a
    caller waiting for the next joiner is not told one is there (it would miss the refit that follows)."""
    with _session(1) as (sender, tensors, peers):
        _refit(sender, tensors, peers, 1)
        dead = _peer(sender, 1)
        dead.join()
        assert sender.await_receivers(2, timeout_s=60.0)  # its READY is in
        dead.kill()
        assert not sender.await_receivers(2, timeout_s=0.5)
        joiner = _peer(sender, 2)
        joiner.join()
        assert sender.await_receivers(2, timeout_s=60.0)
        stats = _refit(sender, tensors, [*peers, joiner], 2)
        assert stats.receivers == _ranks([*peers, joiner])
        assert [d["receiver"] for d in stats.departed] == [dead.receiver.rank]
        peers += [dead, joiner]
