"""BroadcastTransport: the part gloo and nccl share: a dedicated group made once through a rendezvous store
that topology injects (refit.protocol.store: served on the sender's host, only to peers that prove the
token), and one broadcast per bucket from the sender (rank 0)."""

from __future__ import annotations

import contextlib
from abc import abstractmethod

import torch
import torch.distributed as dist

from refit.errors import PeerError
from refit.settings import Settings
from refit.transports import address
from refit.transports.base import Pending, StoreProvider, Transport


class BroadcastTransport(Transport):
    """Rank 0 is the sender; ranks 1..n are receivers. Subclasses make the group and wrap its work."""

    uses_store = True

    def __init__(
        self, buffers: list[torch.Tensor], *, rank: int, size: int, settings: Settings, prefix: str = ""
    ) -> None:
        self.buffers = buffers
        self._rank, self._size, self._settings = rank, size, settings
        self._prefix = prefix or f"refit-{self.name}"
        """Namespace of the group's keys in its store; the store is the group's own and its keys carry no secret."""
        self._provider: StoreProvider | None = None
        self._host = address.advertised(address.listen_host(settings), settings)
        """Local address this rank's group binds to (a receiver's is the one that routes to the sender)."""
        self._store: dist.Store | None = None
        self._pg: dist.ProcessGroup | None = None
        self._opts = dist.BroadcastOptions()
        self._opts.rootRank = 0

    @abstractmethod
    def _group(self, store: dist.Store) -> dist.ProcessGroup:
        """Make this transport's process group on `store` (blocks until every rank joined)."""

    @abstractmethod
    def _pending(self, work: dist.Work, what: str) -> Pending:
        """Wrap one broadcast in flight."""

    @classmethod
    def offer(
        cls,
        *,
        capacity: int,
        num_slots: int,
        num_receivers: int,
        device: torch.device,
        settings: Settings,
        store: StoreProvider | None = None,
    ) -> tuple[Transport, dict]:
        if store is None:
            raise ValueError(f"the {cls.name} transport needs a store provider (refit.protocol.store), none given")
        buffers = [torch.empty(capacity, dtype=torch.uint8, device=device) for _ in range(num_slots)]
        t = cls(buffers, rank=0, size=num_receivers + 1, settings=settings)
        t._provider = store
        t._store, port = store.serve(address.listen_host(settings), num_receivers)  # loopback by default
        info = {"host": t._host, "port": port, "size": num_receivers + 1, "capacity": capacity, "slots": num_slots}
        return t, info

    @classmethod
    def join(
        cls, info: dict, *, rank: int, device: torch.device, settings: Settings, store: StoreProvider | None = None
    ) -> Transport:
        if store is None:
            raise ValueError(f"the {cls.name} transport needs a store provider (refit.protocol.store), none given")
        host, port, size, capacity, slots = (info.get(k) for k in ("host", "port", "size", "capacity", "slots"))
        rank = info.get("group_rank", rank)  # an elastic session's group ranks are 1..n whatever the receivers' ranks
        if not (
            isinstance(host, str)
            and 0 < len(host) <= 253
            and all(isinstance(v, int) and not isinstance(v, bool) for v in (port, size, capacity, slots, rank))
            and 0 < port < 65536
            and 1 < size <= 65536
            and 0 < rank < size
            and 0 < slots <= 64
        ):
            raise PeerError(f"{cls.name} setup info is malformed: {info!r:.200}")
        buffers = [torch.empty(capacity, dtype=torch.uint8, device=device) for _ in range(slots)]
        t = cls(buffers, rank=rank, size=size, settings=settings)
        t._provider = store
        t._host = address.towards(host, settings)
        try:
            t._store = store.connect(host, port)
            t._pg = t._group(t._store)
        except BaseException:
            t.close()
            raise
        return t

    def establish(self) -> None:
        assert self._store is not None
        self._pg = self._group(self._store)

    def _broadcast(self, slot: int, nbytes: int, what: str) -> Pending:
        if self._pg is None:
            raise PeerError(f"{self.name} transport is closed or was never set up")
        return self._pending(self._pg.broadcast([self.buffers[slot][:nbytes]], self._opts), what)

    def send(self, slot: int, nbytes: int) -> Pending:
        return self._broadcast(slot, nbytes, f"{self.name} broadcast of {nbytes} bytes to {self._size - 1} receiver(s)")

    def recv(self, slot: int, nbytes: int) -> Pending:
        return self._broadcast(slot, nbytes, f"{self.name} receive of {nbytes} bytes from the sender")

    def abort(self) -> None:
        """Break the group now, so that every peer still blocked in it fails at once instead of waiting out its
        timeout (an elastic sender leaving a group a dead member broke), then close."""
        pg, self._pg = self._pg, None
        if pg is not None:
            with contextlib.suppress(Exception):  # a group already broken may refuse; it is dropped either way
                pg.abort()
        self.close()

    def close(self) -> None:
        self._pg = None
        self._store = None
        self.buffers = []
        if self._provider is not None:
            self._provider.close()
            self._provider = None
