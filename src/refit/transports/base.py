"""Transport protocol: moves one bucket of bytes between fixed, pre-allocated buffers; knows no names."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import ClassVar, Protocol

import torch
import torch.distributed as dist

from refit.errors import PeerError
from refit.settings import Settings

INTERRUPT_EVERY_S = 0.05
"""How often a wait that can be interrupted asks whether it was (a look at the control socket)."""


class Interrupted(PeerError):
    """A wait for a transfer given up because the caller's `interrupted()` said the peer gave up on it."""


class Pending(ABC):
    """A transfer in flight."""

    ready: bool = False
    """True when the bytes are already in place and `wait` returns at once."""

    @abstractmethod
    def wait(self, timeout_s: float, interrupted: Callable[[], bool] | None = None) -> None:
        """Block until done; raise PeerError if the peer fails or the timeout passes, and Interrupted as soon as
        `interrupted()` holds (checked now and then while waiting: the other side gave up on this transfer)."""


class Done(Pending):
    """A transfer that needs no waiting (the bytes are already where the reader looks)."""

    ready = True

    def wait(self, timeout_s: float, interrupted: Callable[[], bool] | None = None) -> None:
        return None


DONE = Done()


class StoreProvider(Protocol):
    """Where a group transport (gloo, nccl) gets its rendezvous store. Topology injects one that serves only
    peers that prove the session token (refit.protocol.store); transports never build a store of their own."""

    def serve(self, host: str, num_clients: int) -> tuple[dist.Store, int]:
        """Rank 0: a store listening on `host` (a port the OS picks) for `num_clients` ranks; (store, port)."""
        ...

    def connect(self, host: str, port: int) -> dist.Store:
        """Rank > 0: the store rank 0 serves at host:port."""
        ...

    def close(self) -> None:
        """Release every store this provider served or reached."""
        ...


class Transport(ABC):
    """One session's link: `num_slots` buffers of `capacity` bytes on each side, set up once.

    The sender calls `offer` (which returns JSON-able setup info for the receivers), sends the info,
    then `establish` and, once every receiver has joined, `joined`. Receivers call `join(info)`.
    """

    name: ClassVar[str]
    uses_store: ClassVar[bool] = False
    """True when `offer` and `join` take a `store: StoreProvider` keyword."""
    device_type: ClassVar[str]
    """'cpu' or 'cuda': where the buffers live."""

    buffers: list[torch.Tensor]
    """uint8 buffers, one per slot, each `capacity` bytes."""

    @classmethod
    @abstractmethod
    def offer(
        cls, *, capacity: int, num_slots: int, num_receivers: int, device: torch.device, settings: Settings
    ) -> tuple[Transport, dict]:
        """Sender side: allocate the buffers and return (transport, setup info for receivers)."""

    @classmethod
    @abstractmethod
    def join(cls, info: dict, *, rank: int, device: torch.device, settings: Settings) -> Transport:
        """Receiver side: attach to the sender's offer."""

    def establish(self) -> None:
        """Sender side, after the info went out: finish collective setup (blocks until receivers join)."""

    def joined(self) -> None:
        """Sender side, after every receiver reported READY."""

    @abstractmethod
    def send(self, slot: int, nbytes: int) -> Pending:
        """Sender side: start moving the first `nbytes` of `slot`'s buffer to every receiver."""

    @abstractmethod
    def recv(self, slot: int, nbytes: int) -> Pending:
        """Receiver side: start receiving `nbytes` into `slot`'s buffer."""

    def before_pack(self, slot: int) -> None:
        """Sender side, before writing into `slot` (its previous bucket was acknowledged by every receiver):
        e.g. make the device wait for the receivers' reads of it."""

    def before_send(self, slot: int) -> None:
        """Sender side, after packing `slot` and before telling receivers it is ready (e.g. a stream sync)."""

    def release(self, slot: int) -> None:
        """Receiver side, after loading from `slot` and before acknowledging it: the slot may be reused."""

    def flush(self) -> None:
        """Receiver side, before commit: every load issued so far has completed."""

    def arrived(self) -> set[int] | None:
        """Sender side of a group transport, while `establish` waits: the group ranks (the sender is 0, receivers
        1 and up) that reached the rendezvous so far. None (the default) when this transport cannot tell: the
        caller then counts every member as not arrived."""
        return None

    def left(self, rank: int) -> None:
        """Sender side of a group transport: group rank `rank` left mid-refit. A transport whose other members
        get their bytes through it (relay) fails its transfers from now on, so the group is formed again."""

    def abort(self) -> None:
        """Give the link up now, so that every peer still blocked in it fails at once instead of waiting out its
        timeout (a group a dead member broke), then release it. The default is `close`, for a transport whose
        close already wakes its peers."""
        self.close()

    def close(self) -> None:
        """Release buffers and groups; safe to call twice."""
