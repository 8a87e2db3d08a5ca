"""gloo transport: disaggregated CPU processes; the sender broadcasts each bucket over a dedicated gloo group."""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable

import torch.distributed as dist

from refit.errors import PeerError
from refit.transports.base import INTERRUPT_EVERY_S, Interrupted, Pending
from refit.transports.group import BroadcastTransport


class _Work(Pending):
    def __init__(self, work: dist.Work, what: str) -> None:
        self._work = work
        self._what = what

    def wait(self, timeout_s: float, interrupted: Callable[[], bool] | None = None) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            step = left if interrupted is None else min(INTERRUPT_EVERY_S, left)
            try:  # at least 1 ms: a zero timeout would be torch's "no timeout"
                self._work.wait(datetime.timedelta(seconds=max(step, 1e-3)))
                return
            except Exception as e:  # noqa: BLE001 - gloo raises RuntimeError subclasses with its own wording
                if self._work.is_completed():  # failed, or done just after the slice ran out: its own outcome
                    self._outcome()
                    return
                if time.monotonic() >= deadline:
                    raise self._failed(e) from None
            if interrupted is not None and interrupted():
                raise Interrupted(f"{self._what} was interrupted")

    def _outcome(self) -> None:
        """A completed operation's result: returns, or raises its error as PeerError."""
        try:
            self._work.wait()
        except Exception as e:  # noqa: BLE001 - as above
            raise self._failed(e) from None

    def _failed(self, e: Exception) -> PeerError:
        return PeerError(f"{self._what} failed: {e}; did a peer exit, or is REFIT_TIMEOUT too short?")


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

    def arrived(self) -> set[int] | None:
        store = self._store
        if store is None:
            return None
        # gloo's rendezvous: each rank sets its address under "<device index>/<rank>" (one device here)
        ranks = {r for r in range(self._size) if store.check([f"{self._prefix}/0/{r}"])}
        return ranks if 0 in ranks else None  # not even rank 0's own: another torch's key scheme, unknown
