"""Membership: an elastic Sender's joiners and departures.

A receiver that proves the token after `connect` (the lobby's background thread hands it over) gets a
fresh rank. Over shm and cuda-ipc, whose setup is fixed for the session, it is welcomed at once; over
gloo and nccl the Sender welcomes it into the next group it forms (it waits, with heartbeats). It takes
part from the next refit on: that refit sends it the current manifest (alone, or with everyone in a new
group's epoch) and then streams to it with the others; until then its engine is empty, and an engine
that never committed is not current. A receiver that says LEAVE, closes, dies or stops answering is
dropped, with who and why kept for the refit's stats and said once at WARNING.
"""

from __future__ import annotations

import contextlib
import json
import select
import threading
import time
from collections.abc import Callable

from refit.errors import IntegrityError, PeerError, RefitError
from refit.log import get_logger
from refit.protocol import auth
from refit.protocol.lobby import Arrival, answer
from refit.protocol.wire import Channel, Header, Kind, Left

log = get_logger("sender")
MAX_WAITING = 64
"""Most joiners welcomed but not yet in a refit; later ones are refused until a refit takes them in."""


class Membership:
    """Who joins at the next refit (`waiting`), and who left since the last one (`departed`)."""

    def __init__(
        self, *, capacity: int, transport: str, info: dict | None, heartbeat_s: float, timeout_s: float
    ) -> None:
        """`info`: the transport setup every joiner gets in its WELCOME at once; None for a group transport,
        whose joiners are welcomed by the Sender when it forms the next group (they wait, with heartbeats)."""
        self.capacity = capacity
        self.info = info
        self._welcome = {"capacity": capacity, "transport": transport, "heartbeat_s": heartbeat_s, "elastic": True}
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._arrived = threading.Condition(self._lock)
        self._waiting: list[Channel] = []
        self._next_rank = 0
        self.departed: list[dict] = []
        """{"receiver": rank, "reason": why} for each receiver dropped since the last refit's stats took them."""
        self.stated: dict[int, bytes] = {}
        """What each joiner sent with READY (M:N shard statements), by its rank, until the Sender vets it."""
        self.failure = ""
        """Why the lobby stopped admitting joiners ('' while it admits them)."""

    def start(self, first_rank: int) -> None:
        self._next_rank = first_rank

    def arrive(self, arrival: Arrival) -> None:
        """Lobby thread: welcome a receiver that proved the token (or refuse it, saying why)."""
        limit = arrival.hello.get("capacity")
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < self.capacity:
            answer(
                arrival.sock,
                f"this session's buckets are {self.capacity} bytes and this receiver allows {limit!r:.40}; "
                "raise its REFIT_BUCKET_BYTES (or free memory), or start the Sender with smaller buckets",
            )
            return
        with self._lock:
            full = len(self._waiting) >= MAX_WAITING
            if not full:
                self._next_rank += 1
                rank = self._next_rank
        if full:
            answer(arrival.sock, f"{MAX_WAITING} receivers are already waiting to join; try again after a refit")
            return
        ch = Channel(arrival.sock, peer=f"receiver {rank} ({arrival.addr})", timeout_s=self._timeout_s)
        ch.key, ch.rank = arrival.key, rank
        try:
            if self.info is not None:
                self.welcome(ch, Kind.WELCOME, self.info)
        except PeerError as e:
            log.warning("a joining receiver %d went away before its WELCOME: %s", rank, e)
            ch.close()
            return
        with self._lock:
            self._waiting.append(ch)
            self._arrived.notify_all()
        log.info("receiver %d joined (%s); it takes part from the next refit", rank, arrival.addr)

    def fail(self, reason: str) -> None:
        """Lobby thread: it stopped admitting joiners, for `reason`; a wait for joiners ends at once."""
        with self._lock:
            self.failure = reason
            self._arrived.notify_all()

    def check(self) -> None:
        """RefitError when no engine can join any more (the lobby stopped admitting), naming why."""
        if self.failure:
            raise RefitError(
                f"this elastic Sender's lobby stopped admitting engines ({self.failure}); no engine can join "
                "the session any more: close() this Sender and start a new one"
            )

    def welcome(self, ch: Channel, kind: Kind, info: dict) -> None:
        """WELCOME (or REGROUP) with the transport setup `info`, bound to `ch`'s session by its MAC."""
        data = json.dumps({**self._welcome, "rank": ch.rank, "info": info}).encode()
        ch.send(Header(kind, digest=auth.tag(ch.key, kind.name.encode(), data)), data)

    def waiting(self) -> list[Channel]:
        """Joiners welcomed but not yet in a refit (they get heartbeats meanwhile)."""
        with self._lock:
            return list(self._waiting)

    def await_ready(self, count: int, timeout_s: float) -> int:
        """Wait until `count` joiners are ready to take the next refit (their READY arrived), at most
        `timeout_s`; returns how many are. RefitError once the lobby stopped admitting them (`check`)."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                left = max(0.0, deadline - time.monotonic())
                self._arrived.wait_for(lambda: len(self._waiting) >= count or bool(self.failure), left)
                waiting = list(self._waiting)
            self.check()
            waiting = self._alive(waiting)
            unready = [ch for ch in waiting if not self._ready(ch)]
            ready = len(waiting) - len(unready)
            remaining = deadline - time.monotonic()
            if ready >= count or remaining <= 0:
                return ready
            # wake when a welcomed joiner's READY arrives, or (at the latest) to look at new arrivals
            select.select([ch.sock for ch in unready], [], [], min(remaining, 0.5) if unready else 0)

    def _alive(self, waiting: list[Channel]) -> list[Channel]:
        """The joiners whose connection is still open; one that hung up (after its READY, say) is dropped now,
        so that it is not counted as ready for the next refit."""
        alive = []
        for ch in waiting:
            if not hung_up(ch):
                alive.append(ch)
                continue
            with self._lock:
                if ch in self._waiting:
                    self._waiting.remove(ch)
            self.drop(ch, PeerError(f"{ch.peer} closed the connection before its first refit"))
        return alive

    def take_ready(self) -> list[Channel]:
        """Refit start: the joiners whose READY arrived (read now); one not ready yet stays for a later refit
        rather than delay this one, and one that failed to join is dropped."""
        with self._lock:
            candidates = list(self._waiting)
        ready = []
        for ch in candidates:
            if not self._ready(ch):
                continue
            with self._lock:
                self._waiting.remove(ch)
            try:
                if self.info is not None:
                    self.stated[ch.rank] = ch.expect(Kind.READY, "joining the session")[1]
                elif readable(ch):  # waiting for its WELCOME, it has nothing to say: it closed, or broke the protocol
                    header, _ = ch.recv("joining the session")
                    raise PeerError(f"{ch.peer} sent {header.kind.name} before its WELCOME")
            except (PeerError, IntegrityError) as e:
                self.drop(ch, e)
                continue
            ready.append(ch)
        return ready

    def _ready(self, ch: Channel) -> bool:
        """A joiner can take the next refit: its READY arrived, or (group transport) it is welcomed then."""
        return self.info is None or readable(ch)

    def sweep(self, channels: list[Channel], lost: Callable[[Channel, Exception], None]) -> None:
        """Between refits: each receiver that said LEAVE, closed or sent anything at all (nothing arrives
        unasked) goes to `lost`."""
        for ch in [c for c in channels if readable(c)]:
            try:
                header, _ = ch.recv("the wait between refits")
                raise PeerError(f"{ch.peer} sent {header.kind.name} between refits")
            except (PeerError, IntegrityError) as e:
                lost(ch, e)

    def drop(self, ch: Channel, error: Exception) -> None:
        """Close `ch` and record why it left (LEAVE's reason, else the error), said once at WARNING."""
        reason = error.reason if isinstance(error, Left) else str(error)
        ch.close()
        self.departed.append({"receiver": ch.rank, "reason": reason})
        log.warning("receiver %d departed and was dropped from the session: %s", ch.rank, reason)

    def take_departed(self) -> list[dict]:
        out, self.departed = self.departed, []
        return out

    def close(self) -> None:
        with self._lock:
            waiting, self._waiting = self._waiting, []
        for ch in waiting:
            with contextlib.suppress(PeerError):
                ch.send(Header(Kind.CLOSE))
            ch.close()


def hung_up(ch: Channel) -> bool:
    """Whether the peer closed its end of `ch` (or it broke), even with bytes it sent still unread."""
    try:
        poller = select.poll()
        poller.register(ch.sock, select.POLLRDHUP)
        return any(ev & (select.POLLRDHUP | select.POLLHUP | select.POLLERR) for _, ev in poller.poll(0))
    except (OSError, ValueError):
        return True


def readable(ch: Channel) -> bool:
    """Whether `ch` has bytes (or its end) to read now, without waiting. poll, not select: select refuses
    descriptors from 1024 on, which a process with many files open (an inference engine) hands out."""
    try:
        poller = select.poll()
        poller.register(ch.sock, select.POLLIN)
        return bool(poller.poll(0))
    except (OSError, ValueError):
        return True  # a closed socket: reading it says so
