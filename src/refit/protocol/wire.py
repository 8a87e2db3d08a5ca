"""Wire: the fixed 64-byte header, JSON payload framing and the control channel (never pickle)."""

from __future__ import annotations

import contextlib
import fcntl
import json
import socket
import struct
import termios
import threading
import time
from dataclasses import dataclass
from enum import IntEnum, IntFlag
from typing import Any

from refit.errors import IntegrityError, PeerError

MAGIC = b"RFT1"
HEADER = struct.Struct("<4sBBHIIQ16sQQQ")
assert HEADER.size == 64
MAX_JSON_BYTES = 64 << 20
"""Largest JSON payload accepted; checked before anything is allocated."""
MAX_HELLO_BYTES = 4096
"""Largest HELLO or AUTH accepted: all that is read from a peer before its proof of the token is verified."""
MAX_JSON_DEPTH = 32
"""Deepest nesting accepted in any JSON from a peer (refit's own messages nest at most 6 deep)."""


class Kind(IntEnum):
    HELLO = 1  # receiver -> sender: protocol version, nonce, capacity limit
    WELCOME = 2  # sender -> receiver: rank, capacity, transport setup (MAC under the session key in `digest`)
    READY = 3  # receiver -> sender: transport joined (M:N: with the worker's shard statement, JSON)
    MANIFEST = 4  # sender -> receiver: manifest JSON (once per epoch); `digest`: MAC of its digest, session key
    REPORT = 5  # receiver -> sender: validation report JSON
    BEGIN = 6  # sender -> receiver: a refit of `version` starts
    BUCKET = 7  # sender -> receiver: bucket `index` is in `slot`
    ACK = 8  # receiver -> sender: bucket `index` consumed, `slot` free
    COMMIT = 9  # sender -> receiver: all buckets sent, commit `version`
    DONE = 10  # receiver -> sender: commit result (JSON error if status != 0)
    ERROR = 11  # either way: JSON {"message": ...}; the session is over
    CLOSE = 12  # sender -> receiver: orderly end of session
    SOURCES = 13  # sender -> receiver: CUDA IPC handles of the source tensors (zero-copy, once per epoch)
    HEARTBEAT = 14  # sender -> receiver, between refits: the sender is alive
    VERIFY = 15  # sender -> receiver, after the last bucket: fingerprints of the live source tensors
    AUTH = 16  # both ways, after HELLO: sender's nonce and proof, then the receiver's proof (refit.protocol.auth)
    LEAVE = 17  # receiver -> sender: it closes on purpose, JSON {"reason": ...}; the sender drops it (elastic)
    REGROUP = 18  # sender -> receiver, elastic gloo/nccl between refits: join a new group (JSON as WELCOME, MAC'd)
    REPAIR = 19  # sender -> receiver, after DONE asked for it: the tensors asked for again (refit.topology.repair)


class Begin(IntFlag):
    """BEGIN's status bits (docs/PROTOCOL.md, the header table)."""

    ZERO_COPY = 1
    """Bit 0: no BUCKET follows; receivers copy from the source tensors opened at SOURCES."""
    TWO_PHASE = 2
    """Bit 1: after DONE, the receiver holds its commit open until a second COMMIT carries the verdict (a vote
    across trainer ranks, or `verify="strict"`)."""
    DELTA = 4
    """Bit 2: a delta refit, sent against the version in the header's `base` field (docs/PROTOCOL.md, Delta
    refits): buckets may come as deltas against the wire image committed at that version."""


class Bucket(IntFlag):
    """BUCKET's status bits."""

    CHECKSUM = 1
    """Bit 0: `checksum` is set (over the bytes moved)."""
    DELTA = 2
    """Bit 1: the bytes moved are a delta payload (refit.stages.delta), not the bucket's wire bytes."""
    KEPT = 4
    """Bit 2, delta sessions: receivers keep the bucket in their wire image (a delta always is; a full bucket
    without it is not kept: no delta of it may follow until one with it)."""
    REFUSED = 8
    """Bit 3, FP8 sessions, on a refit's last bucket: the trainer refuses this refit (a tensor it quantizes holds
    a non-finite value); receivers fail it without loading the bucket, and nothing of it commits."""


class Offer(IntFlag):
    """MANIFEST's status bits."""

    FINGERPRINT = 1
    """The fingerprint check is on: VERIFY follows the last bucket of every refit."""


@dataclass(frozen=True)
class Done:
    """DONE's payload: `message` on failure (status 1); after a fingerprint check, how many tensors the engine
    could not read back (`unverified`) and their names (at most MAX_UNVERIFIED_NAMES)."""

    message: str = ""
    unverified: int = 0
    unverified_names: tuple[str, ...] = ()

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> Done:
        """From a peer's JSON: a field of the wrong type is dropped, never trusted."""
        message, count, names = obj.get("message"), obj.get("unverified"), obj.get("unverified_names")
        return cls(
            message=str(message) if message is not None else "",
            unverified=count if isinstance(count, int) and not isinstance(count, bool) and count > 0 else 0,
            unverified_names=tuple(str(n) for n in names[:MAX_UNVERIFIED_NAMES]) if isinstance(names, list) else (),
        )


MAX_UNVERIFIED_NAMES = 100_000
"""Most unverified tensor names taken from one DONE."""


WITH_PAYLOAD = {
    Kind.HELLO,
    Kind.WELCOME,
    Kind.READY,
    Kind.MANIFEST,
    Kind.REPORT,
    Kind.COMMIT,
    Kind.DONE,
    Kind.ERROR,
    Kind.SOURCES,
    Kind.VERIFY,
    Kind.AUTH,
    Kind.LEAVE,
    Kind.REGROUP,
    Kind.REPAIR,
}
MAX_REASON_CHARS = 500
"""Longest LEAVE reason kept (a reason is for a log line and RefitStats, not a document)."""


class PeerFailed(PeerError):
    """The peer said ERROR: it gave up (on the session, or on this side); the message says why."""


class Left(PeerError):
    """The peer said LEAVE: it closed on purpose; `reason` is what it said."""

    def __init__(self, peer: str, reason: str) -> None:
        super().__init__(f"{peer} left the session: {reason}")
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Header:
    """One control message's fixed part. `nbytes` is the bucket size, or the JSON payload length."""

    kind: Kind
    status: int = 0
    slot: int = 0
    epoch: int = 0
    index: int = 0
    version: int = 0
    digest: bytes = bytes(16)
    nbytes: int = 0
    checksum: int = 0
    base: int = 0
    """BEGIN of a delta refit: the committed version it is sent against."""

    def pack(self) -> bytes:
        return HEADER.pack(
            MAGIC,
            self.kind,
            self.status,
            self.slot,
            self.epoch,
            self.index,
            self.version,
            self.digest,
            self.nbytes,
            self.checksum,
            self.base,
        )

    @classmethod
    def unpack(cls, data: bytes) -> Header:
        magic, kind, status, slot, epoch, index, version, digest, nbytes, checksum, base = HEADER.unpack(data)
        if magic != MAGIC:
            raise IntegrityError(f"control message does not start with {MAGIC!r} (got {magic!r}); peer is not refit")
        try:
            k = Kind(kind)
        except ValueError:
            raise IntegrityError(f"control message has unknown kind {kind}") from None
        if k in WITH_PAYLOAD and nbytes > MAX_JSON_BYTES:
            raise IntegrityError(f"{k.name} payload of {nbytes} bytes exceeds the limit of {MAX_JSON_BYTES}")
        return cls(k, status, slot, epoch, index, version, digest, nbytes, checksum, base)


class Channel:
    """A framed control connection to one peer, with a deadline on every whole message and byte counters.

    Heartbeats are skipped by `recv` (and not counted as control bytes): an idle wait (`idle=True`)
    starts its deadline anew at each one, an in-refit wait does not.
    """

    def __init__(self, sock: socket.socket, *, peer: str, timeout_s: float) -> None:
        self.sock = sock
        self.peer = peer
        self.timeout_s = timeout_s
        self.bytes_sent = 0
        self.bytes_received = 0
        self.heartbeats = 0
        self.key = b""
        """This session's key once both sides proved the token (refit.protocol.auth)."""
        self.rank = 0
        """The receiver's rank in its session (the sender's channels), else 0."""
        self.stray: tuple[Header, bytes] | None = None
        self.ahead: tuple[Header, bytes] | None = None
        """A message read ahead while a transfer was in flight, one the protocol allows there (a zero-copy
        refit's VERIFY or COMMIT, sent while the receivers still READ): the next `recv` returns it."""
        self.later: list[tuple[Header, bytes]] = []
        """Messages read ahead after `ahead`, in order: each becomes `ahead` in turn."""
        """The last message `expect` refused (another kind than expected), for a caller that can still use it."""
        self._send_lock = threading.Lock()
        sock.settimeout(timeout_s)
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)

    def set_timeout(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s

    def send(self, header: Header, payload: object = None) -> None:
        if payload is None or isinstance(payload, bytes):
            data = payload or b""
        else:
            data = json.dumps(payload, separators=(",", ":")).encode()
        header = Header(**{**_fields(header), "nbytes": len(data)}) if header.kind in WITH_PAYLOAD else header
        msg = header.pack() + data
        try:
            with self._send_lock:
                self.sock.settimeout(self.timeout_s)
                self.sock.sendall(msg)
        except OSError as e:
            raise PeerError(f"cannot send {header.kind.name} to {self.peer}: {e}; is it still running?") from None
        if header.kind != Kind.HEARTBEAT:
            self.bytes_sent += len(msg)

    def unsent_bytes(self) -> int:
        """Bytes queued on this socket that the peer has not taken yet (-1 where the OS cannot tell)."""
        try:
            return int.from_bytes(fcntl.ioctl(self.sock.fileno(), termios.TIOCOUTQ, bytes(4)), "little")
        except (OSError, AttributeError, ValueError):
            return -1

    def recv(
        self,
        stage: str,
        *,
        idle: bool = False,
        max_payload: int = MAX_JSON_BYTES,
        timeout_s: float | None = None,
        heartbeats: bool = False,
        wire: bool = False,
    ) -> tuple[Header, bytes]:
        """The next message, read whole within the timeout; an ERROR from the peer is raised as PeerFailed (a
        PeerError). A HEARTBEAT is skipped, or with `heartbeats` returned (to a caller that only looks).
        `wire`: the next one on the connection, even while messages read ahead wait (a watch reading on)."""
        if self.ahead is not None and not wire:
            ahead, self.ahead = self.ahead, (self.later.pop(0) if self.later else None)
            return ahead
        timeout_s = timeout_s or self.timeout_s
        deadline = time.monotonic() + timeout_s
        while True:
            header = Header.unpack(self._read(HEADER.size, stage, deadline, timeout_s))
            if header.kind == Kind.HEARTBEAT:
                self.heartbeats += 1
                if heartbeats:
                    return header, b""
                if idle:  # the peer proved alive: wait on
                    deadline = time.monotonic() + timeout_s
                continue
            if header.kind in WITH_PAYLOAD and header.nbytes > max_payload:
                raise IntegrityError(
                    f"{header.kind.name} of {header.nbytes} bytes from {self.peer} exceeds the "
                    f"{max_payload} allowed here"
                )
            payload = self._read(header.nbytes, stage, deadline, timeout_s) if header.kind in WITH_PAYLOAD else b""
            self.bytes_received += HEADER.size + len(payload)
            if header.kind == Kind.ERROR:
                raise PeerFailed(f"{self.peer} failed: {_message(payload)}")
            if header.kind == Kind.LEAVE:
                raise Left(self.peer, leave_reason(payload))
            return header, payload

    def expect(self, kind: Kind, stage: str) -> tuple[Header, bytes]:
        header, payload = self.recv(stage)
        if header.kind != kind:
            self.stray = (header, payload)
            raise PeerError(f"{self.peer} sent {header.kind.name} during {stage}, expected {kind.name}")
        return header, payload

    def _read(self, n: int, stage: str, deadline: float, timeout_s: float) -> bytes:
        buf = bytearray(n)
        view, got = memoryview(buf), 0
        while got < n:
            remaining = deadline - time.monotonic()
            try:
                if remaining <= 0:
                    raise TimeoutError
                self.sock.settimeout(remaining)
                k = self.sock.recv_into(view[got:])
            except TimeoutError:
                raise PeerError(
                    f"{self.peer} did not answer within {timeout_s:g}s during {stage}; "
                    "check that it is alive, or raise the timeout (REFIT_TIMEOUT)"
                ) from None
            except ConnectionResetError:
                k = 0
            except OSError as e:
                raise PeerError(f"connection to {self.peer} failed during {stage}: {e}") from None
            if k == 0:
                raise PeerError(f"{self.peer} closed the connection during {stage} (did it exit or crash?)")
            got += k
        return bytes(buf)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


def _fields(h: Header) -> dict:
    return {f: getattr(h, f) for f in Header.__slots__}


def _message(payload: bytes) -> str:
    try:
        obj = load_json(payload, "ERROR")
    except IntegrityError:
        return "(unreadable error message)"
    return str(obj.get("message", obj)) if isinstance(obj, dict) else str(obj)


def leave_reason(payload: bytes) -> str:
    """The reason in a LEAVE, bounded; a malformed one still counts as leaving (the peer is gone either way)."""
    try:
        obj = load_json(payload, "LEAVE", max_bytes=64 << 10)
    except IntegrityError:
        return "(unreadable reason)"
    reason = obj.get("reason") if isinstance(obj, dict) else None
    return str(reason)[:MAX_REASON_CHARS] if reason else "(no reason given)"


def load_json(payload: bytes, what: str, *, max_bytes: int = MAX_JSON_BYTES) -> object:
    """Any JSON value from a peer, bounded in size and nesting; every failure is IntegrityError naming `what`."""
    if len(payload) > max_bytes:
        raise IntegrityError(f"{what} of {len(payload)} bytes exceeds the {max_bytes} allowed")
    try:
        obj = json.loads(payload)
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise IntegrityError(f"{what} is not valid JSON: {type(e).__name__}: {str(e)[:200]}") from None
    if _depth(obj) > MAX_JSON_DEPTH:
        raise IntegrityError(f"{what} nests deeper than {MAX_JSON_DEPTH} levels")
    return obj


_SCALARS = frozenset({str, int, float, bool, type(None)})


def _depth(obj: object) -> int:
    """Nesting depth of a parsed JSON value, without recursion."""
    deepest, stack = 0, [(obj, 1)]
    while stack:
        o, d = stack.pop()
        if isinstance(o, (list, dict)):
            deepest = max(deepest, d)
            values = o.values() if isinstance(o, dict) else o
            # one C pass first: a long list of scalars (the fingerprint's digests) has nothing to walk
            if d <= MAX_JSON_DEPTH and not _SCALARS.issuperset(map(type, values)):
                stack.extend((v, d + 1) for v in values)
    return deepest


def parse_json(payload: bytes, what: str, *, max_bytes: int = MAX_JSON_BYTES) -> dict:
    """A JSON object from a peer, or IntegrityError naming `what`."""
    obj = load_json(payload, what, max_bytes=max_bytes)
    if not isinstance(obj, dict):
        raise IntegrityError(f"{what} must be a JSON object")
    return obj
