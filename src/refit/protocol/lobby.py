"""Lobby: the sender's listening socket, which admits receivers that present the token and nothing else.

Every connection is read at once, side by side, without blocking the others: at most a 64-byte
header plus `MAX_HELLO_BYTES` of HELLO is read before the token is checked, and the whole HELLO must
arrive within a short deadline. A slow, silent or hostile connection is dropped on its own and never
delays, or is blamed on, the real receivers. Wrong tokens and late arrivals are answered with ERROR.
"""

from __future__ import annotations

import hmac
import selectors
import socket
import threading
import time
from dataclasses import dataclass, field

from refit.errors import IntegrityError, PeerError
from refit.log import get_logger
from refit.protocol.wire import HEADER, MAX_HELLO_BYTES, Channel, Header, Kind, parse_json

HELLO_TIMEOUT_S = 10.0
"""How long a new connection has to deliver its whole HELLO."""
WRONG_TOKEN = "wrong token: this sender expects another REFIT_TOKEN; pass the token from Sender.rendezvous()"  # noqa: S105 - a message

log = get_logger("sender")


@dataclass(slots=True)
class _Pending:
    sock: socket.socket
    addr: str
    deadline: float
    data: bytearray = field(default_factory=bytearray)

    def need(self) -> int:
        """Bytes still missing from the HELLO (header first, then its declared payload, checked against the cap)."""
        if len(self.data) < HEADER.size:
            return HEADER.size - len(self.data)
        return HEADER.size + _hello_header(bytes(self.data[: HEADER.size])).nbytes - len(self.data)


@dataclass(slots=True)
class Arrival:
    """A connection that presented a valid HELLO with the right token."""

    sock: socket.socket
    addr: str
    hello: dict


class Lobby:
    """Listens on (host, port); `admit` returns receivers with the right token, `refuse_late` answers the rest."""

    def __init__(
        self, host: str, port: int, token: str, *, backlog: int = 64, hello_timeout_s: float = HELLO_TIMEOUT_S
    ) -> None:
        self._listener = socket.create_server((host, port), backlog=backlog)
        self._listener.setblocking(False)
        self._token = token.encode()
        self.hello_timeout_s = hello_timeout_s
        self.refused = 0
        """Connections refused so far (wrong token, malformed or silent)."""
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

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
            refused = (
                f"; {self.refused} other connection(s) were refused (wrong token or malformed)" if self.refused else ""
            )
            host, port = self.address()
            raise PeerError(
                f"only {len(admitted)} of {count} receiver(s) connected within {timeout_s:g}s{refused}; "
                f"check each was given {host}:{port} and the token"
            )
        return admitted

    def refuse_late(self, num_receivers: int) -> None:
        """From now on answer every connection at once with ERROR, in a background thread, until `close`."""
        message = f"this sender already has its {num_receivers} receiver(s); start another Sender"

        def late(arrival: Arrival) -> bool:
            _answer(arrival.sock, message)
            return False

        self._thread = threading.Thread(target=self._serve, args=(late, None), name="refit-lobby", daemon=True)
        self._thread.start()

    def _serve(self, on_arrival, deadline: float | None) -> None:  # type: ignore[no-untyped-def]
        """Accept and read HELLOs until `on_arrival` returns True, the deadline passes or the lobby closes."""
        pending: dict[int, _Pending] = {}
        with selectors.DefaultSelector() as sel:
            sel.register(self._listener, selectors.EVENT_READ)
            try:
                while not self._stopping.is_set():
                    now = time.monotonic()
                    if deadline is not None and now >= deadline:
                        return
                    for fd in [fd for fd, p in pending.items() if p.deadline <= now]:
                        self._drop(sel, pending.pop(fd), "sent no complete HELLO in time")
                    wake = min([p.deadline for p in pending.values()] + ([deadline] if deadline else []) + [now + 0.2])
                    for key, _ in sel.select(max(0.0, wake - now)):
                        if key.fileobj is self._listener:
                            self._accept(sel, pending)
                        elif (arrival := self._read(sel, pending, key.fd)) is not None and on_arrival(arrival):
                            return
            finally:
                for p in pending.values():
                    p.sock.close()

    def _accept(self, sel: selectors.BaseSelector, pending: dict[int, _Pending]) -> None:
        try:
            sock, addr = self._listener.accept()
        except (BlockingIOError, OSError):
            return
        sock.setblocking(False)
        pending[sock.fileno()] = _Pending(sock, f"{addr[0]}:{addr[1]}", time.monotonic() + self.hello_timeout_s)
        sel.register(sock, selectors.EVENT_READ)

    def _read(self, sel: selectors.BaseSelector, pending: dict[int, _Pending], fd: int) -> Arrival | None:
        p = pending[fd]
        try:
            need = p.need()
            chunk = p.sock.recv(need)
            if not chunk:
                raise ConnectionResetError("closed")
            p.data += chunk
            if p.need() > 0:
                return None
            hello = _parse_hello(bytes(p.data))
        except BlockingIOError:
            return None
        except (OSError, IntegrityError) as e:
            del pending[fd]
            self._drop(sel, p, str(e))
            return None
        del pending[fd]
        sel.unregister(p.sock)
        if not hmac.compare_digest(str(hello.get("token", "")).encode(), self._token):
            self.refused += 1
            log.warning("refused a connection from %s: wrong token", p.addr)
            _answer(p.sock, WRONG_TOKEN)
            return None
        p.sock.setblocking(True)
        return Arrival(p.sock, p.addr, hello)

    def _drop(self, sel: selectors.BaseSelector, p: _Pending, why: str) -> None:
        self.refused += 1
        log.warning("dropped a connection from %s: %s", p.addr, why)
        sel.unregister(p.sock)
        p.sock.close()

    def close(self) -> None:
        """Stop answering and close the listening socket; safe to call twice."""
        self._stopping.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        self._thread = None
        self._listener.close()


def _hello_header(data: bytes) -> Header:
    header = Header.unpack(data)
    if header.kind != Kind.HELLO:
        raise IntegrityError(f"first message is {header.kind.name}, not HELLO")
    if header.nbytes > MAX_HELLO_BYTES:
        raise IntegrityError(f"HELLO of {header.nbytes} bytes is over the {MAX_HELLO_BYTES} allowed before the token")
    return header


def _parse_hello(data: bytes) -> dict:
    _hello_header(data[: HEADER.size])
    return parse_json(data[HEADER.size :], "HELLO", max_bytes=MAX_HELLO_BYTES)


def _answer(sock: socket.socket, message: str) -> None:
    """Tell a refused peer why, without letting it hold us up, then close."""
    ch = Channel(sock, peer="refused peer", timeout_s=2.0)
    try:
        ch.send(Header(Kind.ERROR), {"message": message})
    except PeerError:
        pass
    finally:
        ch.close()
