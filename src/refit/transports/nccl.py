"""nccl transport: disaggregated GPUs; the sender broadcasts each bucket over a dedicated NCCL group.

Packing runs on the current stream and each broadcast on NCCL's own stream, so packing bucket i+1
overlaps the broadcast of bucket i; the streams order buffer reuse. Every host wait (a broadcast, the
receiver's flush, the group's first connection) polls for completion up to the session's timeout; on
expiry the communicator is aborted and PeerError names the peer, so this process stays alive and can
start a new session. Torch's own watchdog is armed later than that deadline: its default handling
tears the whole process down.
"""

from __future__ import annotations

import datetime
import os
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from refit.errors import PeerError
from refit.log import get_logger
from refit.transports.base import INTERRUPT_EVERY_S, Interrupted, Pending
from refit.transports.group import BroadcastTransport

log = get_logger("nccl")

_POLL_MAX_S = 1e-4
"""Longest pause between polls. Every bucket's wait polls, and a 1 GiB broadcast takes about 3 ms on
NVLink: a pause that grew to 10 ms would add up to a bucket's own time to each one."""


def _stream_marker() -> Any:
    """An event recorded on the current stream now: `query()` says whether the stream got past it."""
    event = torch.cuda.Event()
    event.record()
    return event


def _watchdog_s(timeout_s: float) -> float:
    """Torch's watchdog fires only well after refit's own deadline has aborted the group and raised."""
    return 2 * timeout_s + 60


class _StreamWork(Pending):
    """An NCCL op: `wait` orders the current stream after it, then polls it until done or the deadline."""

    def __init__(self, work: dist.Work, what: str, transport: NcclTransport) -> None:
        self._work, self._what, self._transport = work, what, transport

    def wait(self, timeout_s: float, interrupted: Callable[[], bool] | None = None) -> None:
        try:
            self._work.wait()
            self._transport.until(self._work.is_completed, timeout_s, self._what, interrupted)
        except PeerError:
            raise
        except RuntimeError as e:  # torch.distributed's errors (DistBackendError and kin) are RuntimeErrors
            raise PeerError(f"{self._what} failed: {e}; did {self._transport.peer} exit?") from e


class NcclTransport(BroadcastTransport):
    name = "nccl"
    device_type = "cuda"

    @property
    def peer(self) -> str:
        """Who this rank waits for: the sender (rank 0), or every receiver."""
        return "the sender (rank 0)" if self._rank else f"receiver ranks 1..{self._size - 1}"

    def until(
        self, done: Callable[[], bool], timeout_s: float, what: str, interrupted: Callable[[], bool] | None = None
    ) -> None:
        """Poll `done` until it holds; past `timeout_s` abort the communicator and raise PeerError. When
        `interrupted()` holds (looked at every INTERRUPT_EVERY_S), abort it too and raise Interrupted: the
        kernel would otherwise block this device's stream for good."""
        deadline, pause = time.monotonic() + timeout_s, 1e-5
        look = time.monotonic() + INTERRUPT_EVERY_S
        while not done():
            if interrupted is not None and time.monotonic() >= look:
                look = time.monotonic() + INTERRUPT_EVERY_S
                if interrupted():
                    self._abort()
                    raise Interrupted(f"{what} was interrupted; the NCCL group was aborted")
            if time.monotonic() >= deadline:
                self._abort()
                raise PeerError(
                    f"{what} did not complete within {timeout_s:g}s: {self.peer} is gone or hung; the NCCL "
                    "group was aborted, start a new session (or raise the timeout, REFIT_TIMEOUT)"
                )
            time.sleep(pause)
            pause = min(2 * pause, _POLL_MAX_S)

    def _abort(self) -> None:
        pg, self._pg = self._pg, None
        if pg is None:
            return
        try:
            pg.abort()
        except RuntimeError as e:  # the group is being abandoned either way; the PeerError follows
            log.warning("aborting the NCCL group (rank %d of %d): %s", self._rank, self._size, e)

    def _group(self, store: dist.Store) -> dist.ProcessGroup:
        if self._settings.ifname and "NCCL_SOCKET_IFNAME" not in os.environ:
            os.environ["NCCL_SOCKET_IFNAME"] = self._settings.ifname  # read by NCCL when the communicator starts
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = datetime.timedelta(seconds=_watchdog_s(self._settings.timeout_s))
        device = self.buffers[0].device
        try:
            pg = dist.ProcessGroupNCCL(dist.PrefixStore(self._prefix, store), self._rank, self._size, opts)
        except RuntimeError as e:  # torch.distributed's errors are RuntimeErrors
            raise PeerError(f"NCCL group setup (rank {self._rank} of {self._size}) failed: {e}") from e
        self._pg = pg
        # Connect now (prepared once), not on the first refit.
        with torch.cuda.device(device):
            x = torch.zeros(1, device=device)
            self._pending(pg.broadcast([x], self._opts), "NCCL group setup").wait(self._settings.timeout_s)
        return pg

    def _pending(self, work: dist.Work, what: str) -> Pending:
        return _StreamWork(work, what, self)

    def flush(self) -> None:
        marker = _stream_marker()
        self.until(marker.query, self._settings.timeout_s, "the receiver's loads (after NCCL receives)")

    def close(self) -> None:
        if self._pg is not None:
            try:
                self._pg.shutdown()
            except RuntimeError as e:  # closing a group a peer broke: say so, the close itself goes on
                log.warning("NCCL group shutdown (rank %d of %d) failed: %s", self._rank, self._size, e)
        super().close()
