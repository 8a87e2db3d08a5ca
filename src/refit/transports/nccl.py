"""nccl transport: disaggregated GPUs; the sender broadcasts each bucket over a dedicated NCCL group.

Packing runs on the current stream and each broadcast on NCCL's own stream, so packing bucket i+1
overlaps the broadcast of bucket i; the streams order buffer reuse without host syncs.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from refit.errors import PeerError
from refit.transports.base import Pending
from refit.transports.group import BroadcastTransport


class _StreamWork(Pending):
    """An NCCL op: waiting makes the current stream wait, not the host (the group's timeout guards hangs)."""

    def __init__(self, work: dist.Work, what: str) -> None:
        self._work, self._what = work, what

    def wait(self, timeout_s: float) -> None:
        try:
            self._work.wait()
        except Exception as e:  # noqa: BLE001 - NCCL raises several types here; reported as PeerError with the cause
            raise PeerError(f"{self._what} failed: {e}; did a peer exit?") from None


class NcclTransport(BroadcastTransport):
    name = "nccl"
    device_type = "cuda"

    def _group(self, store: dist.Store) -> dist.ProcessGroup:
        if self._settings.ifname and "NCCL_SOCKET_IFNAME" not in os.environ:
            os.environ["NCCL_SOCKET_IFNAME"] = self._settings.ifname  # read by NCCL when the communicator starts
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = datetime.timedelta(seconds=self._settings.timeout_s)
        device = self.buffers[0].device
        try:
            pg = dist.ProcessGroupNCCL(dist.PrefixStore(self._prefix, store), self._rank, self._size, opts)
            # Connect now (prepared once), not on the first refit.
            x = torch.zeros(1, device=device)
            pg.broadcast([x], self._opts).wait()
            torch.cuda.synchronize(device)
            return pg
        except Exception as e:  # noqa: BLE001 - NCCL raises several types here; reported as PeerError with the cause
            raise PeerError(f"NCCL group setup (rank {self._rank} of {self._size}) failed: {e}") from None

    def _pending(self, work: dist.Work, what: str) -> Pending:
        return _StreamWork(work, what)

    def flush(self) -> None:
        torch.cuda.current_stream().synchronize()

    def close(self) -> None:
        if self._pg is not None:
            try:  # noqa: SIM105 - a blind except stays visible to the linter
                self._pg.shutdown()
            except Exception:  # noqa: BLE001, S110 - closing: the group may already be broken
                pass
        super().close()
