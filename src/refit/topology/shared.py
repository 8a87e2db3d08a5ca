"""Shared sources: the engine side of a zero-copy epoch, the trainer's tensors opened once per epoch (SOURCES)
and read straight into the engine at each refit (BEGIN with ZERO_COPY, no bucket follows).

Over cuda-ipc the trainer's tensors are mapped from their IPC handles and copied in through `Engine.load`.
Over nixl they are READ one-sided: where the engine states a live tensor a READ may fill (`Engine.writable`:
contiguous, the wire dtype and shape), straight into it; every other tensor into a scratch buffer and then
through `Engine.load`. The engine's targets are registered once and again only when their layout moved, and
so is the READ's plan: one descriptor per run of tensors adjacent on both sides.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import torch

from refit.engines.base import Engine
from refit.errors import IntegrityError, PeerError
from refit.layout.manifest import Manifest
from refit.layout.packing import LayoutGuard, typed_view
from refit.layout.spec import TensorSpec
from refit.log import get_logger
from refit.protocol.wire import parse_json
from refit.transports.base import Pending

if TYPE_CHECKING:
    from refit.transports.nixl_tensors import Remote

Load = Callable[[list[tuple[str, torch.Tensor]]], None]
"""Loads named tensors into the engine (the receive path's load, which digests them for the fingerprint)."""
Wait = Callable[[Pending, str], None]
"""Waits for a transfer in flight, stopped early when the sender speaks or dies (the receive path's)."""
ALIGN = 64
log = get_logger("receiver")


class Sources(Protocol):
    """The trainer's tensors as this epoch shared them."""

    def take(self, load: Load, wait: Wait, stage: str) -> None:
        """Copy or READ every tensor into the engine; raises PeerError when the trainer is gone."""
        ...


class IpcSources:
    """The trainer's CUDA tensors mapped from their IPC handles; each refit copies them in through `load`."""

    def __init__(self, payload: bytes, m: Manifest, engine: Engine, device: torch.device) -> None:
        from refit.transports.cuda_ipc import open_tensor

        handles = parse_json(payload, "SOURCES").get("tensors")
        if not isinstance(handles, list) or len(handles) != len(m.entries):
            raise IntegrityError("SOURCES does not list one handle per manifest tensor")
        with torch.cuda.device(device):
            views = [open_tensor(h) for h in handles]
        for p, v in zip(m.entries, views):
            if tuple(v.shape) != p.spec.shape or v.dtype != p.spec.dtype:
                raise IntegrityError(f"shared tensor {p.name} does not match its manifest entry")
        self.tensors = [(p.name, v) for p, v in zip(m.entries, views)]

    def take(self, load: Load, wait: Wait, stage: str) -> None:
        load(self.tensors)


class NixlSources:
    """The trainer's tensors as a remote NIXL agent; each refit READs them all in one transfer."""

    def __init__(self, payload: bytes, m: Manifest, engine: Engine, device: torch.device) -> None:
        from refit.transports.nixl_tensors import Remote, Sources

        self.manifest, self.engine, self.device = m, engine, device
        self.remote = Remote(Sources.parse(parse_json(payload, "SOURCES"), [p.nbytes for p in m.entries]))
        self._plan: _Plan | None = None

    @property
    def descriptors(self) -> int:
        """How many descriptors each READ of this epoch takes (0 before the first refit)."""
        return self._plan.reads.descriptors if self._plan is not None else 0

    def take(self, load: Load, wait: Wait, stage: str) -> None:
        plan = self._planned()
        what = f"NIXL READ of {len(plan.indices)} tensor(s) in {plan.reads.descriptors} descriptor(s)"
        wait(self.remote.read(plan.indices, plan.targets, what, plan.reads), stage)
        if plan.staged:
            load(plan.staged)

    def _planned(self) -> _Plan:
        """This refit's plan: the last one while the engine's live targets kept their layout, else a new one
        (registering the targets again: a READ never lands in memory the engine let go)."""
        live = [self.engine.writable(p.name) for p in self.manifest.entries]
        plan = self._plan
        if plan is None or not plan.holds(live):
            self._plan = plan = None  # the old registration goes before the new one is made
            plan = self._plan = _Plan(self.manifest, live, self.device, self.remote)
            log.info(
                "zero-copy over nixl: %d tensor(s) READ in %d descriptor(s)", len(plan.indices), plan.reads.descriptors
            )
        return plan


class _Plan:
    """Where each trainer tensor lands: straight in the engine's live tensor, or staged in a scratch buffer and
    loaded from there. Holds the registration of both (and so the targets, whose memory stays registered), and
    the READ's descriptors over them."""

    def __init__(self, m: Manifest, live: list[torch.Tensor | None], device: torch.device, remote: Remote) -> None:
        from refit.transports.nixl_tensors import Targets

        self._slots = [t is not None for t in live]
        self._guard = LayoutGuard([t for t in live if t is not None])
        self.indices = [i for i, p in enumerate(m.entries) if p.nbytes]
        direct = {i: t for i in self.indices if (t := _direct(live[i], m.entries[i].spec, device)) is not None}
        at, size = {}, 0
        for i in self.indices:
            if i not in direct:
                at[i], size = size, size + -(-m.entries[i].nbytes // ALIGN) * ALIGN
        scratch = torch.empty(size, dtype=torch.uint8, device=device)
        self.targets = [
            direct[i] if i in direct else scratch[at[i] : at[i] + m.entries[i].nbytes] for i in self.indices
        ]
        self.staged = [
            (p.name, typed_view(scratch, at[i], p.nbytes, p.spec.dtype).view(p.spec.shape))
            for i, p in ((i, m.entries[i]) for i in self.indices if i not in direct)
        ]
        self._registered = Targets([*direct.values(), *([scratch] if size else [])])
        self.reads = remote.reads(self.indices, self.targets, self._registered)

    def holds(self, live: list[torch.Tensor | None]) -> bool:
        """Whether `live` are the very targets planned for, in the same layout."""
        slots = [t is not None for t in live]
        return slots == self._slots and self._guard.holds([t for t in live if t is not None])


def _direct(t: torch.Tensor | None, spec: TensorSpec, device: torch.device) -> torch.Tensor | None:
    """`t` when a READ may fill the engine's tensor in place: contiguous, exactly the wire dtype and shape, in the
    same kind of memory as the scratch buffer (one transfer reads into one kind); else None."""
    fits = (
        t is not None
        and t.is_contiguous()
        and t.dtype == spec.dtype
        and tuple(t.shape) == spec.shape
        and t.device.type == device.type
        and not t.is_neg()
        and not t.is_conj()
    )
    return t if fits else None


OPENERS: dict[str, Callable[[bytes, Manifest, Engine, torch.device], Sources]] = {
    "cuda-ipc": IpcSources,
    "nixl": NixlSources,
}
"""Per transport: how the engine opens the tensors a zero-copy epoch shares."""


def opened(transport: str, payload: bytes, m: Manifest, engine: Engine, device: torch.device) -> Sources:
    """The trainer's tensors as shared over `transport` for manifest `m`; PeerError for a transport that shares none."""
    opener = OPENERS.get(transport)
    if opener is None:
        raise PeerError(f"the sender shared its tensors (SOURCES) over {transport}, which cannot share them")
    return opener(payload, m, engine, device)
