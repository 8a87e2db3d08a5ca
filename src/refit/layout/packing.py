"""Packing: tensors into bucket buffers as aligned byte ranges, and zero-copy views back out."""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from refit.layout.manifest import Manifest
from refit.layout.tensor_guard import layout_snapshot, tensor_guard

_foreach_copy = getattr(torch, "_foreach_copy_", None)


def copy_share(transport: str) -> contextlib.AbstractContextManager:
    """Where copies overlap a broadcast on the same device (nccl), copy plans made inside leave it memory
    bandwidth (`copy_kernel.sharing_device`); elsewhere they take the whole device."""
    if transport != "nccl":
        return contextlib.nullcontext()
    from refit.layout.copy_kernel import sharing_device

    return sharing_device()


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
    """A fixed set of copies, planned once and replayed as one batched copy (`refit.layout.copy_kernel`): on
    CUDA a kernel walking a chunk table built here, elsewhere `_foreach_copy_`. The plan holds the
    tensors' addresses, so it is valid only while they keep their storage and layout: rebuild it then."""

    def __init__(self, dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
        from refit.layout.copy_kernel import BatchedCopy  # here, so `import refit` does not import Triton

        self.dst, self.src = dst, src
        self._copy = BatchedCopy(dst, src)

    def run(self) -> None:
        self._copy.run()


LayoutKey = tuple
"""What a cached copy plan depends on, per source tensor: storage address, dtype, shape and strides."""


_dtype = operator.attrgetter("dtype")


def layout_key(tensors: Sequence[torch.Tensor]) -> LayoutKey:
    """Changes whenever any tensor is replaced, moved, reshaped, restrided, recast or turned into a lazily
    negated or conjugated view of the same memory; reads metadata only, one C call per field for all
    tensors (about 0.5 us a tensor)."""
    T = torch.Tensor
    return (
        tuple(map(T.data_ptr, tensors)),
        tuple(map(T.size, tensors)),
        tuple(map(T.stride, tensors)),
        tuple(map(_dtype, tensors)),
        tuple(map(T.is_neg, tensors)),
        tuple(map(T.is_conj, tensors)),
    )


class LayoutGuard:
    """A snapshot of what `layout_key` covers, checked again by `holds` in one C pass where the compiled helper
    is built (`refit.layout.tensor_guard.layout_snapshot`: type, storage, address, dtype, device, dispatch keys,
    shape and strides, not the objects' identity: a fresh view of the same memory holds); else addresses in
    one C pass and shapes, strides, dtypes and devices in one more (`tensor_guard`); else `layout_key` itself."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self._num = len(tensors)
        self._same = layout_snapshot(tensors, identity=False)
        self._ptrs = tuple(map(torch.Tensor.data_ptr, tensors)) if self._same is None else ()
        self._check = tensor_guard(tensors) if self._same is None else None
        self._key = layout_key(tensors) if self._same is None and self._check is None else None

    def holds(self, tensors: Sequence[torch.Tensor]) -> bool:
        """True only when every tensor has the address, dtype, device, shape and strides it had at the snapshot."""
        if self._same is not None:
            return self._same(tensors)
        if len(tensors) != self._num or tuple(map(torch.Tensor.data_ptr, tensors)) != self._ptrs:
            return False
        if self._check is None:
            return layout_key(tensors) == self._key
        return self._check(*tensors)  # it fails for a tensor of another type (probed), so no plain() here


class Packer:
    """Writes source tensors into a bucket buffer, casting to the wire dtype in the same pass.

    The copy plan of each (bucket, slot) reads the source tensors through views of their storage, so
    a replayed plan always copies their current values. It is replayed only while `layout_key` of the
    tensors is unchanged: a tensor replaced, moved to new storage, reshaped or restrided gets a new plan.
    """

    def __init__(
        self, manifest: Manifest, buffers: Sequence[torch.Tensor], *, digesting: Callable | None = None
    ) -> None:
        """`digesting(dst, src)`: a copy plan whose `run()` copies and returns the digest of each dst after the
        copy (`refit.checks.copy_digest.FusedCopy`); with it, each pack leaves in `digests` the digest of every
        segment's bytes in the bucket (the wire bytes), read as they are written."""
        self.manifest = manifest
        self._buffers = buffers
        self._digesting = digesting
        self.digests: torch.Tensor | None = None
        """With `digesting`: the last pack's digest of each of its bucket's segments, in segment order."""
        self._plans: dict[tuple[int, int], _PackPlan] = {}
        self._places: dict[tuple[int, int], tuple] = {}

    def pack(
        self,
        bucket: int,
        slot: int,
        tensors: Sequence[torch.Tensor],
        *,
        cache: bool = True,
        generation: int | None = None,
    ) -> None:
        """Fill `slot`'s buffer with bucket `bucket`; `tensors[k]` is the source of the bucket's k-th segment.
        With `cache=False` (fresh tensors each time, e.g. gathered) nothing keeps them alive afterwards.
        `generation`: the caller vouches that no source tensor's layout changed since a plan made in the
        same generation (it checked every tensor's layout at once); otherwise this bucket's are checked."""
        if not cache and self._digesting is None and self._in_place(bucket, slot, tensors):
            return  # every tensor already is its bytes in this slot's buffer (gathered there: refit.sources.fsdp)
        hit = self._plans.get((bucket, slot)) if cache else None
        if hit is None or generation is None or hit.generation != generation:
            key = layout_key(tensors) if cache else None
            if hit is None or hit.key != key:
                hit = self._build(bucket, slot, tensors, key)
                if cache:
                    self._plans[(bucket, slot)] = hit
            hit.generation = generation
        self.digests = hit.run()

    def _in_place(self, bucket: int, slot: int, tensors: Sequence[torch.Tensor]) -> bool:
        """True when each tensor is the contiguous view of its own segment of `slot`'s buffer, in the wire dtype:
        its values are then already in place. A few C calls for all tensors, no per-tensor Python."""
        key = (bucket, slot)
        where = self._places.get(key)
        if where is None:
            where = self._places[key] = _places(self.manifest, bucket, self._buffers[slot])
        if where[0] is None or len(tensors) != len(where[0]):
            return False
        T = torch.Tensor
        return (
            tuple(map(T.data_ptr, tensors)) == where[0]
            and tuple(map(T.numel, tensors)) == where[1]
            and tuple(map(_dtype, tensors)) == where[2]
            and all(map(T.is_contiguous, tensors))
            and not any(map(T.is_neg, tensors))
            and not any(map(T.is_conj, tensors))
        )

    def replay(self, bucket: int, slot: int, generation: int) -> bool:
        """Run the cached plan of (bucket, slot) if it was made or checked in `generation` (the caller vouches
        that no source tensor changed since); False, doing nothing, when `pack` must be called instead."""
        hit = self._plans.get((bucket, slot))
        if hit is None or hit.generation != generation:
            return False
        self.digests = hit.run()
        return True

    def _build(self, bucket: int, slot: int, tensors: Sequence[torch.Tensor], key: LayoutKey | None) -> _PackPlan:
        buf, entries, digesting = self._buffers[slot], self.manifest.entries, self._digesting
        dst, src, fresh = [], [], []
        for t, s in zip(tensors, self.manifest.segments[bucket]):
            spec, t = entries[s.entry].spec, t.detach()
            target = typed_view(buf, s.at, s.hi - s.lo, spec.dtype)
            whole = s.lo == 0 and s.hi == spec.nbytes
            if t.is_contiguous():
                flat = t.view(-1)[s.lo // spec.dtype.itemsize : s.hi // spec.dtype.itemsize]
                if flat.data_ptr() == target.data_ptr() and flat.dtype == target.dtype:
                    if digesting is not None:  # digested where it lies (copied onto itself)
                        dst.append(target)
                        src.append(target)
                    continue  # already in place: gathered straight into the bucket (refit.sources.fsdp)
                dst.append(target)
                src.append(flat)
            elif whole:  # strided: copy_ walks its strides, still reading the live storage
                dst.append(target.view(spec.shape))
                src.append(t)
            else:  # a strided tensor split across buckets has no flat view: flatten it anew every refit
                fresh.append((target, t, s.lo // spec.dtype.itemsize, s.hi // spec.dtype.itemsize))
                if digesting is not None:  # digested after that copy, in its segment's place
                    dst.append(target)
                    src.append(target)
        return _PackPlan(key, CopyPlan(dst, src) if digesting is None else digesting(dst, src), fresh)


def _places(m: Manifest, bucket: int, buf: torch.Tensor) -> tuple:
    """(addresses, element counts, dtypes) of the bucket's segments in `buf`; (None,) when a segment is
    part of a tensor split across buckets (never handed out in place)."""
    entries, segs = m.entries, m.segments[bucket]
    if any(s.lo != 0 or s.hi != entries[s.entry].spec.nbytes for s in segs):
        return (None,)
    base = buf.data_ptr()
    specs = [entries[s.entry].spec for s in segs]
    return (
        tuple(base + s.at for s in segs),
        tuple(sp.nbytes // sp.dtype.itemsize for sp in specs),
        tuple(sp.dtype for sp in specs),
    )


@dataclass(slots=True)
class _PackPlan:
    key: LayoutKey | None
    plan: CopyPlan | Any
    fresh: list[tuple[torch.Tensor, torch.Tensor, int, int]]
    generation: int | None = None

    def run(self) -> torch.Tensor | None:
        """Copy; a digesting plan returns the digest of each segment's bytes."""
        for target, t, lo, hi in self.fresh:
            target.copy_(t.reshape(-1)[lo:hi])
        return self.plan.run()


class Unpacker:
    """Turns a received bucket buffer into (name, tensor) pairs: views into the buffer, no copies.

    A tensor spanning several buckets is gathered into one staging tensor, allocated once, and handed
    out when its last bucket arrives.
    """

    def __init__(
        self,
        manifest: Manifest,
        buffers: Sequence[torch.Tensor],
        *,
        device: torch.device | None = None,
        share: Unpacker | None = None,
    ) -> None:
        """`device`: where the staging tensor lives (the receiver's own device; defaults to the buffers').
        `share`: another Unpacker of the same manifest whose staging tensor this one assembles into, so that a
        spanning tensor whose buckets are unpacked by either is gathered in one place."""
        self.manifest = manifest
        self._buffers = buffers
        device = device or (buffers[0].device if buffers else torch.device("cpu"))
        if share is not None:
            assert share.manifest is manifest, "a shared staging tensor serves one manifest"
            self._staging = share._staging
        else:
            self._staging = torch.empty(manifest.max_split_nbytes, dtype=torch.uint8, device=device)
        self._plans: dict[tuple[int, int], _BucketPlan] = {}

    @property
    def staging(self) -> torch.Tensor:
        """Where tensors that span buckets are gathered (empty when none does)."""
        return self._staging

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
                view = typed_view(buf, s.at, spec.nbytes, spec.dtype).view(spec.shape)
                plan.ready.extend((n, view) for n in spec.names)
                continue
            plan.staged.append((self._staging[s.lo : s.hi], buf[s.at : s.at + s.hi - s.lo]))
            if m.last_bucket[s.entry] == bucket:
                view = typed_view(self._staging, 0, spec.nbytes, spec.dtype).view(spec.shape)
                plan.ready.extend((n, view) for n in spec.names)
        return plan


@dataclass(slots=True)
class _BucketPlan:
    ready: list[tuple[str, torch.Tensor]]
    staged: list[tuple[torch.Tensor, torch.Tensor]]
