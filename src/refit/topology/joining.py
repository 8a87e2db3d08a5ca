"""Joining a sender, on the engine side: the mutual proof of the token, then the WELCOME (or REGROUP) that
says how to join its transport. Everything here reads what a peer sent before or just after it proved
the token, so every field is checked before use and any fault is a RefitError, never another exception."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from refit import transports
from refit.errors import IntegrityError, PeerError
from refit.layout.budget import bucket_capacity, free_bytes
from refit.log import get_logger
from refit.protocol import auth
from refit.protocol.lobby import read_auth
from refit.protocol.store import AuthenticatedStores
from refit.protocol.wire import Channel, Header, Kind, parse_json
from refit.settings import Settings
from refit.transports.base import Transport

log = get_logger("receiver")

MAX_WELCOME_BYTES = 1 << 20
"""Largest WELCOME read (transport setup: a few paths or an address)."""


@dataclass(frozen=True, slots=True)
class Welcome:
    """What a WELCOME or REGROUP tells a receiver, checked."""

    rank: int
    capacity: int
    info: dict
    """The transport's setup, for `Transport.join`."""
    transport: str | None
    """The transport the sender runs when it fell back from the one asked for (else None or the same)."""
    heartbeat_s: float | None
    elastic: bool


def authenticate(ch: Channel, token: str, limit: int) -> None:
    """Both sides prove the token (refit.protocol.auth); nothing else is read from the sender before its proof.
    Sets the channel's session key."""
    mine = auth.nonce()
    ch.send(Header(Kind.HELLO), {"protocol": auth.PROTOCOL_VERSION, "nonce": mine.hex(), "capacity": limit})
    try:
        msg = read_auth(ch, "authentication")
    except PeerError as e:
        if "wrong token" not in str(e):
            raise
        raise PeerError(
            f"{e}; a sender that refuses before authenticating runs an older refit (protocol version before "
            f"{auth.PROTOCOL_VERSION}): install the same refit version on the trainer and engine hosts"
        ) from None
    if msg.get("protocol") != auth.PROTOCOL_VERSION:
        raise PeerError(
            f"protocol version mismatch: the sender speaks {str(msg.get('protocol'))[:40]}, this receiver speaks "
            f"{auth.PROTOCOL_VERSION}; install the same refit version on the trainer and engine hosts"
        )
    theirs = auth.parse_nonce(msg.get("nonce"))
    if theirs is None or not auth.verify(token, auth.SENDER, mine, theirs, msg.get("proof")):
        raise PeerError(
            f"{ch.peer} did not prove it knows the token: wrong token on this side (pass the token from "
            "Sender.rendezvous()), or it is not this session's sender; nothing it names was used"
        )
    ch.send(Header(Kind.AUTH), {"proof": auth.proof(token, auth.RECEIVER, mine, theirs)})
    ch.key = auth.session_key(token, mine, theirs)


def read_welcome(ch: Channel, header: Header, raw: bytes, limit: int) -> Welcome:
    """The WELCOME (or REGROUP) in `header` and `raw`, once its MAC under the session key checks out; buffers of
    more than `limit` bytes are refused."""
    what = header.kind.name
    if not auth.check_tag(ch.key, what.encode(), raw, header.digest):
        raise IntegrityError(f"{ch.peer}'s {what} is not bound to this session (its MAC is wrong); not trusted")
    welcome = parse_json(raw, what)
    rank, capacity, info = welcome.get("rank"), welcome.get("capacity"), welcome.get("info")
    if not (
        isinstance(rank, int)
        and not isinstance(rank, bool)
        and rank >= 0
        and isinstance(capacity, int)
        and 0 < capacity <= limit
        and isinstance(info, dict)
    ):
        raise IntegrityError(f"WELCOME is malformed or asks for more than this side's limit ({limit} bytes)")
    if info.get("capacity", capacity) != capacity:
        raise IntegrityError(f"WELCOME's transport setup sizes buffers of {info.get('capacity')!r:.40}, not {capacity}")
    beat = welcome.get("heartbeat_s")
    beats = isinstance(beat, (int, float)) and not isinstance(beat, bool) and 0 < beat < 3600
    name = welcome.get("transport")
    return Welcome(
        rank=rank,
        capacity=capacity,
        info=info,
        transport=name if isinstance(name, str) else None,
        heartbeat_s=float(beat) if beats else None,  # type: ignore[arg-type]
        elastic=welcome.get("elastic") is True,
    )


class Joiner:
    """How one receiver joins its sender's transport, and (elastic gloo/nccl) each group the sender forms
    anew: the transport class and device (the sender may fall back), this side's rank, how long a live
    sender may stay silent, and whether a broken group is formed again."""

    def __init__(self, rendezvous: dict, settings: Settings, device: torch.device | None) -> None:
        name = rendezvous.get("transport")
        if not isinstance(name, str):
            raise ValueError("rendezvous must name a transport")
        self.asked = name
        self.token = ""
        """The token of the rendezvous last dialled (`first`); a regrouped store is authenticated with it."""
        self.settings = settings
        self.cls: type[Transport] = transports.get(name)
        self._device = device or transports.default_device(name)
        self.device = self._device
        self.rank = 0
        self.idle_timeout_s = settings.timeout_s
        self.regroups = False
        """Elastic gloo/nccl (WELCOME says elastic): a broken group is re-formed by the sender, not the end."""

    def limit(self) -> int:
        """The largest bucket this side can hold."""
        s = self.settings
        return bucket_capacity(bucket_bytes=s.bucket_bytes, ratio=s.ratio, free=free_bytes(self.device))

    def first(self, ch: Channel, token: str) -> Transport:
        """Prove `token` both ways, then join the transport the WELCOME describes."""
        self.token = token
        self.cls, self.device = transports.get(self.asked), self._device  # a fallback of an earlier dial is undone
        self.idle_timeout_s, self.regroups = self.settings.timeout_s, False
        limit = self.limit()
        ch.set_timeout(self.settings.connect_timeout_s)  # the sender admits every receiver first; they start slowly
        authenticate(ch, self.token, limit)
        # idle: an elastic gloo/nccl sender welcomes a joiner when it forms its next group, beating meanwhile
        header, raw = ch.recv(
            "rendezvous (waiting for every receiver to connect)", idle=True, max_payload=MAX_WELCOME_BYTES
        )
        if header.kind != Kind.WELCOME:
            raise PeerError(f"{ch.peer} sent {header.kind.name} during rendezvous, expected WELCOME")
        return self.group(ch, header, raw)

    def group(self, ch: Channel, header: Header, raw: bytes) -> Transport:
        """Join the transport WELCOME or REGROUP describes; elastic gloo/nccl: a group the sender gave up forming
        (a member did not join in time: it closed the group's store under this side) is joined again from the
        sender's next REGROUP."""
        limit = self.limit()
        while True:
            try:
                return self._join(ch, read_welcome(ch, header, raw, limit))
            except PeerError as e:
                if not self.regroups:
                    raise
                log.warning("could not join the sender's new group (%s); waiting for it to form one again", e)
            header, raw = ch.recv(
                "the sender's new group (formed again without a member)",
                timeout_s=self.idle_timeout_s,
                max_payload=MAX_WELCOME_BYTES,
            )
            if header.kind != Kind.REGROUP:
                raise PeerError(f"{ch.peer} sent {header.kind.name} while forming its new group, expected REGROUP")

    def _join(self, ch: Channel, welcome: Welcome) -> Transport:
        ch.set_timeout(self.settings.timeout_s)
        if welcome.heartbeat_s is not None:  # never call a live sender dead for beating slower than its own timeout
            self.idle_timeout_s = max(self.settings.timeout_s, 3 * welcome.heartbeat_s)
        if welcome.transport is not None and welcome.transport != self.cls.name:  # the sender fell back
            try:
                self.cls = transports.get(welcome.transport)
            except ValueError as e:
                raise IntegrityError(f"{ch.peer}'s WELCOME names a transport this side lacks: {e}") from None
            self.device = transports.default_device(welcome.transport)
        self.regroups = welcome.elastic and self.cls.uses_store
        store = {"store": AuthenticatedStores(self.token, self.settings)} if self.cls.uses_store else {}
        transport = self.cls.join(welcome.info, rank=welcome.rank, device=self.device, settings=self.settings, **store)
        self.rank = welcome.rank
        return transport
