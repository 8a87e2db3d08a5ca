"""Zero-copy over nixl with the fingerprint on: the trainer sends VERIFY and COMMIT right after BEGIN, then dies
while its engine READs. The engine sees the connection's end behind those messages at once and fails the refit
promptly, not at its timeout, and never reports the version current."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable

import pytest

from refit.tools.doctor import nixl_installed

if not nixl_installed():
    pytest.skip("needs nixl: pip install '.[nixl]'", allow_module_level=True)

import warm  # noqa: E402
from locations import helper, pythonpath  # noqa: E402
from peer import make_tensors  # noqa: E402

from refit import ModuleEngine, PeerError, Receiver, Settings  # noqa: E402
from refit.protocol.wire import HEADER, WITH_PAYLOAD, Header, Kind  # noqa: E402
from refit.transports.base import Interrupted, Pending  # noqa: E402

SPECS = [[f"w{i}", [32, 32], "float32"] for i in range(6)]
TIMEOUT_S = 30.0


def _queued(sock: socket.socket, kind: Kind) -> bool:
    """Whether a whole `kind` message waits unread on `sock` (peeked: nothing is consumed)."""
    try:
        data = sock.recv(1 << 20, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except BlockingIOError:
        return False
    at = 0
    while at + HEADER.size <= len(data):
        header = Header.unpack(data[at : at + HEADER.size])
        at += HEADER.size + (header.nbytes if header.kind in WITH_PAYLOAD else 0)
        if header.kind == kind and at <= len(data):
            return True
    return False


class Stuck(Pending):
    """A READ whose peer died mid-transfer and that never completes (as a remote agent gone mid-READ leaves
    it): only the watch over the control channel can end the wait before the timeout."""

    def wait(self, timeout_s: float, interrupted: Callable[[], bool] | None = None) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if interrupted is not None and interrupted():
                raise Interrupted
            time.sleep(0.01)
        raise PeerError(f"the READ did not finish in {timeout_s:g} s")


@pytest.mark.slow
def test_a_trainer_dead_after_verify_and_commit_is_seen_at_once_not_at_the_timeout() -> None:
    args = {"specs": SPECS, "transport": "nixl", "bucket_bytes": 4096, "die_at_bucket": 10**6, "zero_copy": True}
    proc = warm.popen(
        [sys.executable, helper("sender_peer.py"), json.dumps({**args, "timeout_s": 60})],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": pythonpath()},
    )
    assert proc.stdout is not None
    rendezvous = json.loads(proc.stdout.readline().removeprefix("@@sender "))
    engine = ModuleEngine(make_tensors(SPECS, seed=5))
    with Receiver(engine, rendezvous, settings=Settings(timeout_s=TIMEOUT_S)) as receiver:
        assert receiver.receive().version == 1
        assert receiver.path is not None and receiver.path.sources is not None and receiver.channel is not None
        remote, sock = receiver.path.sources.remote, receiver.channel.sock  # type: ignore[attr-defined]

        def killing_read(*a, **k):  # noqa: ANN002, ANN003, ANN202 - as the method
            deadline = time.monotonic() + TIMEOUT_S
            while not _queued(sock, Kind.COMMIT) and time.monotonic() < deadline:
                time.sleep(0.01)  # the trainer sends COMMIT without waiting for the READs
            proc.kill()  # then dies, its VERIFY and COMMIT unread on the engine's socket
            proc.wait(timeout=60)
            return Stuck()

        remote.read = killing_read
        start = time.monotonic()
        with pytest.raises(PeerError):
            receiver.receive()
        assert time.monotonic() - start < TIMEOUT_S / 2, "the dead trainer was seen only at the timeout"
    assert engine.weights.state.value != "current" and engine.weights.version == 1
