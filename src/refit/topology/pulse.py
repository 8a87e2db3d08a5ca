"""Heartbeats from a Sender to every receiver between refits, so that their liveness checks hold while the
session idles (for hours, if training needs it)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable

from refit.errors import PeerError
from refit.protocol.wire import Channel, Header, Kind

HEARTBEAT_MAX_S = 5.0
"""Longest gap between heartbeats to idle receivers (shorter when REFIT_TIMEOUT is short)."""
UNREAD_LIMIT = 4096
"""A receiver that has not read this many queued bytes is not waiting: skip its heartbeats, never block."""


class Pulse:
    """Heartbeats to every receiver between refits, from a thread that holds no reference to the Sender
    (so an unclosed Sender can still be collected). A refit holds `lock`; heartbeats never interleave with it."""

    def __init__(
        self, channels: list[Channel], interval_s: float, waiting: Callable[[], list[Channel]] | None = None
    ) -> None:
        self.channels = channels
        self.waiting = waiting
        """Elastic: the joiners welcomed but not yet in a refit, which must not time out either."""
        self.lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(interval_s,), name="refit-heartbeat", daemon=True)
        self._thread.start()

    def _run(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            if not self.lock.acquire(blocking=False):
                continue
            try:
                for ch in self.channels + (self.waiting() if self.waiting else []):
                    if ch.unsent_bytes() < UNREAD_LIMIT:
                        with contextlib.suppress(PeerError):  # the next refit reports the dead peer with its stage
                            ch.send(Header(Kind.HEARTBEAT))
            finally:
                self.lock.release()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join()
