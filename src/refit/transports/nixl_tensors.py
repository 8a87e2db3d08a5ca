"""nixl tensors: one-sided READs of the trainer's own tensors into the engine's (zero-copy over nixl).

The trainer registers its live tensors with its serving agent once per epoch (`Exposed`) and describes them:
the agent's metadata for that registration only, and per tensor (address, length, device). The engine checks
that description strictly (`Sources.parse`: bounded, typed, every range inside what the trainer's agent
registered, as NIXL itself answers) and per refit READs every tensor in one transfer (`Remote.read`) into
local tensors it registered (`Targets`), kept while their layout holds. Names, dtypes and manifests stay above
this module: it moves byte ranges between tensors.

Both sides register the union of their tensors' bytes as few regions (`regions`: ranges that touch or overlap
within one allocation join), since NIXL and UCX spend microseconds per descriptor and a descriptor must lie in
one registered region. The engine's READ (`Reads`) then takes one descriptor per run of tensors that follow
each other in memory on both sides (flat buffers, a caching allocator's packed segment).
"""

from __future__ import annotations

import base64
import binascii
import bisect
import ctypes
import functools
import weakref
from collections.abc import Callable, Sequence
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


Span = tuple[int, int, int]
"""(address, length, device): a byte range as NIXL describes it."""
Pair = tuple[Span, Span]
"""One tensor's (trainer range, engine range) in a READ."""


def regions(tensors: Sequence[torch.Tensor]) -> list[Span]:
    """The bytes of `tensors` as few regions to register, sorted: their union, where ranges that touch or
    overlap join only within one allocation (`_homes`), so no region covers a byte no tensor holds."""
    held = [t for t in tensors if t.nbytes]
    ends = sorted((_mem(t.device)[1], home, t.data_ptr(), t.data_ptr() + t.nbytes) for t, home in _homes(held))
    out: list[list[int]] = []
    for dev, home, start, end in ends:
        if out and out[-1][:2] == [dev, home] and start <= out[-1][3]:
            out[-1][3] = max(out[-1][3], end)
        else:
            out.append([dev, home, start, end])
    return [(start, end - start, dev) for dev, _, start, end in out]


def _homes(tensors: list[torch.Tensor]) -> list[tuple[torch.Tensor, int]]:
    """Each tensor with its allocation: on a GPU the driver's (a caching allocator's segment, which UCX maps
    whole; a region across two would not map), else, or where the driver does not say, its storage's."""
    homes = [t.untyped_storage().data_ptr() for t in tensors]
    address_range = _cu_address_range()
    for device in {t.device for t in tensors if t.is_cuda} if address_range is not None else ():
        with torch.cuda.device(device):
            torch.cuda.current_stream().query()  # binds the device's context to this thread, as the driver needs
            for i, t in enumerate(tensors):
                base, size = ctypes.c_uint64(), ctypes.c_size_t()
                if t.device == device and address_range(ctypes.byref(base), ctypes.byref(size), t.data_ptr()) == 0:
                    homes[i] = base.value  # within this allocation: equal to no other allocation's storage
    return list(zip(tensors, homes))


@functools.cache
def _cu_address_range() -> Any:
    """The CUDA driver's cuMemGetAddressRange, or None without a driver."""
    try:
        fn = ctypes.CDLL("libcuda.so.1").cuMemGetAddressRange_v2
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t), ctypes.c_uint64]
    fn.restype = ctypes.c_int
    return fn


def _register(owner: Agent, tensors: list[torch.Tensor], mem: str) -> tuple[_Keeper, Any, list[Span]]:
    """Register the memory of `tensors` (pinned for READs) as `regions`, deregistered when the returned keeper
    dies; the keeper, the registration handle (None for no bytes) and the regions."""
    spans = regions(tensors)
    handle = owner.register(owner.nixl.get_reg_descs([(*s, "") for s in spans], mem)) if spans else None
    keeper = _Keeper(tensors)
    if handle is not None:
        weakref.finalize(keeper, owner.deregister, handle)
    return keeper, handle, spans


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
        self._keeper, handle, self.regions = _register(serving, [t for t in tensors if t.nbytes], mem)
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

    def _registered(self, spans: list[Span]) -> bool:
        """Whether NIXL finds each of `spans` inside one region the trainer's agent registered."""
        with self._agent.lock:
            descs = self._agent.nixl.get_xfer_descs(spans, self.sources.mem)
            return bool(self._agent.nixl.check_remote_metadata(self.sources.agent, descs))

    def reads(self, indices: Sequence[int], targets: Sequence[torch.Tensor], local: Targets | None) -> Reads:
        """The descriptors of one READ of the trainer's tensors `indices` into `targets`: one per run of tensors
        that follow each other on both sides, inside one region `local` registered and one the trainer did
        (as NIXL answers; a run it does not is split until each piece is). Without `local`, one per tensor."""
        if not indices:
            return Reads(None, None, 0, "DRAM")
        mem = _mem(targets[0].device)[0]
        region = functools.partial(local.region, mem) if local is not None else lambda span: None
        runs = _runs([(self.sources.ranges[i], _span(t)) for i, t in zip(indices, targets)], region)
        joined = [_joined(r) for r in runs if len(r) > 1]
        if joined and not self._registered([remote for remote, _ in joined]):
            runs = [piece for run in runs for piece in self._split(run)]
        nixl = self._agent.nixl
        remote = nixl.get_xfer_descs([_joined(r)[0] for r in runs], self.sources.mem)
        return Reads(nixl.get_xfer_descs([_joined(r)[1] for r in runs], mem), remote, len(runs), mem)

    def _split(self, run: list[Pair]) -> list[list[Pair]]:
        """`run` in pieces each inside one region the trainer registered (a single tensor is: checked at SOURCES)."""
        if len(run) == 1 or self._registered([_joined(run)[0]]):
            return [run]
        half = len(run) // 2
        return self._split(run[:half]) + self._split(run[half:])

    def read(
        self, indices: Sequence[int], targets: Sequence[torch.Tensor], what: str, reads: Reads | None = None
    ) -> Pending:
        """Start one READ of the trainer's tensors `indices` into `targets` (registered: `Targets`), in order;
        `reads`: what `reads` made of these same indices and targets (else one descriptor per tensor)."""
        if not indices:
            return DONE
        plan = reads if reads is not None else self.reads(indices, targets, None)
        reading, nixl = self._agent, self._agent.nixl
        try:
            with reading.lock:
                handle = nixl.initialize_xfer("READ", plan.local, plan.remote, self.sources.agent)
                state = nixl.transfer(handle)
        except Exception as e:  # noqa: BLE001 - NIXL's own error types (a disconnected peer among them)
            raise PeerError(f"{what} from {self.sources.agent} failed: {type(e).__name__}: {e}") from None
        return _Read(reading, handle, str(state), f"{what} from {self.sources.agent}", MAX_POLL_SLEEP_S[plan.mem])


@dataclass(frozen=True, slots=True)
class Reads:
    """One READ's descriptor lists (engine side, trainer side), made once and posted at every refit."""

    local: Any
    remote: Any
    descriptors: int
    """How many descriptors the READ takes (each costs NIXL and UCX microseconds, whatever its bytes)."""
    mem: str


def _span(t: torch.Tensor) -> Span:
    return t.data_ptr(), t.nbytes, _mem(t.device)[1]


def _runs(pairs: list[Pair], region: Callable[[Span], int | None]) -> list[list[Pair]]:
    """`pairs` in the trainer's address order, grouped into runs where both sides follow on (same device, no
    gap) and the engine's ranges lie in one of its registered regions (`region`)."""
    runs: list[list[Pair]] = []
    last: int | None = None
    for remote, local in sorted(pairs, key=lambda p: (p[0][2], p[0][0])):
        here = region(local)
        if runs and here is not None and here == last and _follows(runs[-1][-1], (remote, local)):
            runs[-1].append((remote, local))
        else:
            runs.append([(remote, local)])
        last = here
    return runs


def _follows(a: Pair, b: Pair) -> bool:
    return all(x[2] == y[2] and x[0] + x[1] == y[0] for x, y in zip(a, b))


def _joined(run: list[Pair]) -> Pair:
    """The one (trainer, engine) range a run covers."""
    (remote, local), size = run[0], sum(r[1] for r, _ in run)
    return (remote[0], size, remote[2]), (local[0], size, local[2])


class Targets:
    """Local tensors registered for READs (the engine's live tensors, a scratch buffer) as few regions;
    deregistered when this object goes. Whoever holds it re-registers (a new Targets) when the tensors move."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        groups: dict[str, list[torch.Tensor]] = {}
        for t in tensors:
            groups.setdefault(_mem(t.device)[0], []).append(t)
        self._keepers = []
        self._regions: list[tuple[str, int, int, int]] = []
        for mem, group in groups.items():
            keeper, _, spans = _register(agent(READING), group, mem)
            self._keepers.append(keeper)
            self._regions += [(mem, dev, addr, addr + length) for addr, length, dev in spans]
        self._regions.sort()

    def region(self, mem: str, span: Span) -> int | None:
        """The registered region holding all of `span` in memory of type `mem`, by number; None if none does."""
        addr, length, dev = span
        at = bisect.bisect_right(self._regions, (mem, dev, addr, 1 << 65)) - 1
        if at < 0:
            return None
        kind, on, start, end = self._regions[at]
        return at if (kind, on) == (mem, dev) and start <= addr and addr + length <= end else None
