"""nccl transport: every host wait is bounded by the session's timeout; on expiry the communicator is aborted
and PeerError names the peer, so the process stays alive (CPU: injected work and stream objects)."""

from __future__ import annotations

import logging
import time

import pytest

from refit import Settings
from refit.errors import PeerError
from refit.transports import nccl
from refit.transports.base import Interrupted
from refit.transports.nccl import NcclTransport


class _NeverDone:
    """An NCCL work object whose broadcast never completes (its peer is hung)."""

    def wait(self, timeout=None) -> bool:  # noqa: ANN001 - torch's signature
        return True  # as NCCL's: only makes the current stream wait

    def is_completed(self) -> bool:
        return False


class _Group:
    def __init__(self, shutdown_error: Exception | None = None) -> None:
        self.aborted = 0
        self.shutdown_error = shutdown_error

    def abort(self) -> None:
        self.aborted += 1

    def shutdown(self) -> None:
        if self.shutdown_error is not None:
            raise self.shutdown_error


def _transport(rank: int, group: _Group) -> NcclTransport:
    t = NcclTransport([], rank=rank, size=3, settings=Settings(timeout_s=0.3), prefix="refit-nccl/test/")
    t._pg = group  # type: ignore[assignment]
    return t


def test_nccl_receive_that_never_completes_aborts_the_group_and_raises_peer_error_naming_the_sender() -> None:
    group = _Group()
    t = _transport(1, group)
    pending = t._pending(_NeverDone(), "nccl receive of 8 bytes from the sender")  # type: ignore[arg-type]
    start = time.monotonic()
    with pytest.raises(PeerError, match=r"within 0\.3s.*the sender \(rank 0\)"):
        pending.wait(0.3)
    assert time.monotonic() - start >= 0.3
    assert group.aborted == 1


def test_nccl_broadcast_that_never_completes_names_the_receivers() -> None:
    group = _Group()
    t = _transport(0, group)
    with pytest.raises(PeerError, match=r"receiver ranks 1\.\.2"):
        t._pending(_NeverDone(), "nccl broadcast of 8 bytes to 2 receiver(s)").wait(0.2)  # type: ignore[arg-type]
    assert group.aborted == 1


def test_nccl_flush_that_never_completes_aborts_within_the_session_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    group = _Group()
    t = _transport(1, group)
    monkeypatch.setattr(nccl, "_stream_marker", lambda: type("Never", (), {"query": lambda self: False})())
    with pytest.raises(PeerError, match=r"sender \(rank 0\)"):
        t.flush()
    assert group.aborted == 1


def test_nccl_close_reports_a_failed_shutdown_instead_of_swallowing_it(caplog: pytest.LogCaptureFixture) -> None:
    t = _transport(1, _Group(shutdown_error=RuntimeError("communicator broken")))
    with caplog.at_level(logging.WARNING, logger="refit"):
        t.close()
    assert "communicator broken" in caplog.text


def test_nccl_receive_the_sender_gave_up_on_aborts_the_group_when_interrupted_not_at_the_timeout() -> None:
    group = _Group()
    t = _transport(1, group)
    looks = 0

    def gave_up() -> bool:
        nonlocal looks
        looks += 1
        return looks == 2

    pending = t._pending(_NeverDone(), "nccl receive of 8 bytes from the sender")  # type: ignore[arg-type]
    start = time.monotonic()
    with pytest.raises(Interrupted, match="nccl receive of 8 bytes from the sender was interrupted"):
        pending.wait(60.0, gave_up)
    assert looks == 2 and group.aborted == 1
    assert time.monotonic() - start < 30.0
