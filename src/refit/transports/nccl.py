"""nccl transport: disaggregated GPUs; the sender broadcasts each bucket over a dedicated NCCL group.

Packing runs on the current stream and each broadcast on NCCL's own stream, so packing bucket i+1
overlaps the broadcast of bucket i; the streams order buffer reuse without host syncs.
"""

from __future__ import annotations

import datetime
import socket

import torch
import torch.distributed as dist

from refit.errors import PeerError
from refit.settings import Settings
from refit.transports.base import Pending, Transport


class _StreamWork(Pending):
    """An NCCL op: waiting makes the current stream wait, not the host (the group's timeout guards hangs)."""

    def __init__(self, work: dist.Work, what: str) -> None:
        self._work, self._what = work, what

    def wait(self, timeout_s: float) -> None:
        try:
            self._work.wait()
        except Exception as e:
            raise PeerError(f"{self._what} failed: {e}; did a peer exit?") from None


def _group(store: dist.Store, *, rank: int, size: int, timeout_s: float, prefix: str, device: torch.device):
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = datetime.timedelta(seconds=timeout_s)
    try:
        pg = dist.ProcessGroupNCCL(dist.PrefixStore(prefix, store), rank, size, opts)
        # Connect now (prepared once), not on the first refit.
        x = torch.zeros(1, device=device)
        opt = dist.BroadcastOptions()
        opt.rootRank = 0
        pg.broadcast([x], opt).wait()
        torch.cuda.synchronize(device)
        return pg
    except Exception as e:
        raise PeerError(f"NCCL group setup (rank {rank} of {size}) failed: {e}") from None


class NcclTransport(Transport):
    name = "nccl"
    device_type = "cuda"

    def __init__(self, buffers: list[torch.Tensor], *, rank: int, size: int, settings: Settings, prefix: str) -> None:
        self.buffers = buffers
        self._rank, self._size, self._settings, self._prefix = rank, size, settings, prefix
        self._store: dist.Store | None = None
        self._pg = None
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
        bufs = [torch.empty(capacity, dtype=torch.uint8, device=device) for _ in range(num_slots)]
        t = cls(bufs, rank=0, size=num_receivers + 1, settings=settings, prefix=f"refit-nccl/{settings.token}/")
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
            raise PeerError(f"nccl setup info is malformed: {info!r:.200}")
        bufs = [torch.empty(capacity, dtype=torch.uint8, device=device) for _ in range(slots)]
        t = cls(bufs, rank=rank, size=size, settings=settings, prefix=str(info.get("prefix")))
        try:
            t._store = dist.TCPStore(host, port, size, False, datetime.timedelta(seconds=settings.timeout_s))
        except Exception as e:
            raise PeerError(f"cannot reach the sender's store at {host}:{port}: {e}") from None
        t._pg = _group(t._store, rank=rank, size=size, timeout_s=settings.timeout_s, prefix=t._prefix, device=device)
        return t

    def establish(self) -> None:
        assert self._store is not None
        self._pg = _group(self._store, rank=0, size=self._size, timeout_s=self._settings.timeout_s,
                          prefix=self._prefix, device=self.buffers[0].device)  # fmt: skip

    def _broadcast(self, slot: int, nbytes: int, what: str) -> Pending:
        if self._pg is None:
            raise PeerError("nccl transport is closed or was never set up")
        return _StreamWork(self._pg.broadcast([self.buffers[slot][:nbytes]], self._opts), what)

    def send(self, slot: int, nbytes: int) -> Pending:
        return self._broadcast(slot, nbytes, f"NCCL broadcast of {nbytes} bytes")

    def recv(self, slot: int, nbytes: int) -> Pending:
        return self._broadcast(slot, nbytes, f"NCCL receive of {nbytes} bytes")

    def flush(self) -> None:
        torch.cuda.current_stream().synchronize()

    def close(self) -> None:
        if self._pg is not None:
            try:
                self._pg.shutdown()
            except Exception:
                pass
        self._pg = None
        self._store = None
        self.buffers = []
