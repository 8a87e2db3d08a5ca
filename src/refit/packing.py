"""Packing: tensors into bucket buffers as aligned byte ranges, and zero-copy views back out."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from refit.manifest import Manifest, Segment

_foreach_copy = getattr(torch, "_foreach_copy_", None)


def typed_view(buf: torch.Tensor, at: int, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
    """A 1-D view of `nbytes` of the uint8 `buf` from byte `at`, reinterpreted as `dtype`."""
    return buf[at : at + nbytes].view(dtype)


def _batchable(dst: list[torch.Tensor], src: list[torch.Tensor]) -> bool:
    return _foreach_copy is not None and all(d.dtype == s.dtype and d.device == s.device for d, s in zip(dst, src))


def copy_all(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """dst[i].copy_(src[i]) for all i, batched into few kernel launches where torch can."""
    if dst:
        CopyPlan(dst, src).run()


class CopyPlan:
    """A fixed set of copies, checked once and replayed (batched when dtypes and devices agree)."""

    def __init__(self, dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
        self.dst, self.src = dst, src
        self.batched = _batchable(dst, src)

    def run(self) -> None:
        if self.batched:
            _foreach_copy(self.dst, self.src)
            return
        for d, s in zip(self.dst, self.src):
            d.copy_(s)


class Packer:
    """Writes source tensors into a bucket buffer, casting to the wire dtype in the same pass.

    The copy plan of each (bucket, slot) is built once and replayed while the source tensors keep
    their storage (checked by data pointer, so a reassigned `param.data` is noticed).
    """

    def __init__(self, manifest: Manifest, buffers: Sequence[torch.Tensor]) -> None:
        self.manifest = manifest
        self._buffers = buffers
        self._plans: dict[tuple[int, int], tuple[tuple[int, ...], CopyPlan]] = {}

    def _targets(self, bucket: int, slot: int) -> list[torch.Tensor]:
        buf, entries = self._buffers[slot], self.manifest.entries
        return [typed_view(buf, s.at, s.hi - s.lo, entries[s.entry].spec.dtype) for s in self.manifest.segments[bucket]]

    def pack(self, bucket: int, slot: int, tensors: Sequence[torch.Tensor], *, cache: bool = True) -> None:
        """Fill `slot`'s buffer with bucket `bucket`; `tensors[k]` is the source of the bucket's k-th segment.
        With `cache=False` (fresh tensors each time, e.g. gathered) nothing keeps them alive afterwards."""
        ptrs = tuple(t.data_ptr() for t in tensors)
        hit = self._plans.get((bucket, slot)) if cache else None
        if hit is None or hit[0] != ptrs:
            segs, entries = self.manifest.segments[bucket], self.manifest.entries
            srcs = [_source_range(t.detach(), s, entries[s.entry].spec.dtype.itemsize) for t, s in zip(tensors, segs)]
            hit = (ptrs, CopyPlan(self._targets(bucket, slot), srcs))
            if cache:
                self._plans[(bucket, slot)] = hit
        hit[1].run()


def _source_range(t: torch.Tensor, seg: Segment, itemsize: int) -> torch.Tensor:
    flat = t.reshape(-1)
    if seg.lo == 0 and seg.hi == flat.numel() * itemsize:
        return flat
    return flat[seg.lo // itemsize : seg.hi // itemsize]


class Unpacker:
    """Turns a received bucket buffer into (name, tensor) pairs: views into the buffer, no copies.

    A tensor spanning several buckets is gathered into one staging tensor, allocated once, and handed
    out when its last bucket arrives.
    """

    def __init__(self, manifest: Manifest, buffers: Sequence[torch.Tensor]) -> None:
        self.manifest = manifest
        self._buffers = buffers
        device = buffers[0].device if buffers else torch.device("cpu")
        self._staging = torch.empty(manifest.max_split_nbytes, dtype=torch.uint8, device=device)
        self._plans: dict[tuple[int, int], _BucketPlan] = {}

    def unpack(self, bucket: int, slot: int) -> list[tuple[str, torch.Tensor]]:
        """The tensors complete after bucket `bucket`, which sits in `slot`'s buffer."""
        key = (bucket, slot)
        if key not in self._plans:
            self._plans[key] = self._build(bucket, slot)
        plan = self._plans[key]
        for dst, src in plan.staged:
            dst.copy_(src)
        return plan.ready

    def _build(self, bucket: int, slot: int) -> _BucketPlan:
        buf, m = self._buffers[slot], self.manifest
        plan = _BucketPlan([], [])
        for s in m.segments[bucket]:
            spec = m.entries[s.entry].spec
            if s.lo == 0 and s.hi == spec.nbytes:
                plan.ready.append((spec.name, typed_view(buf, s.at, spec.nbytes, spec.dtype).view(spec.shape)))
                continue
            plan.staged.append((self._staging[s.lo : s.hi], buf[s.at : s.at + s.hi - s.lo]))
            if m.last_bucket[s.entry] == bucket:
                plan.ready.append((spec.name, typed_view(self._staging, 0, spec.nbytes, spec.dtype).view(spec.shape)))
        return plan


@dataclass(slots=True)
class _BucketPlan:
    ready: list[tuple[str, torch.Tensor]]
    staged: list[tuple[torch.Tensor, torch.Tensor]]
