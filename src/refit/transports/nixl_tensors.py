"""nixl tensors: one-sided READs of the trainer's own tensors into the engine's (zero-copy over nixl).

The trainer registers its live tensors with its serving agent once per epoch (`Exposed`) and describes them:
the agent's metadata for that registration only, and per tensor (address, length, device). The engine checks
that description strictly (`Sources.parse`: bounded, typed, every range inside what the trainer's agent
registered, as NIXL itself answers) and per refit READs every tensor in one transfer (`Sources.read`) into
local tensors it registered (`Targets`), kept while their layout holds. Names, dtypes and manifests stay above
this module: it moves byte ranges between tensors.
"""

from __future__ import annotations

import base64
import binascii
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from refit.errors import PeerError
from refit.transports.base import DONE, Pending
from refit.transports.nixl import MAX_POLL_SLEEP_S, READING, SERVING, Agent, _count, _mem, _Read, agent

MAX_METADATA_BYTES = 16 << 20
"""Largest agent metadata a trainer may announce (a registration of one tensor list is kilobytes)."""
MAX_AGENT_NAME = 256
MAX_DEVICE = 1 << 16


def _memory(tensors: Sequence[torch.Tensor]) -> tuple[str, list[int]]:
    """NIXL's memory type shared by `tensors` and each one's device id; ValueError when they mix types."""
    kinds = [_mem(t.device) for t in tensors]
    types = {k for k, _ in kinds}
    if len(types) > 1:
        raise ValueError(f"zero_copy over nixl needs every tensor in one kind of memory, not {sorted(types)}")
    return (types.pop() if types else "DRAM"), [d for _, d in kinds]


def _register(owner: Agent, tensors: list[torch.Tensor]) -> Any:
    """Register `tensors` (their memory pinned for READs) and deregister them when the returned keeper dies."""
    handle = owner.register(tensors) if tensors else None
    keeper = _Keeper(tensors)
    if handle is not None:
        weakref.finalize(keeper, owner.deregister, handle)
    return keeper, handle


class _Keeper:
    """Holds registered tensors alive (their memory can never be reused while registered); its death deregisters."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.tensors = tensors


class Exposed:
    """The trainer's tensors registered for one epoch; `info` is what each engine needs to READ them. They are
    kept referenced (so never freed, nor their memory reused) and deregistered when this object goes."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        bad = [i for i, t in enumerate(tensors) if not t.is_contiguous()]
        if bad:
            raise ValueError(f"zero_copy over nixl needs contiguous tensors (not so at positions {bad[:5]})")
        mem, devices = _memory(tensors)
        serving = agent(SERVING)
        held = [t for t in tensors if t.nbytes]
        self._keeper, handle = _register(serving, held)
        metadata = serving.metadata(handle) if handle is not None else b""
        self.info = {
            "agent": serving.name,
            "metadata": base64.b64encode(metadata).decode(),
            "mem": mem,
            "tensors": [[t.data_ptr(), t.nbytes, d] for t, d in zip(tensors, devices)],
        }


@dataclass(frozen=True, slots=True)
class Sources:
    """What a trainer announced of its tensors: its agent, and one (address, length, device) per tensor."""

    agent: str
    metadata: bytes
    mem: str
    ranges: list[tuple[int, int, int]]

    @classmethod
    def parse(cls, info: object, sizes: Sequence[int]) -> Sources:
        """`info` as the trainer sent it, checked field by field; `sizes`: the bytes each tensor must have."""
        if not isinstance(info, dict) or set(info) != {"agent", "metadata", "mem", "tensors"}:
            raise PeerError("SOURCES over nixl must be an object of agent, metadata, mem and tensors only")
        name, meta, mem, tensors = info["agent"], info["metadata"], info["mem"], info["tensors"]
        if not (isinstance(name, str) and 0 < len(name) <= MAX_AGENT_NAME) or mem not in ("DRAM", "VRAM"):
            raise PeerError(f"SOURCES over nixl names an invalid agent or memory type ({mem!r:.20})")
        if not isinstance(meta, str) or len(meta) > MAX_METADATA_BYTES * 4 // 3 + 4:
            raise PeerError(
                f"SOURCES over nixl carries metadata that is not a string of at most {MAX_METADATA_BYTES} B"
            )
        try:
            metadata = base64.b64decode(meta, validate=True)
        except (binascii.Error, ValueError):
            raise PeerError("SOURCES over nixl carries metadata that is not base64") from None
        if not isinstance(tensors, list) or len(tensors) != len(sizes):
            raise PeerError(f"SOURCES over nixl must list {len(sizes)} tensors, one per manifest entry")
        ranges = [_range(r, n, i) for i, (r, n) in enumerate(zip(tensors, sizes))]
        return cls(name, metadata, mem, ranges)


def _range(r: object, size: int, i: int) -> tuple[int, int, int]:
    ok = isinstance(r, list) and len(r) == 3 and all(map(_count, r))
    if not ok:
        raise PeerError(f"SOURCES over nixl: tensor {i} is not [address, length, device] of unsigned integers")
    addr, length, dev = r  # type: ignore[misc]
    if length != size or addr + length > 1 << 64 or dev >= MAX_DEVICE or (length and not addr):
        raise PeerError(
            f"SOURCES over nixl: tensor {i} at {addr:#x} of {length} B on device {dev} is not the {size} B its "
            "manifest entry holds, or lies outside the address space"
        )
    return addr, length, dev


class Remote:
    """The engine's view of an epoch's trainer tensors: the trainer's agent loaded, every announced range
    checked against what that agent registered. Forgets the agent when it goes."""

    def __init__(self, sources: Sources) -> None:
        self.sources = sources
        self._agent = reading = agent(READING)
        try:
            name = reading.attach(sources.metadata)
        except Exception as e:  # noqa: BLE001 - NIXL's own error types; reported as the peer's with the cause
            raise PeerError(f"cannot add the trainer's NIXL agent {sources.agent}: {type(e).__name__}: {e}") from None
        weakref.finalize(self, reading.detach, name)
        if name != sources.agent:
            raise PeerError(f"the trainer's NIXL metadata names agent {name!r}, its SOURCES {sources.agent!r}")
        self.used = [i for i, (_, length, _) in enumerate(sources.ranges) if length]
        with reading.lock:
            known = not self.used or reading.nixl.check_remote_metadata(name, self._descs(self.used))
        if not known:
            raise PeerError(
                f"SOURCES names memory the trainer's NIXL agent {name} did not register; refusing to read it"
            )

    def _descs(self, indices: Sequence[int]) -> Any:
        return self._agent.nixl.get_xfer_descs([self.sources.ranges[i] for i in indices], self.sources.mem)

    def read(self, indices: Sequence[int], targets: Sequence[torch.Tensor], what: str) -> Pending:
        """Start one READ of the trainer's tensors `indices` into `targets` (registered: `Targets`), in order."""
        if not indices:
            return DONE
        reading, nixl = self._agent, self._agent.nixl
        try:
            with reading.lock:
                handle = nixl.initialize_xfer(
                    "READ", nixl.get_xfer_descs(list(targets)), self._descs(indices), self.sources.agent
                )
                state = nixl.transfer(handle)
        except Exception as e:  # noqa: BLE001 - NIXL's own error types (a disconnected peer among them)
            raise PeerError(f"{what} from {self.sources.agent} failed: {type(e).__name__}: {e}") from None
        mem = _mem(targets[0].device)[0]
        return _Read(reading, handle, str(state), f"{what} from {self.sources.agent}", MAX_POLL_SLEEP_S[mem])


class Targets:
    """Local tensors registered for READs (the engine's live tensors, a scratch buffer); deregistered when this
    object goes. Whoever holds it re-registers (a new Targets) when the tensors move."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        groups: dict[str, list[torch.Tensor]] = {}
        for t in tensors:
            groups.setdefault(_mem(t.device)[0], []).append(t)
        self._keepers = [_register(agent(READING), g)[0] for g in groups.values()]
