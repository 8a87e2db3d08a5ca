"""gloo transport: disaggregated CPU processes; the sender broadcasts each bucket over a dedicated gloo group."""

from __future__ import annotations

import datetime

import torch.distributed as dist

from refit.errors import PeerError
from refit.transports.base import Pending
from refit.transports.group import BroadcastTransport


class _Work(Pending):
    def __init__(self, work: dist.Work, what: str) -> None:
        self._work = work
        self._what = what

    def wait(self, timeout_s: float) -> None:
        try:
            self._work.wait(datetime.timedelta(seconds=timeout_s))
        except Exception as e:  # noqa: BLE001 - gloo raises RuntimeError subclasses with its own wording
            raise PeerError(f"{self._what} failed: {e}; did a peer exit, or is REFIT_TIMEOUT too short?") from None


class GlooTransport(BroadcastTransport):
    """A gloo group of the sender (rank 0) and every receiver; never the trainer's default group."""

    name = "gloo"
    device_type = "cpu"

    def _group(self, store: dist.Store) -> dist.ProcessGroup:
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = datetime.timedelta(seconds=self._settings.timeout_s)
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=self._host)]
        try:
            return dist.ProcessGroupGloo(dist.PrefixStore(self._prefix, store), self._rank, self._size, opts)
        except Exception as e:  # noqa: BLE001 - torch raises several types here; reported as PeerError with the cause
            raise PeerError(f"gloo group setup (rank {self._rank} of {self._size}) failed: {e}") from None

    def _pending(self, work: dist.Work, what: str) -> Pending:
        return _Work(work, what)
