"""Zero-copy path: the trainer side's other data path for an epoch, chosen once when the Sender is built.

Nothing is packed and no bucket moves: the source's live tensors are shared once per epoch (SOURCES) and every
receiver copies or READs straight from them. How they are shared is the transport's: CUDA IPC handles
(cuda-ipc), or the tensors registered with the NIXL agent and described for one-sided READs (nixl). The
fingerprint's digests are taken from the live tensors after the receivers read them (`DigestPlan.take_all`).
Any move of a source tensor (storage, strides), not only a changed spec, starts a new epoch: what was shared
points at the old memory.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from refit.layout.manifest import Manifest
from refit.protocol.wire import Begin, Header, Kind
from refit.sources.base import Source
from refit.topology.digest_plan import DigestPlan
from refit.topology.send_path import SendPath
from refit.topology.stats import RefitStats


@dataclass(frozen=True, slots=True)
class Shared:
    """An epoch's source tensors as shared: the SOURCES payload, and what must live as long as the epoch (the
    NIXL registration, which also keeps the tensors' memory from being reused)."""

    payload: dict
    keep: Any = None


class ZeroCopyPath(SendPath):
    """Shares the source tensors once per epoch (`share`); each refit then only begins and verifies."""

    flags = Begin.ZERO_COPY
    in_place = True
    restarts_on_move = True
    _shared: Shared | None = None

    @classmethod
    def check(cls, source: Source) -> None:
        if not source.stable_tensors:
            raise ValueError("zero_copy needs a source whose tensors persist between refits (not a gathering one)")

    def share(self, source: Source) -> None:
        """Export the source tensors over the session's transport, and wait until every receiver opened them."""
        m = self.manifest
        tensors = source.tensors([p.name for p in m.entries])
        self._shared = SHARERS[self.transport.name](tensors, m)
        for ch in self.channels:
            ch.send(Header(Kind.SOURCES, epoch=m.epoch, digest=m.digest), self._shared.payload)
        for ch in self.channels:
            ch.expect(Kind.READY, f"opening the source tensors shared over {self.transport.name}")

    def ready(self, device: torch.device) -> None:
        if device.type == "cuda":  # the optimizer's writes must be done before receivers read the tensors
            torch.cuda.current_stream(device).synchronize()

    def _carry(
        self, source: Source, version: int, stats: RefitStats, generation: int, verify_checksum: bool
    ) -> list[str]:
        stats.full_bytes = 0
        return []

    def _digest_all(self, source: Source, digests: DigestPlan, generation: int) -> None:
        digests.take_all(source, generation)


def _wrong(tensors: list[torch.Tensor], m: Manifest, fits: Callable[[torch.Tensor], bool]) -> list[str]:
    return [
        p.name for p, t in zip(m.entries, tensors) if not (fits(t) and t.is_contiguous() and t.dtype == p.spec.dtype)
    ]


def _over_ipc(tensors: list[torch.Tensor], m: Manifest) -> Shared:
    from refit.transports.cuda_ipc import export

    bad = _wrong(tensors, m, lambda t: t.is_cuda)
    if bad:
        raise ValueError(
            f"zero_copy needs contiguous CUDA tensors already in their wire dtype; not so: {bad[:5]}. "
            "Use zero_copy=False (packing casts on the way)."
        )
    return Shared({"tensors": [export(t) for t in tensors]})


def _over_nixl(tensors: list[torch.Tensor], m: Manifest) -> Shared:
    from refit.transports.nixl_tensors import Exposed

    bad = _wrong(tensors, m, lambda t: t.device.type in ("cpu", "cuda"))
    if bad:
        raise ValueError(
            f"zero_copy over nixl needs contiguous CPU or CUDA tensors already in their wire dtype; not so: "
            f"{bad[:5]}. Use zero_copy=False (packing casts on the way)."
        )
    exposed = Exposed(tensors)
    return Shared(exposed.info, keep=exposed)


SHARERS: dict[str, Callable[[list[torch.Tensor], Manifest], Shared]] = {"cuda-ipc": _over_ipc, "nixl": _over_nixl}
"""Per transport: how an epoch's source tensors are shared (the SOURCES payload, and what must live as long)."""
