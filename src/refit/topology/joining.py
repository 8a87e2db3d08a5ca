"""Joining a sender, on the engine side: the mutual proof of the token, then the WELCOME (or REGROUP) that
says how to join its transport. Everything here reads what a peer sent before or just after it proved
the token, so every field is checked before use and any fault is a RefitError, never another exception."""

from __future__ import annotations

from dataclasses import dataclass

from refit.errors import IntegrityError, PeerError
from refit.protocol import auth
from refit.protocol.lobby import read_auth
from refit.protocol.wire import Channel, Header, Kind, parse_json

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
