"""Planner: lays tensor specs out in fixed-capacity buckets (pure; no memory is touched)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass

from refit.dtypes import dtype_name
from refit.layout.manifest import Manifest, Placement, gc_paused
from refit.layout.spec import TensorSpec
from refit.settings import DEFAULT_ALIGNMENT  # defined there: Settings refuses a smaller bucket


def align_up(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment


def plan(
    specs: Iterable[TensorSpec],
    *,
    capacity: int,
    alignment: int = DEFAULT_ALIGNMENT,
    epoch: int = 0,
    stages: tuple[str, ...] = (),
) -> Manifest:
    """Place `specs` in name order into buckets of `capacity` bytes.

    Each tensor starts at a multiple of `alignment`. A tensor that does not fit in the rest of the
    current bucket starts the next one; a tensor larger than a whole bucket starts a fresh bucket and
    runs on through as many following buckets as it needs. `stages`: what every refit of it passes through.
    """
    if alignment < 8 or alignment & (alignment - 1):
        raise ValueError(f"alignment ({alignment}) must be a power of two >= 8")
    if capacity < alignment or capacity % alignment:
        raise ValueError(f"bucket capacity ({capacity}) must be a positive multiple of the alignment ({alignment})")
    with gc_paused():
        return _place(sorted(specs, key=lambda s: s.name), capacity, alignment, epoch, stages)


def _place(
    ordered: list[TensorSpec], capacity: int, alignment: int, epoch: int, stages: tuple[str, ...] = ()
) -> Manifest:
    """`plan` for specs already sorted by name."""
    for a, b in zip(ordered, ordered[1:]):
        if a.name == b.name:
            raise ValueError(f"tensor name {a.name!r} appears twice; names must be unique")
    entries: list[Placement] = []
    used: list[int] = [0]
    for spec in ordered:
        n = spec.nbytes
        at = align_up(used[-1], alignment)
        if (n > capacity - at or at >= capacity) and used[-1] > 0:
            used.append(0)
            at = 0
        entries.append(Placement(spec, len(used) - 1, at))
        while n > capacity - at:
            used[-1] = capacity
            n -= capacity - at
            used.append(0)
            at = 0
        used[-1] = at + n
    sizes = tuple(align_up(u, alignment) for u in used) if entries else ()
    return Manifest(capacity, alignment, tuple(entries), sizes, epoch=epoch, stages=stages)


def specs_digest(specs: Iterable[TensorSpec]) -> str:
    """Hex digest of the names (aliases included), shapes and dtypes alone, in name order: equal for two
    runs of one model whatever their bucket capacity (which the manifest digest covers too)."""
    rows = sorted([s.name, list(s.shape), dtype_name(s.dtype), list(s.aliases)] for s in specs)
    text = json.dumps(rows, separators=(",", ":"))
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


@dataclass(frozen=True, slots=True)
class MemoryForecast:
    """Bytes refit allocates or maps on each side, beyond the model itself (touched or not).

    The buffers are `num_slots` x capacity on each side whatever the transport; only how they are held
    differs: shm maps one shared segment per slot on both sides; gloo and nccl allocate them on both
    sides; cuda-ipc allocates them on the sender and maps them (IPC handles) on each receiver.
    """

    sender_bytes: int
    """Bucket buffers on the sender."""
    receiver_bytes: int
    """Bucket buffers on each receiver plus the staging tensor for bucket-spanning tensors."""


def forecast(manifest: Manifest, *, num_slots: int) -> MemoryForecast:
    """Bytes each side allocates or maps for `manifest` with `num_slots` buffers per side (what
    `refit.tools.bench.memory.MemoryProbe` measures)."""
    buffers = num_slots * manifest.capacity
    return MemoryForecast(sender_bytes=buffers, receiver_bytes=buffers + manifest.max_split_nbytes)
