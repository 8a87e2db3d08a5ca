"""Lobby: the sender's listening socket, which admits receivers that prove they know the token and nothing else.

Every connection is read at once, side by side, without blocking the others: HELLO (protocol version
and nonce) is answered with AUTH (the sender's nonce and proof, refit.protocol.auth), and AUTH's answer
must carry the receiver's proof. At most a 64-byte header plus `MAX_HELLO_BYTES` is read per step
before the proof is checked, and both steps must arrive within a short deadline. A slow, silent or
hostile connection is dropped on its own and never delays, or is blamed on, the real receivers: whatever
a stranger sends ends its own connection and nothing else. Wrong proofs, other protocol versions and late
arrivals are answered with ERROR, and said at WARNING (a few a minute, the rest counted). The token never
crosses the wire.
"""

from __future__ import annotations

import errno
import json
import math
import resource
import selectors
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from refit.errors import IntegrityError, PeerError
from refit.log import get_logger
from refit.protocol import auth
from refit.protocol.wire import HEADER, MAX_HELLO_BYTES, Channel, Header, Kind, parse_json

HELLO_TIMEOUT_S = 10.0
"""How long a new connection has to deliver its whole HELLO."""
STARVED_PAUSE_S = 0.1
"""How long the listener rests after accept() found no descriptor or memory for a new socket. The connection
stays queued and the listener stays readable, so without a rest the accept loop would spin a core."""
WRONG_TOKEN = "wrong token: this sender expects another REFIT_TOKEN; pass the token from Sender.rendezvous()"  # noqa: S105 - a message
WRONG_PROOF = "its proof of the token is wrong; check REFIT_TOKEN on both sides (or a stranger is dialing this port)"
WARNINGS_PER_MINUTE = 5
"""Refused or dropped connections said at WARNING per minute; the rest are counted in the next line said."""


class _Refused(Exception):
    """A well-formed step this lobby says no to (another protocol version, a wrong proof): answered with ERROR.
    `reason` is what the trainer's log says, when it differs from the answer."""

    def __init__(self, answer: str, reason: str = "") -> None:
        super().__init__(answer)
        self.reason = reason or answer


@dataclass(slots=True)
class _Throttle:
    """Lets `burst` records through per `window_s`; counts the rest, for the next record let through to say."""

    burst: int = WARNINGS_PER_MINUTE
    window_s: float = 60.0
    _start: float = -math.inf
    _let: int = 0
    _held: int = 0

    def allow(self) -> int | None:
        """None while this window's burst is spent; else how many were held back since the last one let through."""
        now = time.monotonic()
        if now - self._start >= self.window_s:
            self._start, self._let = now, 0
        if self._let >= self.burst:
            self._held += 1
            return None
        self._let += 1
        held, self._held = self._held, 0
        return held


log = get_logger("sender")


@dataclass(slots=True)
class _Pending:
    sock: socket.socket
    addr: str
    deadline: float
    data: bytearray = field(default_factory=bytearray)
    hello: dict | None = None
    """The HELLO, once read and answered with AUTH; the next message is the receiver's proof."""
    nonces: tuple[bytes, bytes] = (b"", b"")
    """(receiver's, sender's) once HELLO was answered."""

    def need(self) -> int:
        """Bytes still missing from this step's message (header first, then its payload, checked against the cap)."""
        if len(self.data) < HEADER.size:
            return HEADER.size - len(self.data)
        kind = Kind.HELLO if self.hello is None else Kind.AUTH
        return HEADER.size + _small_header(bytes(self.data[: HEADER.size]), kind).nbytes - len(self.data)


@dataclass(slots=True)
class Arrival:
    """A connection that proved it knows the token; `key` is its session key."""

    sock: socket.socket
    addr: str
    hello: dict
    key: bytes


class Lobby:
    """Listens on (host, port); `admit` returns receivers with the right token, `refuse_late` answers the rest."""

    def __init__(
        self, host: str, port: int, token: str, *, backlog: int = 64, hello_timeout_s: float = HELLO_TIMEOUT_S
    ) -> None:
        self._listener = socket.create_server((host, port), backlog=backlog)
        self._listener.setblocking(False)
        self._token = token
        self.hello_timeout_s = hello_timeout_s
        self.refused = 0
        """Connections refused so far (wrong token, malformed or silent)."""
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._starved = False
        """accept() last failed for lack of descriptors or memory (warned once until an accept succeeds)."""
        self._throttle = _Throttle()
        self.failure = ""
        """Why `serve_late`'s thread stopped serving on its own ('' while it serves, or was closed)."""
        self._cancelled = ""
        """Why `cancel` ended a waiting `admit` ('' while it was not)."""
        self._pending: dict[int, _Pending] = {}
        """Handshakes under way, kept from `admit` to the serving that follows it (a peer that connected
        while the last receiver was being admitted still gets its answer), closed at `close`."""

    def address(self) -> tuple[str, int]:
        host, port = self._listener.getsockname()[:2]
        return host, port

    def admit(self, count: int, timeout_s: float) -> list[Arrival]:
        """Wait up to `timeout_s` for `count` connections with the right token, in arrival order."""
        admitted: list[Arrival] = []
        self._serve(lambda a: admitted.append(a) or len(admitted) >= count, time.monotonic() + timeout_s)
        if len(admitted) < count:
            for a in admitted:
                a.sock.close()
            if self._cancelled:
                raise PeerError(self._cancelled)
            refused = (
                f"; {self.refused} other connection(s) were refused (wrong token or malformed)" if self.refused else ""
            )
            host, port = self.address()
            raise PeerError(
                f"only {len(admitted)} of {count} receiver(s) connected within {timeout_s:g}s{refused}; "
                f"check each was given {host}:{port} and the token"
            )
        return admitted

    def cancel(self, reason: str) -> None:
        """From another thread: a waiting `admit` stops within its 0.2 s wake and raises PeerError(reason)
        (a receiver that will never come, e.g. its process died); the lobby admits no one after."""
        self._cancelled = reason
        self._stopping.set()

    def refuse_late(self, num_receivers: int) -> None:
        """From now on answer every connection at once with ERROR, in a background thread, until `close`."""
        message = f"this sender already has its {num_receivers} receiver(s); start another Sender"
        self.serve_late(lambda arrival: answer(arrival.sock, message))

    def serve_late(
        self, on_arrival: Callable[[Arrival], None], on_failure: Callable[[str], None] | None = None
    ) -> None:
        """From now on hand every connection that proves the token to `on_arrival` (an elastic sender's
        joiners), in a background thread, until `close`; the rest are refused as during `admit`. Should the
        thread stop on its own, `failure` says why and `on_failure` is told."""

        def late(arrival: Arrival) -> bool:
            try:
                on_arrival(arrival)
            except Exception as e:  # noqa: BLE001 - one arrival's failure must not close the door on every later one
                log.error("could not take in the receiver from %s: %s: %s", arrival.addr, type(e).__name__, e)
                arrival.sock.close()
            return False

        self._thread = threading.Thread(
            target=self._serve_late, args=(late, on_failure), name="refit-lobby", daemon=True
        )
        self._thread.start()

    def _serve_late(self, on_arrival: Callable[[Arrival], bool], on_failure: Callable[[str], None] | None) -> None:
        """`serve_late`'s thread: waits out a shortage of descriptors (or memory) for its selector; keeps any
        other failure in `failure` rather than end in silence."""
        try:
            while not self._stopping.is_set():
                try:
                    self._serve(on_arrival, None)
                    return
                except OSError as e:
                    if (shortage := _shortage(e)) is None:
                        raise
                    self._starve(shortage)
                    self._stopping.wait(STARVED_PAUSE_S)
        except Exception as e:  # noqa: BLE001 - kept for the Sender to raise: a thread's exception reaches no one
            self.failure = f"{type(e).__name__}: {e}"
            log.error("the lobby stopped admitting receivers: %s", self.failure)
            if on_failure is not None:
                on_failure(self.failure)

    def _serve(self, on_arrival, deadline: float | None) -> None:  # type: ignore[no-untyped-def]
        """Accept and read HELLOs until `on_arrival` returns True, the deadline passes or the lobby closes."""
        pending = self._pending
        resting_until: float | None = None  # the listener rests after a starved accept(); handshakes go on
        with selectors.DefaultSelector() as sel:
            sel.register(self._listener, selectors.EVENT_READ)
            for p in pending.values():
                sel.register(p.sock, selectors.EVENT_READ)
            try:
                while not self._stopping.is_set():
                    now = time.monotonic()
                    if deadline is not None and now >= deadline:
                        return
                    if resting_until is not None and now >= resting_until:
                        sel.register(self._listener, selectors.EVENT_READ)
                        resting_until = None
                    for fd in [fd for fd, p in pending.items() if p.deadline <= now]:
                        self._drop(sel, pending.pop(fd), "sent no complete HELLO in time")
                    wakes = [t for t in (deadline, resting_until) if t is not None]
                    wake = min([p.deadline for p in pending.values()] + wakes + [now + 0.2])
                    for key, _ in sel.select(max(0.0, wake - now)):
                        if key.fileobj is self._listener:
                            if not self._accept(sel, pending):
                                sel.unregister(self._listener)
                                resting_until = time.monotonic() + STARVED_PAUSE_S
                        elif (arrival := self._read(sel, pending, key.fd)) is not None and on_arrival(arrival):
                            return
            finally:
                if self._stopping.is_set():
                    self._close_pending()

    def _accept(self, sel: selectors.BaseSelector, pending: dict[int, _Pending]) -> bool:
        """Take one queued connection; False when this process has no descriptor or memory for it (the
        connection stays queued: the caller rests the listener and tries again)."""
        try:
            sock, addr = self._listener.accept()
        except BlockingIOError:
            return True
        except OSError as e:
            if (shortage := _shortage(e)) is None:
                return True  # that connection is gone (reset before we took it); the queue moves on
            self._starve(shortage)
            return False
        if self._starved:
            log.info("accepting connections again")
            self._starved = False
        sock.setblocking(False)
        pending[sock.fileno()] = _Pending(sock, f"{addr[0]}:{addr[1]}", time.monotonic() + self.hello_timeout_s)
        sel.register(sock, selectors.EVENT_READ)
        return True

    def _starve(self, shortage: str) -> None:
        """Say once, until the lobby accepts again, that it cannot accept for want of `shortage`."""
        if not self._starved:
            log.warning(
                "cannot accept connections: %s; new receivers wait until one is free, retrying every %gs",
                shortage,
                STARVED_PAUSE_S,
            )
        self._starved = True

    def _read(self, sel: selectors.BaseSelector, pending: dict[int, _Pending], fd: int) -> Arrival | None:
        p = pending[fd]
        try:
            chunk = p.sock.recv(p.need())
            if not chunk:
                raise ConnectionResetError("closed")
            p.data += chunk
            if p.need() > 0:
                return None
            if p.hello is None:
                self._challenge(p)
                return None
            key = self._check_proof(p)
        except BlockingIOError:
            return None
        except _Refused as e:
            del pending[fd]
            sel.unregister(p.sock)
            self.refused += 1
            self._warn("refused", p.addr, e.reason)
            answer(p.sock, str(e))
            return None
        except (OSError, IntegrityError) as e:
            del pending[fd]
            self._drop(sel, p, str(e))
            return None
        except Exception as e:  # noqa: BLE001 - nothing a stranger sends may end the lobby: it ends its connection
            del pending[fd]
            self._drop(sel, p, f"malformed input ({type(e).__name__}: {e})")
            return None
        del pending[fd]
        sel.unregister(p.sock)
        p.sock.setblocking(True)
        assert p.hello is not None
        return Arrival(p.sock, p.addr, p.hello, key)

    def _challenge(self, p: _Pending) -> None:
        """HELLO read: check its protocol version, answer with this sender's nonce and proof."""
        hello = _parse_step(bytes(p.data), Kind.HELLO)
        theirs = hello.get("protocol")
        if theirs != auth.PROTOCOL_VERSION:
            named = "1 (it sent no version)" if theirs is None else repr(theirs)[:40]
            raise _Refused(
                f"protocol version mismatch: the receiver speaks {named}, this sender speaks "
                f"{auth.PROTOCOL_VERSION}; install the same refit version on the trainer and engine hosts"
            )
        receiver_nonce = auth.parse_nonce(hello.get("nonce"))
        if receiver_nonce is None:
            raise IntegrityError("HELLO carries no valid nonce")
        sender_nonce = auth.nonce()
        msg = {
            "protocol": auth.PROTOCOL_VERSION,
            "nonce": sender_nonce.hex(),
            "proof": auth.proof(self._token, auth.SENDER, receiver_nonce, sender_nonce),
        }
        data = json.dumps(msg).encode()
        out = Header(Kind.AUTH, nbytes=len(data)).pack() + data
        if p.sock.send(out) != len(out):  # a fresh socket's buffer takes a few hundred bytes at once
            raise ConnectionResetError("could not send AUTH")
        p.hello, p.nonces, p.data = hello, (receiver_nonce, sender_nonce), bytearray()

    def _check_proof(self, p: _Pending) -> bytes:
        """The receiver's AUTH read: its proof of the token, or _Refused."""
        reply = _parse_step(bytes(p.data), Kind.AUTH)
        receiver_nonce, sender_nonce = p.nonces
        if not auth.verify(self._token, auth.RECEIVER, receiver_nonce, sender_nonce, reply.get("proof")):
            raise _Refused(WRONG_TOKEN, WRONG_PROOF)
        return auth.session_key(self._token, receiver_nonce, sender_nonce)

    def _drop(self, sel: selectors.BaseSelector, p: _Pending, why: str) -> None:
        self.refused += 1
        self._warn("dropped", p.addr, why)
        sel.unregister(p.sock)
        p.sock.close()

    def _warn(self, did: str, addr: str, why: str) -> None:
        """Say at WARNING that a connection was refused or dropped, and why, unless a flood spent this minute."""
        held = self._throttle.allow()
        if held is None:
            log.debug("%s a connection from %s: %s", did, addr, why)
            return
        more = f" ({held} more refused or dropped before this were not logged)" if held else ""
        log.warning("%s a connection from %s: %s%s", did, addr, why[:300], more)

    def close(self) -> None:
        """Stop answering and close the listening socket; safe to call twice."""
        self._stopping.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        self._thread = None
        self._close_pending()
        self._listener.close()

    def _close_pending(self) -> None:
        for p in self._pending.values():
            p.sock.close()
        self._pending.clear()


def _shortage(e: OSError) -> str | None:
    """What ran out, and the fix, when accept() failed for want of a resource; None for any other failure."""
    if e.errno == errno.EMFILE:
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        return (
            f"this process has used its {soft} file descriptors (RLIMIT_NOFILE); raise the open-file limit "
            f"(`ulimit -n`) before starting the trainer, or close descriptors it leaks"
        )
    if e.errno == errno.ENFILE:
        return "the system's open-file table is full; raise fs.file-max (sysctl) or close other processes' files"
    if e.errno in (errno.ENOBUFS, errno.ENOMEM):
        return f"the kernel has no memory for another socket ({e.strerror}); free memory on this host"
    return None


def _small_header(data: bytes, kind: Kind) -> Header:
    header = Header.unpack(data)
    if header.kind == Kind.ERROR and kind == Kind.AUTH:
        raise IntegrityError("the peer refused this sender's proof (a wrong token on its side?)")
    if header.kind != kind:
        raise IntegrityError(f"expected {kind.name} before authentication, got {header.kind.name}")
    if header.nbytes > MAX_HELLO_BYTES:
        raise IntegrityError(
            f"{kind.name} of {header.nbytes} bytes is over the {MAX_HELLO_BYTES} allowed before authentication"
        )
    return header


def _parse_step(data: bytes, kind: Kind) -> dict:
    _small_header(data[: HEADER.size], kind)
    return parse_json(data[HEADER.size :], kind.name, max_bytes=MAX_HELLO_BYTES)


def _parse_hello(data: bytes) -> dict:
    return _parse_step(data, Kind.HELLO)


def read_auth(ch: Channel, stage: str) -> dict:
    """A dialer's read of the listener's AUTH, before the listener proved the token: anything malformed is a
    PeerError saying the peer does not speak refit's protocol (an ERROR from it is a PeerFailed, as ever)."""
    try:
        header, payload = ch.recv(stage, max_payload=MAX_HELLO_BYTES)
        if header.kind != Kind.AUTH:
            raise PeerError(f"{ch.peer} sent {header.kind.name} during authentication, expected AUTH")
        return parse_json(payload, "AUTH", max_bytes=MAX_HELLO_BYTES)
    except IntegrityError as e:
        raise PeerError(
            f"{ch.peer} does not speak refit's protocol: {e}; check that the address is a refit sender's"
        ) from None


def answer(sock: socket.socket, message: str) -> None:
    """Tell a refused peer why, without letting it hold us up, then close."""
    ch = Channel(sock, peer="refused peer", timeout_s=2.0)
    try:
        ch.send(Header(Kind.ERROR), {"message": message})
    except PeerError:
        pass
    finally:
        ch.close()
