"""gloo transport: disaggregated CPU processes; the sender broadcasts each bucket over a dedicated gloo group."""

from __future__ import annotations

import datetime
import socket

import torch
import torch.distributed as dist

from refit.errors import PeerError
from refit.settings import Settings
from refit.transports.base import Pending, Transport


class _Work(Pending):
    def __init__(self, work: dist.Work, what: str) -> None:
        self._work = work
        self._what = what

    def wait(self, timeout_s: float) -> None:
        try:
            self._work.wait(datetime.timedelta(seconds=timeout_s))
        except Exception as e:  # gloo raises RuntimeError subclasses with its own wording
            raise PeerError(f"{self._what} failed: {e}; did a peer exit, or is REFIT_TIMEOUT too short?") from None


def _group(store: dist.Store, *, rank: int, size: int, host: str, timeout_s: float, prefix: str) -> dist.ProcessGroup:
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = datetime.timedelta(seconds=timeout_s)
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    try:
        return dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, size, opts)
    except Exception as e:
        raise PeerError(f"gloo group setup (rank {rank} of {size}) failed: {e}") from None


class GlooTransport(Transport):
    """A gloo group of the sender (rank 0) and every receiver, made through its own TCPStore.

    The group never touches torch.distributed's default group, so a trainer's own groups are unaffected.
    """

    name = "gloo"
    device_type = "cpu"

    def __init__(self, buffers: list[torch.Tensor], *, rank: int, size: int, settings: Settings) -> None:
        self.buffers = buffers
        self._rank, self._size, self._settings = rank, size, settings
        self._store: dist.Store | None = None
        self._pg: dist.ProcessGroup | None = None
        self._prefix = f"refit/{settings.token}/"
        """Keys only peers that were given the token can find."""
        self._opts = dist.BroadcastOptions()
        self._opts.rootRank = 0

    @classmethod
    def offer(
        cls, *, capacity: int, num_slots: int, num_receivers: int, device: torch.device, settings: Settings
    ) -> tuple[Transport, dict]:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.bind((settings.host, 0))
        listener.listen(128)
        port = listener.getsockname()[1]
        t = cls([torch.empty(capacity, dtype=torch.uint8) for _ in range(num_slots)],
                rank=0, size=num_receivers + 1, settings=settings)  # fmt: skip
        t._store = dist.TCPStore(
            settings.host, port, num_receivers + 1, True, datetime.timedelta(seconds=settings.timeout_s),
            wait_for_workers=False, master_listen_fd=listener.detach(),
        )  # fmt: skip
        info = {"host": settings.host, "port": port, "size": num_receivers + 1, "capacity": capacity,
                "slots": num_slots, "prefix": t._prefix}  # fmt: skip
        return t, info

    @classmethod
    def join(cls, info: dict, *, rank: int, device: torch.device, settings: Settings) -> Transport:
        host, port, size, capacity, slots = (info.get(k) for k in ("host", "port", "size", "capacity", "slots"))
        if not (isinstance(host, str) and all(isinstance(v, int) for v in (port, size, capacity, slots))):
            raise PeerError(f"gloo setup info is malformed: {info!r:.200}")
        buffers = [torch.empty(capacity, dtype=torch.uint8) for _ in range(slots)]
        t = cls(buffers, rank=rank, size=size, settings=settings)
        t._prefix = str(info.get("prefix", t._prefix))
        try:
            t._store = dist.TCPStore(host, port, size, False, datetime.timedelta(seconds=settings.timeout_s))
        except Exception as e:
            raise PeerError(f"cannot reach the sender's gloo store at {host}:{port}: {e}") from None
        t._pg = _group(t._store, rank=rank, size=size, host=host, timeout_s=settings.timeout_s, prefix=t._prefix)
        return t

    def establish(self) -> None:
        assert self._store is not None
        self._pg = _group(
            self._store, rank=0, size=self._size, host=self._settings.host,
            timeout_s=self._settings.timeout_s, prefix=self._prefix,
        )  # fmt: skip

    def _broadcast(self, slot: int, nbytes: int, what: str) -> Pending:
        if self._pg is None:
            raise PeerError("gloo transport is closed or was never set up")
        return _Work(self._pg.broadcast([self.buffers[slot][:nbytes]], self._opts), what)

    def send(self, slot: int, nbytes: int) -> Pending:
        return self._broadcast(slot, nbytes, f"gloo broadcast of {nbytes} bytes to {self._size - 1} receiver(s)")

    def recv(self, slot: int, nbytes: int) -> Pending:
        return self._broadcast(slot, nbytes, f"gloo receive of {nbytes} bytes from the sender")

    def close(self) -> None:
        self._pg = None
        self._store = None
        self.buffers = []
