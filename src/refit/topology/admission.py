"""A Sender's admission at connect: the receivers the lobby admitted become channels (their HELLO's capacity
limit checked), are welcomed with the transport's setup, and cuda-ipc falls back to shm where it cannot work."""

from __future__ import annotations

import json
import warnings

import torch

from refit.errors import PeerError
from refit.layout.budget import bucket_capacity, free_bytes, needed_bytes
from refit.layout.spec import TensorSpec
from refit.log import get_logger
from refit.protocol import auth
from refit.protocol.lobby import Lobby
from refit.protocol.wire import Channel, Header, Kind
from refit.settings import Settings

log = get_logger("sender")


def admit(lobby: Lobby, count: int, settings: Settings, *, into: list[Channel]) -> list[int]:
    """Admit `count` receivers (token checked by the lobby) as channels ranked from 1, appended to `into` (which
    the session closes, also after a bad limit); returns their bucket capacity limits."""
    arrivals = lobby.admit(count, settings.connect_timeout_s)
    limits = []
    for rank, a in enumerate(arrivals, start=1):
        ch = Channel(a.sock, peer=f"receiver {rank} ({a.addr})", timeout_s=settings.timeout_s)
        ch.key, ch.rank = a.key, rank
        into.append(ch)
        limit = a.hello.get("capacity")
        if not isinstance(limit, int) or isinstance(limit, bool) or limit <= 0:
            ch.send(Header(Kind.ERROR), {"message": f"invalid capacity limit {limit!r} in HELLO"})
            raise PeerError(f"receiver {rank} sent an invalid capacity limit {limit!r}")
        limits.append(limit)
    return limits


def agreed_capacity(
    limits: list[int], settings: Settings, device: torch.device, num_slots: int, specs: list[TensorSpec]
) -> int:
    """The session's bucket capacity: the trainer's own (for `specs`, `num_slots` slots on `device`) or the
    smallest of the receivers' `limits`. Fixed for the session: a model that grows later (a dtype switch) takes
    more buckets of this size."""
    own = bucket_capacity(
        bucket_bytes=settings.bucket_bytes,
        ratio=settings.ratio,
        free=free_bytes(device),
        num_slots=num_slots,
        needed=needed_bytes(specs),
    )
    return min([own, *limits])


def welcome(channels: list[Channel], setup: dict) -> None:
    """WELCOME each receiver with its rank and the session's `setup`, bound to its session key by a MAC."""
    for ch in channels:
        data = json.dumps({"rank": ch.rank, **setup}).encode()
        ch.send(Header(Kind.WELCOME, digest=auth.tag(ch.key, b"WELCOME", data)), data)


def falls_back(transport: str, in_place: bool, device: torch.device, settings: Settings) -> bool:
    """cuda-ipc where CUDA IPC cannot work: True (stage through pinned host shared memory instead), said why.
    `in_place`: receivers read the source's own memory (zero-copy), which no other transport can share."""
    if transport != "cuda-ipc" or in_place:
        return False
    from refit.transports.cuda_ipc import blocker

    reason = blocker(device, settings)
    if not reason:
        return False
    warnings.warn(
        f"cuda-ipc cannot be used ({reason}); staging through pinned host shared memory "
        "(transport 'shm') instead, which is slower",
        RuntimeWarning,
        stacklevel=4,
    )
    log.warning("cuda-ipc falls back to shm: %s", reason)
    return True
