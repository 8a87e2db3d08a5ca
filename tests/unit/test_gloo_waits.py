"""gloo transport: a wait that can be interrupted looks up between short blocking waits, so a receiver whose
sender gave up on a bucket (it said so on the control channel) stops at once instead of at its timeout, and a
wait that outlasts many such looks still gets every byte (a real two-rank gloo group, one thread per rank)."""

from __future__ import annotations

import datetime
import threading
import time

import pytest
import torch
import torch.distributed as dist

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
