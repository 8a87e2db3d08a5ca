"""Store: the gloo/nccl group's rendezvous key-value store, served only to peers that prove the token.

The table lives in the Sender's process. Rank 0 uses it in place; each receiver reaches it over one TCP
connection that first runs the lobby's challenge-response (refit.protocol.lobby, refit.protocol.auth):
a stranger gets one AUTH and an ERROR, never a key or a value. After that, every frame either way
carries a MAC under the connection's session key and a per-direction sequence number, so a frame
from anyone else, or one replayed or reordered, ends the connection. No key carries the token, and the
token never crosses the wire. The frame format is in docs/PROTOCOL.md (Group store).
"""

from __future__ import annotations

import contextlib
import datetime
import hmac
import socket
import struct
import threading
import time
from enum import IntEnum

import torch.distributed as dist

from refit.errors import IntegrityError, PeerError
from refit.log import get_logger
from refit.protocol import auth
from refit.protocol.lobby import Arrival, Lobby, read_auth
from refit.protocol.wire import Channel, Header, Kind
from refit.settings import Settings

log = get_logger("store")

MAGIC = b"RFS1"
FRAME = struct.Struct("<4sBBHII16s")
"""magic, op, status (0 ok, 1 error), reserved, timeout in ms, body length, MAC of the frame."""
MAX_BODY_BYTES = 1 << 20
"""Largest frame body accepted (gloo's and NCCL's keys and values are a few hundred bytes)."""
MAX_FIELDS = 1024
MAX_TABLE_BYTES = 64 << 20
"""Largest total size of the keys and values one store holds."""
MAX_WAIT_S = 3600.0
REQUEST, REPLY = b"store-request", b"store-reply"


class Op(IntEnum):
    SET = 1
    GET = 2
    ADD = 3
    CHECK = 4
    WAIT = 5
    DELETE = 6
    NUM_KEYS = 7
    COMPARE_SET = 8
    APPEND = 9


class _Table:
    """Keys and values, with waits for keys that are not there yet."""

    def __init__(self) -> None:
        self._data: dict[bytes, bytes] = {}
        self._bytes = 0
        self._changed = threading.Condition()
        self.closed = False

    def _put(self, key: bytes, value: bytes) -> None:
        old = self._data.get(key)
        grown = self._bytes + len(value) - (len(old) if old is not None else -len(key))
        if grown > MAX_TABLE_BYTES:
            raise ValueError(f"the group store would hold {grown} bytes, over its {MAX_TABLE_BYTES} limit")
        self._data[key], self._bytes = value, grown
        self._changed.notify_all()

    def _await(self, keys: list[bytes], timeout_s: float) -> None:
        deadline = time.monotonic() + min(timeout_s, MAX_WAIT_S)
        while not all(k in self._data for k in keys):
            if self.closed:
                raise PeerError("the group store was closed (the sender's session ended)")
            left = deadline - time.monotonic()
            if left <= 0:
                missing = [k.decode(errors="replace") for k in keys if k not in self._data]
                raise TimeoutError(f"keys {missing[:4]} not set within {timeout_s:g}s; did every rank start?")
            self._changed.wait(left)

    def execute(self, op: Op, fields: list[bytes], timeout_s: float) -> list[bytes]:
        """Run one command; ValueError for a malformed one, TimeoutError when a key did not come in time."""
        with self._changed:
            if op == Op.SET and len(fields) == 2:
                self._put(fields[0], fields[1])
                return []
            if op == Op.GET and len(fields) == 1:
                self._await(fields, timeout_s)
                return [self._data[fields[0]]]
            if op == Op.ADD and len(fields) == 2:
                total = int(self._data.get(fields[0], b"0")) + _int(fields[1])
                self._put(fields[0], str(total).encode())
                return [_bytes(total)]
            if op == Op.CHECK:
                return [_bytes(int(all(k in self._data for k in fields)))]
            if op == Op.WAIT:
                self._await(fields, timeout_s)
                return []
            if op == Op.DELETE and len(fields) == 1:
                found = self._data.pop(fields[0], None)
                self._bytes -= 0 if found is None else len(fields[0]) + len(found)
                return [_bytes(int(found is not None))]
            if op == Op.NUM_KEYS and not fields:
                return [_bytes(len(self._data))]
            if op == Op.COMPARE_SET and len(fields) == 3:
                key, expected, desired = fields
                if self._data.get(key, b"") == expected and (key in self._data or not expected):
                    self._put(key, desired)
                return [self._data.get(key, expected)]
            if op == Op.APPEND and len(fields) == 2:
                self._put(fields[0], self._data.get(fields[0], b"") + fields[1])
                return []
        raise ValueError(f"malformed store command {op.name} with {len(fields)} field(s)")

    def close(self) -> None:
        with self._changed:
            self.closed = True
            self._changed.notify_all()


def _bytes(n: int) -> bytes:
    return n.to_bytes(8, "little", signed=True)


def _int(data: bytes) -> int:
    if len(data) != 8:
        raise ValueError(f"a store integer is 8 bytes, got {len(data)}")
    return int.from_bytes(data, "little", signed=True)


def _encode_key(key: str | bytes) -> bytes:
    return key.encode() if isinstance(key, str) else bytes(key)


def _pack_fields(fields: list[bytes]) -> bytes:
    return b"".join(len(f).to_bytes(4, "little") + f for f in fields)


def _unpack_fields(body: bytes) -> list[bytes]:
    fields, at = [], 0
    while at < len(body):
        if len(fields) >= MAX_FIELDS or at + 4 > len(body):
            raise IntegrityError("a store frame's fields are malformed")
        n = int.from_bytes(body[at : at + 4], "little")
        if at + 4 + n > len(body):
            raise IntegrityError("a store frame's field runs past its body")
        fields.append(body[at + 4 : at + 4 + n])
        at += 4 + n
    return fields


class _Link:
    """One authenticated store connection: MACed frames, numbered in each direction."""

    def __init__(self, sock: socket.socket, key: bytes, *, sends: bytes, peer: str) -> None:
        self.sock, self._key, self.peer = sock, key, peer
        self._sends, self._reads = sends, REPLY if sends == REQUEST else REQUEST
        self._sent = self._read = 0

    def _tag(self, what: bytes, seq: int, head: bytes, body: bytes) -> bytes:
        return auth.tag(self._key, what, seq.to_bytes(8, "little") + head + body)

    def send(self, op: int, fields: list[bytes], *, status: int = 0, timeout_ms: int = 0) -> None:
        body = _pack_fields(fields)
        if len(body) > MAX_BODY_BYTES:
            raise ValueError(f"a store frame of {len(body)} bytes is over the {MAX_BODY_BYTES} allowed")
        head = FRAME.pack(MAGIC, op, status, 0, timeout_ms, len(body), bytes(16))[:-16]
        self.sock.sendall(head + self._tag(self._sends, self._sent, head, body) + body)
        self._sent += 1

    def recv(self) -> tuple[int, int, int, list[bytes]]:
        """(op, status, timeout in ms, fields) of the next frame, its MAC checked before its body is parsed."""
        raw = self._exactly(FRAME.size)
        magic, op, status, _, timeout_ms, nbytes, claimed = FRAME.unpack(raw)
        if magic != MAGIC:
            raise IntegrityError(f"{self.peer} sent {magic!r}, not a store frame (it refused this connection?)")
        if nbytes > MAX_BODY_BYTES:
            raise IntegrityError(f"a store frame of {nbytes} bytes is over the {MAX_BODY_BYTES} allowed")
        body = self._exactly(nbytes)
        if not hmac.compare_digest(self._tag(self._reads, self._read, raw[:-16], body), claimed):
            raise IntegrityError(f"a store frame from {self.peer} is not bound to this session (its MAC is wrong)")
        self._read += 1
        return op, status, timeout_ms, _unpack_fields(body)

    def _exactly(self, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = self.sock.recv(n - len(buf))
            if not chunk:
                raise PeerError(f"{self.peer} closed the store connection")
            buf += chunk
        return bytes(buf)

    def close(self) -> None:
        with contextlib.suppress(OSError):  # already closed, or never connected
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


class _View(dist.Store):
    """A torch.distributed.Store over this module's commands; gloo and NCCL call it from C++, from any thread."""

    def __init__(self, timeout_s: float) -> None:
        super().__init__()
        self.set_timeout(datetime.timedelta(seconds=timeout_s))

    def _call(self, op: Op, fields: list[bytes], wait_s: float = 0.0) -> list[bytes]:
        raise NotImplementedError

    def _wait_s(self, timeout: datetime.timedelta | None = None) -> float:
        return (timeout or self.timeout).total_seconds()

    def set(self, key: str, value: str | bytes) -> None:
        self._call(Op.SET, [_encode_key(key), _encode_key(value)])

    def get(self, key: str) -> bytes:
        return self._call(Op.GET, [_encode_key(key)], self._wait_s())[0]

    def add(self, key: str, amount: int) -> int:
        return _int(self._call(Op.ADD, [_encode_key(key), _bytes(amount)])[0])

    def check(self, keys: list[str]) -> bool:
        return bool(_int(self._call(Op.CHECK, [_encode_key(k) for k in keys])[0]))

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        self._call(Op.WAIT, [_encode_key(k) for k in keys], self._wait_s(timeout))

    def delete_key(self, key: str) -> bool:
        return bool(_int(self._call(Op.DELETE, [_encode_key(key)])[0]))

    def num_keys(self) -> int:
        return _int(self._call(Op.NUM_KEYS, [])[0])

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        return self._call(Op.COMPARE_SET, [_encode_key(key), _encode_key(expected), _encode_key(desired)])[0]

    def append(self, key: str, value: str | bytes) -> None:
        self._call(Op.APPEND, [_encode_key(key), _encode_key(value)])


class _LocalStore(_View):
    """Rank 0's view: the table in this process, no socket."""

    def __init__(self, table: _Table, timeout_s: float) -> None:
        super().__init__(timeout_s)
        self._table = table

    def clone(self) -> _LocalStore:
        return _LocalStore(self._table, self._wait_s())

    def _call(self, op: Op, fields: list[bytes], wait_s: float = 0.0) -> list[bytes]:
        try:
            return self._table.execute(op, fields, wait_s)
        except (ValueError, TimeoutError, PeerError) as e:
            raise dist.DistStoreError(f"refit group store: {e}") from None


class StoreServer:
    """The table and its port: admits `num_clients` connections that prove the token (then answers every
    later one with ERROR), and serves each admitted one from its own thread until `close`."""

    def __init__(self, host: str, token: str, *, num_clients: int, settings: Settings) -> None:
        self._table = _Table()
        self.store = _LocalStore(self._table, settings.timeout_s)
        self._lobby = Lobby(host, 0, token, backlog=num_clients + 8)
        self.port = self._lobby.address()[1]
        self._lock = threading.Lock()
        self._closed = False
        self._links: list[_Link] = []
        self._threads: list[threading.Thread] = []
        self._admitting = threading.Thread(
            target=self._admit, args=(num_clients, settings.connect_timeout_s), name="refit-store", daemon=True
        )
        self._admitting.start()

    @property
    def refused(self) -> int:
        """Connections refused so far (no proof of the token, malformed, silent or late)."""
        return self._lobby.refused

    def _admit(self, num_clients: int, timeout_s: float) -> None:
        """Serve each rank as soon as it is admitted: one that came need not wait for the rest, so rank 0 sees
        who reached the rendezvous while the group forms (an elastic sender drops a member that never does)."""
        deadline, served = time.monotonic() + timeout_s, 0
        try:
            while served < num_clients and self._serve_arrival(
                *self._lobby.admit(1, max(0.0, deadline - time.monotonic()))
            ):
                served += 1
        except (PeerError, OSError, ValueError) as e:  # closed meanwhile, or a rank never came
            if not self._closed:
                log.warning("the group store admitted %d of %d ranks: %s", served, num_clients, e)
        with self._lock:
            if not self._closed:
                self._lobby.refuse_late(num_clients)

    def _serve_arrival(self, arrival: Arrival) -> bool:
        with self._lock:
            if self._closed:
                arrival.sock.close()
                return False
            link = _Link(arrival.sock, arrival.key, sends=REPLY, peer=f"group store client {arrival.addr}")
            thread = threading.Thread(target=self._serve, args=(link,), name="refit-store-client", daemon=True)
            self._links.append(link)
            self._threads.append(thread)
            thread.start()
        return True

    def _serve(self, link: _Link) -> None:
        link.sock.settimeout(None)  # a rank may stay quiet for the whole session; close() wakes this thread
        try:
            while True:
                op, _, timeout_ms, fields = link.recv()
                try:
                    result = self._table.execute(Op(op), fields, timeout_ms / 1000)
                except (ValueError, TimeoutError, PeerError) as e:
                    link.send(op, [str(e).encode()], status=1)
                else:
                    link.send(op, result)
        except (PeerError, IntegrityError, OSError, ValueError) as e:  # ValueError: an answer over the frame limit
            if not self._closed:
                log.info("group store connection from %s ended: %s", link.peer, e)
        finally:
            link.close()

    def close(self) -> None:
        """Stop serving and close every connection; safe to call twice."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._table.close()
        self._lobby.close()
        for link in self._links:
            link.close()
        for thread in [self._admitting, *self._threads]:
            if thread is not threading.current_thread():
                thread.join()


def _authenticate(sock: socket.socket, token: str, peer: str, timeout_s: float) -> bytes:
    """The receiver's half of the lobby's challenge-response; the session key. Nothing is used from a
    server that does not prove the token first."""
    ch = Channel(sock, peer=peer, timeout_s=timeout_s)
    mine = auth.nonce()
    ch.send(Header(Kind.HELLO), {"protocol": auth.PROTOCOL_VERSION, "nonce": mine.hex()})
    msg = read_auth(ch, "group store authentication")
    theirs = auth.parse_nonce(msg.get("nonce"))
    if theirs is None or not auth.verify(token, auth.SENDER, mine, theirs, msg.get("proof")):
        raise PeerError(f"{peer} did not prove it knows the token; it is not this session's group store")
    ch.send(Header(Kind.AUTH), {"proof": auth.proof(token, auth.RECEIVER, mine, theirs)})
    return auth.session_key(token, mine, theirs)


class RemoteStore(_View):
    """A receiver's view: one authenticated connection to the sender's StoreServer, one command at a time."""

    def __init__(self, host: str, port: int, token: str, settings: Settings) -> None:
        super().__init__(settings.timeout_s)
        self._timeout_s = settings.timeout_s
        self._lock = threading.Lock()
        self._broken = ""
        peer = f"the sender's group store ({host}:{port})"
        try:
            sock = socket.create_connection((host, port), timeout=settings.timeout_s)
        except OSError as e:
            raise PeerError(f"cannot connect to {peer}: {e}") from None
        try:
            self._link = _Link(sock, _authenticate(sock, token, peer, settings.timeout_s), sends=REQUEST, peer=peer)
        except BaseException:
            sock.close()
            raise

    def _call(self, op: Op, fields: list[bytes], wait_s: float = 0.0) -> list[bytes]:
        with self._lock:
            if self._broken:
                raise dist.DistNetworkError(f"refit group store connection is broken: {self._broken}")
            try:
                # The server itself gives up on a key after wait_s; the socket waits for its answer on top.
                self._link.sock.settimeout(wait_s + self._timeout_s)
                self._link.send(op, fields, timeout_ms=int(min(wait_s, MAX_WAIT_S) * 1000))
                _, status, _, reply = self._link.recv()
            except (OSError, PeerError, IntegrityError) as e:
                self._broken = str(e) or type(e).__name__
                self._link.close()
                raise dist.DistNetworkError(f"refit group store ({self._link.peer}): {self._broken}") from None
        if status:
            raise dist.DistStoreError(f"refit group store: {(reply or [b'error'])[0].decode(errors='replace')}")
        return reply

    def clone(self) -> RemoteStore:
        """This same connection: the server admits one per rank, and commands already take turns on it."""
        return self

    def close(self) -> None:
        self._broken = self._broken or "closed"  # without the lock: this also wakes a command waiting on the server
        self._link.close()


class AuthenticatedStores:
    """What topology hands a gloo/nccl transport (refit.transports.base.StoreProvider): the group's store,
    served or reached only with the token. `close` releases everything it made."""

    def __init__(self, token: str, settings: Settings) -> None:
        self._token, self._settings = token, settings
        self._closers: list = []

    def serve(self, host: str, num_clients: int) -> tuple[dist.Store, int]:
        server = StoreServer(host, self._token, num_clients=num_clients, settings=self._settings)
        self._closers.append(server.close)
        return server.store, server.port

    def connect(self, host: str, port: int) -> dist.Store:
        store = RemoteStore(host, port, self._token, self._settings)
        self._closers.append(store.close)
        return store

    def close(self) -> None:
        while self._closers:
            self._closers.pop()()
