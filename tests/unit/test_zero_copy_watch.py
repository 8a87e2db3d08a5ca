"""A zero-copy refit's sender sends VERIFY and COMMIT right after BEGIN, while the engine still READs: the
engine's watch keeps both for later and still sees the sender's connection end at once, so a trainer that dies
mid-READ fails the refit promptly (not at the timeout), whether or not the fingerprint check sent VERIFY."""

from __future__ import annotations

import socket

import pytest

from refit.errors import PeerError
from refit.protocol.wire import Channel, Header, Kind
from refit.topology.receive_path import AFTER_BEGIN, Watch


@pytest.mark.parametrize("verify", [True, False])
def test_a_sender_gone_after_verify_and_commit_is_seen_at_once_and_both_kept_in_order(verify: bool) -> None:
    ours, theirs = socket.socketpair()
    ch, peer = Channel(ours, peer="sender", timeout_s=5.0), Channel(theirs, peer="receiver", timeout_s=5.0)
    watch = Watch(ch, "refit 3, the shared tensors", AFTER_BEGIN)
    if verify:
        peer.send(Header(Kind.VERIFY, version=3), {"digests": []})
    peer.send(Header(Kind.COMMIT, version=3))
    assert not watch() and not watch()  # allowed here: no break
    theirs.close()  # the trainer dies mid-READ
    assert watch()
    assert isinstance(watch.broken_off(), PeerError) and "closed the connection" in str(watch.broken_off())
    kinds = [Kind.VERIFY, Kind.COMMIT] if verify else [Kind.COMMIT]
    assert [ch.recv("commit of version 3")[0].kind for _ in kinds] == kinds  # both kept, in order


def test_a_second_commit_read_ahead_is_a_stray_not_kept() -> None:
    ours, theirs = socket.socketpair()
    ch, peer = Channel(ours, peer="sender", timeout_s=5.0), Channel(theirs, peer="receiver", timeout_s=5.0)
    watch = Watch(ch, "refit 3, the shared tensors", AFTER_BEGIN)
    peer.send(Header(Kind.COMMIT, version=3))
    peer.send(Header(Kind.COMMIT, version=3))
    assert watch() and ch.stray is not None and ch.later == []
