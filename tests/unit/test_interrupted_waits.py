"""A receiver waiting on a bucket's bytes stops when its sender gives up on the refit (it says so on the control
channel) instead of at its timeout. gloo: the wait looks up between short blocking waits (a real two-rank group,
one thread per rank) and still gets every byte, and an operation done just as a slice ran out is not read as a
failure. The watch on the control channel: heartbeats are not a sign, descriptors from 1024 on are watched."""

from __future__ import annotations

import datetime
import os
import socket
import threading
import time

import pytest
import torch
import torch.distributed as dist

from refit.errors import PeerError
from refit.protocol.wire import Channel, Header, Kind, PeerFailed
from refit.topology.membership import readable
from refit.topology.receive_path import Watch
from refit.transports.base import Interrupted
from refit.transports.gloo import _Work

TIMEOUT_S = 60.0


def _groups() -> list[dist.ProcessGroup]:
    store = dist.HashStore()
    groups: list = [None, None]

    def make(rank: int) -> None:
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = datetime.timedelta(seconds=TIMEOUT_S)
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        groups[rank] = dist.ProcessGroupGloo(store, rank, 2, opts)

    threads = [threading.Thread(target=make, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return groups


def _recv(group: dist.ProcessGroup, out: torch.Tensor) -> _Work:
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    return _Work(group.broadcast([out], opts), "gloo receive of 4096 bytes from the sender")


def test_a_receive_the_sender_gave_up_on_stops_when_interrupted_not_at_its_timeout() -> None:
    sender, receiver = _groups()
    looks = 0

    def gave_up() -> bool:
        nonlocal looks
        looks += 1
        return looks == 3  # the sender's REGROUP (or ERROR) arrived while the bytes never will

    start = time.monotonic()
    with pytest.raises(Interrupted, match="gloo receive of 4096 bytes from the sender was interrupted"):
        _recv(receiver, torch.zeros(1024)).wait(TIMEOUT_S, gave_up)
    assert looks == 3
    assert time.monotonic() - start < TIMEOUT_S / 2
    del sender


def test_a_receive_that_outlasts_many_looks_still_gets_every_byte() -> None:
    sender, receiver = _groups()
    looks, sent = 0, threading.Event()
    data = torch.randn(1024)

    def send() -> None:
        sent.wait()
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        sender.broadcast([data.clone()], opts).wait()

    def looked() -> bool:
        nonlocal looks
        looks += 1
        if looks == 4:  # the bytes leave only after the wait has looked up four times
            sent.set()
        return False

    thread = threading.Thread(target=send)
    thread.start()
    out = torch.zeros(1024)
    _recv(receiver, out).wait(TIMEOUT_S, looked)
    thread.join()
    assert looks >= 4
    assert torch.equal(out, data)


class _DoneAtTheSlice:
    """A gloo work whose operation completes just as a slice of waiting runs out (torch then raises)."""

    def __init__(self, error: Exception | None = None) -> None:
        self.done, self.error = False, error

    def wait(self, timeout=None) -> bool:  # noqa: ANN001 - torch's signature
        if timeout is not None and not self.done:
            self.done = True
            raise RuntimeError("Operation timed out!")
        if self.error is not None:
            raise self.error
        return True

    def is_completed(self) -> bool:
        return self.done


def test_an_operation_done_as_a_slice_runs_out_is_done_not_failed() -> None:
    _Work(_DoneAtTheSlice(), "gloo receive").wait(TIMEOUT_S, lambda: False)  # type: ignore[arg-type]


def test_an_operation_that_failed_as_a_slice_ran_out_says_its_own_error() -> None:
    work = _Work(_DoneAtTheSlice(RuntimeError("Connection reset by peer")), "gloo receive")  # type: ignore[arg-type]
    with pytest.raises(PeerError, match="gloo receive failed: Connection reset by peer"):
        work.wait(TIMEOUT_S, lambda: False)


def _pair() -> tuple[Channel, socket.socket]:
    ours, theirs = socket.socketpair()
    return Channel(ours, peer="sender", timeout_s=5.0), theirs


def test_the_watch_skips_heartbeats_and_keeps_what_the_sender_said_for_the_caller() -> None:
    ch, sender = _pair()
    watch = Watch(ch, "refit 7, bucket 3")
    assert not watch()
    sender.sendall(Header(Kind.HEARTBEAT).pack())
    assert not watch()  # a beat is no sign that the refit was given up
    assert ch.heartbeats == 1
    sender.sendall(Header(Kind.CLOSE).pack())
    assert watch()
    assert ch.stray is not None and ch.stray[0].kind == Kind.CLOSE
    assert "sender sent CLOSE during refit 7, bucket 3, while its bytes were in flight" in str(watch.broken_off())


def test_the_watch_keeps_the_senders_error_and_the_connections_end() -> None:
    ch, sender = _pair()
    Channel(sender, peer="receiver", timeout_s=5.0).send(Header(Kind.ERROR), {"message": "the trainer failed"})
    watch = Watch(ch, "refit 7, bucket 3")
    assert watch()
    error = watch.broken_off()
    assert isinstance(error, PeerFailed) and "the trainer failed" in str(error)
    sender.close()
    ended = Watch(ch, "refit 7, bucket 3")
    assert ended()
    assert "closed the connection during refit 7, bucket 3" in str(ended.broken_off())


def test_a_message_the_protocol_allows_mid_transfer_is_kept_for_the_next_recv_and_the_end_still_seen() -> None:
    """Zero-copy: the sender's VERIFY and COMMIT follow BEGIN while the engine still READs. The watch keeps the
    first for later (no break), reads nothing after it, and still sees the sender's connection end."""
    ch, sender = _pair()
    peer = Channel(sender, peer="receiver", timeout_s=5.0)
    watch = Watch(ch, "refit 7, the shared tensors", frozenset({Kind.VERIFY, Kind.COMMIT}))
    peer.send(Header(Kind.VERIFY, version=7), {"digests": []})
    peer.send(Header(Kind.COMMIT, version=7))
    assert not watch() and not watch()
    assert ch.ahead is not None and ch.ahead[0].kind == Kind.VERIFY
    header, payload = ch.recv("commit of version 7")
    assert (header.kind, header.version, payload) == (Kind.VERIFY, 7, b'{"digests":[]}')
    assert ch.recv("commit of version 7")[0].kind == Kind.COMMIT  # read after it, in order
    watch = Watch(ch, "refit 8, the shared tensors", frozenset({Kind.VERIFY, Kind.COMMIT}))
    peer.send(Header(Kind.COMMIT, version=8))
    assert not watch()
    sender.close()
    assert watch()
    assert "closed the connection during refit 8, the shared tensors" in str(watch.broken_off())
    assert ch.recv("commit of version 8")[0].kind == Kind.COMMIT  # the message that came first stays


def test_a_channel_on_a_descriptor_past_1023_is_watched_not_taken_for_closed() -> None:
    ours, theirs = socket.socketpair()
    high = os.dup2(ours.fileno(), 1500)  # select() refuses it; an engine with many files open hands such out
    ch = Channel(socket.socket(fileno=high), peer="sender", timeout_s=5.0)
    try:
        assert not readable(ch)
        theirs.sendall(Header(Kind.HEARTBEAT).pack())
        assert readable(ch)
    finally:
        ch.sock.close()
        ours.close()
        theirs.close()
