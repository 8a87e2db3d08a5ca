"""FsdpSource: a trainer sharded with FSDP2 (DTensor parameters) as the source, each tensor gathered once per refit.

Tensors are gathered along a fixed schedule: groups of consecutive names (in manifest order) of at
most `gather_bytes` of full tensors each, one batched all-gather per group, the next group in flight
while the current one is packed. A tensor that spans several buckets is gathered once and kept until
its last bucket is packed; a group is dropped as soon as no later bucket needs it.

Two ways to drive it, both on every trainer rank:
- rank-0-led (`sharded_refit`): rank 0 runs the one Sender and announces each group with a
  3-integer broadcast (go, first, count); the other ranks `follow()` and gather the same groups.
- per rank (`refit.topology.ranked.RankedRefit`): every rank runs its own Sender; all ranks walk the same
  schedule, so their gathers pair up without announcements, whatever each rank's bucket layout.
"""

from __future__ import annotations

import contextlib
import operator
from collections import Counter
from collections.abc import Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn

from refit.layout.manifest import Manifest
from refit.layout.packing import CopyPlan, LayoutGuard, typed_view
from refit.layout.spec import Slice
from refit.layout.state_layout import StateLayout, non_persistent_buffers, with_buffers
from refit.sources.base import Source, WireDtypes

DEFAULT_GATHER_BYTES = 64 << 20
"""Gather budget when no driver set one (the drivers use the agreed bucket capacity)."""


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    full = getattr(t, "full_tensor", None)
    return full() if callable(full) else t


def _dtype_and_shape(t: torch.Tensor) -> tuple:
    spec, local = getattr(t, "_spec", None), getattr(t, "_local_tensor", None)
    if spec is not None and local is not None:
        return local.dtype, spec.shape
    return t.dtype, t.shape


_DTENSOR_DTYPE_AND_SHAPE = operator.attrgetter("_local_tensor.dtype", "_spec.shape")


def _dtypes_and_shapes(tensors: Sequence[torch.Tensor]) -> tuple:
    """`_dtype_and_shape` of every tensor; all DTensors (FSDP2's usual case) take one C pass."""
    try:
        return tuple(map(_DTENSOR_DTYPE_AND_SHAPE, tensors))
    except AttributeError:  # some plain tensors (buffers, replicated parameters)
        return tuple(map(_dtype_and_shape, tensors))


def _dim0_group(t: torch.Tensor) -> dist.ProcessGroup | None:
    """The group a DTensor is sharded over when its only sharding is along dim 0 (FSDP2, HSDP); else None."""
    from torch.distributed.tensor import Replicate, Shard

    placements = getattr(t, "placements", None)
    if placements is None or t.dim() == 0:
        return None
    sharded = [i for i, p in enumerate(placements) if not isinstance(p, Replicate)]
    if len(sharded) != 1 or placements[sharded[0]] != Shard(0):
        return None
    return t.device_mesh.get_group(sharded[0])


class BucketSink(Protocol):
    """What per-rank gathers need of a Sender (`refit.topology.sender.Sender` is one): its current
    manifest, and the buffer each bucket of it is packed into (None before its first handshake)."""

    @property
    def manifest(self) -> Manifest | None: ...

    def bucket_buffer(self, b: int) -> torch.Tensor | None: ...


@dataclass(slots=True)
class _Group:
    """One group's gathered tensors, possibly still in flight."""

    index: int
    first: int
    last: int
    tensors: dict[str, torch.Tensor]
    nbytes: int
    works: list = field(default_factory=list)

    def wait(self) -> None:
        for w in self.works:
            w.wait()
        self.works = []


class FsdpSource(WireDtypes, Source):
    """Specs from the DTensors' global shapes (nothing gathered); tensors gathered group by group."""

    stable_tensors = False

    def __init__(
        self,
        module: nn.Module | Mapping[str, torch.Tensor],
        *,
        wire_dtype: torch.dtype | None = None,
        overrides: Mapping[str, torch.dtype] | None = None,
        group: dist.ProcessGroup | None = None,
        gather_bytes: int | None = None,
        prefetch: bool = True,
        non_persistent: bool = False,
    ) -> None:
        """`gather_bytes`: most bytes of full tensors one gather brings in (default: the drivers set the
        agreed bucket capacity); `prefetch`: gather the next group while the current one is packed.
        `non_persistent`: also send the module's non-persistent buffers (every rank holds them whole), each in
        its own dtype."""
        if gather_bytes is not None and gather_bytes <= 0:
            raise ValueError(f"gather_bytes ({gather_bytes}) must be > 0")
        self._layout = StateLayout(module) if isinstance(module, nn.Module) else None
        self._buffers = non_persistent_buffers(module) if non_persistent and isinstance(module, nn.Module) else []
        self._mapping = module
        self._sorted: tuple[tuple[str, ...], list[str]] = ((), [])
        self._tensors: dict[str, torch.Tensor] = self._read()
        self._init_wire(wire_dtype, overrides)
        for name, _, _ in self._buffers:  # computed state goes exactly as the module holds it, never cast
            self.set_wire_dtype(name, self._tensors[name].dtype)
        self.group = group
        self.rank = dist.get_rank(group)
        self.gather_bytes = gather_bytes
        self.prefetch = prefetch
        self.peak_gathered_bytes = 0
        """Most bytes of gathered (full) tensors alive at once on this rank, for checking the budget."""
        self.gather_counts: Counter[str] = Counter()
        """How many times each tensor was all-gathered (tests: once per refit)."""
        self.in_place_bytes = 0
        """Bytes gathered straight into a Sender's bucket buffer (per-rank mode), so never packed."""
        self._order: list[str] = []
        self._pos: dict[str, int] = {}
        self._groups: list[tuple[int, int]] = []
        self._group_of: list[int] = []
        self._planned: tuple = ()
        self._live: list[_Group] = []
        self._next = 0
        self._leading = False
        self._buckets: _BucketGathers | None = None
        self._bucket_plans: tuple = (None, [], {})
        """(layout, names per bucket, in-place gather plans) of the last per-rank layout."""

    def _read(self) -> dict[str, torch.Tensor]:
        """The module's parameters and buffers as they are now (a parameter replaced since is seen), by name."""
        items = with_buffers(self._layout.read(), self._buffers) if self._layout is not None else self._mapping
        names = tuple(items)
        if names != self._sorted[0]:
            self._sorted = (names, sorted(names))
        return {n: items[n] for n in self._sorted[1]}

    def signature(self) -> Hashable:
        """Training dtypes, global shapes and wire overrides; read from the DTensors' local tensor and
        spec (a DTensor's own `.dtype`/`.shape` cost microseconds each: 90k tensors would take 0.3 s).
        Called at the start of every refit, it first re-reads the module's tensors."""
        self._tensors = self._read()
        return (_dtypes_and_shapes(list(self._tensors.values())), tuple(sorted(self._overrides.items(), key=str)))

    # -- M:N: the local shards, never gathered ---------------------------------------------------

    def holdings(self) -> dict[str, Slice | None]:
        """Per primary name, the slice of the global tensor this rank's shard is (torch.chunk rule, uneven
        and empty shards included); None for a tensor every rank holds whole (replicated, plain buffers)."""
        return {s.name: _holding(s.name, self._tensors[s.name]) for s in self.specs()}

    def local_tensors(self, names: Sequence[str]) -> list[torch.Tensor]:
        return [_local(t) if hasattr(t, "placements") else t for t in (self._tensors[n] for n in names)]

    # -- the schedule ------------------------------------------------------------------------------

    def _gathered_nbytes(self, name: str) -> int:
        t = self._tensors[name]
        return t.numel() * t.element_size() if _dim0_group(t) is not None or hasattr(t, "full_tensor") else 0

    def _plan(self) -> None:
        """(Re)build the schedule from the sent names (aliases excluded) and the budget; deterministic,
        so every rank builds the same one."""
        budget = self.gather_bytes or DEFAULT_GATHER_BYTES
        key = (self.signature(), budget)
        if key == self._planned:
            return
        order = sorted(s.name for s in self.specs())
        self._order, self._pos = order, {n: i for i, n in enumerate(order)}
        self._groups, self._group_of = [], []
        start, size = 0, 0
        for i, n in enumerate(order):
            b = self._gathered_nbytes(n)
            if i > start and size + b > budget:
                self._groups.append((start, i - 1))
                start, size = i, 0
            size += b
            self._group_of.append(len(self._groups))
        if order:
            self._groups.append((start, len(order) - 1))
        self._planned = key
        self._live, self._next = [], 0

    def begin(self, *, layout: Manifest | None = None, sender: BucketSink | None = None) -> None:
        """Start a pass (every rank, before each refit). With `layout` (per-rank mode, the same bucket
        layout on every rank) gathers follow the buckets instead of the schedule, and whole, evenly
        sharded tensors are gathered straight into `sender`'s bucket buffer."""
        if layout is None:
            self._plan()
        self._live, self._next = [], 0
        self._buckets = _BucketGathers(self, layout, sender) if layout is not None else None

    def end(self, *, drain: bool) -> None:
        """End the pass; with `drain` (per-rank mode) first gather whatever this rank did not ask for,
        so the other ranks' gathers still pair up after this rank's refit broke off."""
        if self._buckets is not None:
            if drain:
                self._buckets.drain()
            self._buckets = None
            return
        while drain and self._next < len(self._groups):
            self._issue().wait()
        self._live = []

    # -- gathering ---------------------------------------------------------------------------------

    def _issue(self) -> _Group:
        """Start gathering the next group of the schedule (announced first when rank 0 leads)."""
        first, last = self._groups[self._next]
        self._next += 1
        if self._leading:
            self._control(1, first, last - first + 1)
        g = self._gather(self._order[first : last + 1], self._next - 1, first)
        self._live.append(g)
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, sum(x.nbytes for x in self._live))
        return g

    def _gather(self, names: Sequence[str], index: int, first: int) -> _Group:
        """One batched all-gather per (process group, dtype) for dim-0 shards; other DTensors one by one."""
        out: dict[str, torch.Tensor] = {}
        batches: dict[tuple, tuple[dist.ProcessGroup, list[torch.Tensor], list[torch.Tensor]]] = {}
        nbytes = 0
        with torch.no_grad():
            for n in names:
                t = self._tensors[n]
                pg = _dim0_group(t)
                if pg is None:
                    out[n] = full_tensor(t)
                    if out[n] is not t:
                        self.gather_counts[n] += 1
                        nbytes += out[n].numel() * out[n].element_size()
                    continue
                full, local = _padded(t, pg)
                _, outs, ins = batches.setdefault((id(pg), local.dtype), (pg, [], []))
                outs.append(full)
                ins.append(local)
                out[n] = full[: t.shape[0]]
                self.gather_counts[n] += 1
                nbytes += full.numel() * full.element_size()
        works = [_all_gather(pg, outs, ins) for pg, outs, ins in batches.values()]
        return _Group(index, first, first + len(names) - 1, out, nbytes, [w for ws in works for w in ws])

    def tensors(self, names: Sequence[str]) -> list[torch.Tensor]:
        """The full tensors for a run of consecutive names, gathering only groups not gathered yet."""
        if not names:
            return []
        if self._buckets is not None:
            out = self._buckets.tensors(names)
            if out is not None:
                return out
        if not self._groups:
            self._plan()
        first, last = self._pos[names[0]], self._pos[names[-1]]
        if list(names) != self._order[first : last + 1]:
            raise ValueError("FsdpSource gathers contiguous runs of tensors in name order (as the planner lays them)")
        need = self._group_of[first]
        if need < self._next and all(g.index != need for g in self._live):
            self.begin()  # a group already dropped is asked for again (a second read): a new pass
        self._live = [g for g in self._live if g.last >= first]
        while self._next <= self._group_of[last]:
            self._issue()
        if self.prefetch and self._next == self._group_of[last] + 1 < len(self._groups):
            self._issue()
        out = []
        for g in self._live:
            if g.first <= last:
                g.wait()
                out.extend(g.tensors[n] for n in self._order[max(g.first, first) : min(g.last, last) + 1])
        return out

    # -- rank-0-led mode ---------------------------------------------------------------------------

    def _control(self, go: int, first: int = 0, count: int = 0) -> tuple[int, int, int]:
        msg = torch.tensor([go, first, count], dtype=torch.int64)
        if dist.get_backend(self.group) == "nccl":
            msg = msg.cuda()
        dist.broadcast(msg, src=dist.get_global_rank(self.group, 0) if self.group else 0, group=self.group)
        if self.rank == 0:  # reading it back would wait for the gathers queued before it
            return go, first, count
        go, first, count = (int(v) for v in msg.tolist())
        return go, first, count

    @contextlib.contextmanager
    def leading(self) -> Iterator[None]:
        """Rank 0: wrap each Sender.refit so the followers are released however it ends."""
        self.begin()
        self._leading = True
        try:
            yield
        finally:
            self._leading = False
            self.end(drain=False)
            self._control(0)

    def follow(self) -> None:
        """Ranks other than 0: take part in one refit's gathers until rank 0 says it ended."""
        self._plan()
        while True:
            go, first, count = self._control(0)
            if not go:
                return
            self._gather(self._order[first : first + count], -1, first).wait()

    def predicted_gather_bytes(self, manifest: Manifest) -> int:
        """Peak bytes of full tensors alive at once for this manifest's buckets (prefetch included)."""
        self._plan()
        sizes = [sum(self._padded_nbytes(n) for n in self._order[a : b + 1]) for a, b in self._groups]
        peak, live, nxt = 0, [], 0
        for segs in manifest.segments:
            names = [manifest.entries[s.entry].name for s in segs]
            if not names:
                continue
            first, last = self._pos[names[0]], self._pos[names[-1]]
            live = [g for g in live if self._groups[g][1] >= first]
            while nxt <= self._group_of[last] or (self.prefetch and nxt == self._group_of[last] + 1 < len(sizes)):
                live.append(nxt)
                nxt += 1
                peak = max(peak, sum(sizes[g] for g in live))
        return peak

    def _padded_nbytes(self, name: str) -> int:
        t = self._tensors[name]
        pg = _dim0_group(t)
        if pg is None:
            return self._gathered_nbytes(name)
        world = dist.get_world_size(pg)
        return -(-t.shape[0] // world) * world * (t.numel() // max(t.shape[0], 1)) * t.element_size()


def _padded(t: torch.Tensor, pg: dist.ProcessGroup) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, input) of an all-gather of a dim-0 sharded DTensor: shards padded to equal rows."""
    world, rows = dist.get_world_size(pg), t.shape[0]
    chunk = -(-rows // world)
    local = t.to_local()
    if local.shape[0] != chunk or not local.is_contiguous():  # an uneven last shard: pad it
        padded = local.new_zeros((chunk, *t.shape[1:]))
        padded[: local.shape[0]].copy_(local)
        local = padded
    return torch.empty((chunk * world, *t.shape[1:]), dtype=local.dtype, device=local.device), local


@dataclass(slots=True)
class _BucketPlan:
    """The fixed part of one bucket's gathers (the tensors gathered straight into its buffer), built once
    per layout and buffer and replayed while the shards keep their storage."""

    shards: list[torch.Tensor]
    """The DTensors read in place: the plan holds while the module still has these very ones, their
    local tensors keeping storage, dtype, shape and strides (`key`)."""
    key: LayoutGuard
    fixed: list[torch.Tensor | None]
    """Per segment: the view of the bucket handed out, or None when that tensor is gathered afresh."""
    batches: dict[tuple, tuple[dist.ProcessGroup, list[torch.Tensor], list[torch.Tensor]]]
    casts: CopyPlan | None
    """Shards copied into their wire dtype before the gather (None when all are already in it)."""
    names: list[str]
    in_place_bytes: int


def _holding(name: str, t: torch.Tensor) -> Slice | None:
    from torch.distributed.tensor import Replicate, Shard

    placements = getattr(t, "placements", None)
    if placements is None:
        return None
    sharded = [(m, p) for m, p in enumerate(placements) if not isinstance(p, Replicate)]
    if not sharded:
        return None
    if len(sharded) > 1 or not isinstance(sharded[0][1], Shard) or any(isinstance(p, Replicate) for p in placements):
        raise ValueError(
            f"M:N refit of {name!r}: its placements {tuple(placements)} are not one Shard(d) over the whole mesh "
            "(HSDP replicas or 2-D sharding); use the per-rank refit (RankedRefit) for this model"
        )
    mesh_dim, dim = sharded[0][0], sharded[0][1].dim
    n, parts = t.shape[dim], t.device_mesh.size(mesh_dim)
    pos = t.device_mesh.get_local_rank(mesh_dim)
    size = -(-n // parts)
    start, length = min(pos * size, n), _local(t).shape[dim]
    if length != max(0, min(size, n - pos * size)):
        raise ValueError(f"M:N refit of {name!r}: shard of {length} rows on mesh rank {pos} is not torch.chunk's")
    return Slice(dim, start, length)


def _local(t: torch.Tensor) -> torch.Tensor:
    local = getattr(t, "_local_tensor", None)
    return local if local is not None else t.to_local()


class _BucketGathers:
    """Gathers that follow one bucket layout, the same on every rank (per-rank mode).

    A whole, evenly sharded tensor is cast to its wire dtype on its shard and all-gathered straight
    into the bucket buffer the Sender is about to pack (when the Sender's manifest has this very
    layout), so packing it copies nothing; otherwise into a scratch tensor of the same shape, so the
    collectives are the same on every rank either way. Other tensors are gathered whole (a tensor
    spanning buckets once, kept until its last bucket). The in-buffer part of each bucket is planned
    once per layout, so a refit of many tensors costs no Python work per tensor for it.
    """

    def __init__(self, source: FsdpSource, layout: Manifest, sender: BucketSink | None) -> None:
        self.source, self.m, self.sender = source, layout, sender
        if source._bucket_plans[0] is not layout:
            source._bucket_plans = (
                layout,
                [[layout.entries[s.entry].name for s in segs] for segs in layout.segments],
                {},
            )
        self.names, self.plans = source._bucket_plans[1], source._bucket_plans[2]
        self.next = 0
        self._matched: tuple[Manifest | None, bool] = (None, False)
        self.kept: dict[str, tuple[torch.Tensor, int]] = {}
        """A tensor spanning buckets: gathered at its first, kept until its last (the bucket index)."""

    def tensors(self, names: Sequence[str]) -> list[torch.Tensor] | None:
        """Bucket `next`'s tensors, or None when `names` is not that bucket (then the schedule serves it)."""
        b = self.next
        if b >= len(self.names) or list(names) != self.names[b]:
            return None
        self.next += 1
        return self._bucket(b, self._buffer(b))

    def drain(self) -> None:
        while self.next < len(self.names):
            self._bucket(self.next, None)
            self.next += 1

    def _buffer(self, b: int) -> torch.Tensor | None:
        """The slot buffer bucket `b` is packed into, when the Sender packs exactly this layout."""
        s = self.sender
        if s is None or s.manifest is None:
            return None
        if self._matched[0] is not s.manifest:  # compared once per manifest, not per bucket
            self._matched = (s.manifest, s.manifest.segments == self.m.segments)
        return s.bucket_buffer(b) if self._matched[1] else None

    def _plan(self, b: int, buf: torch.Tensor | None) -> _BucketPlan:
        """Bucket `b`'s in-place gathers into `buf` (into scratch when None: a drain, never cached)."""
        key = (b, buf.data_ptr() if buf is not None else None)
        plan = self.plans.get(key)
        if plan is not None and self._holds(plan):
            return plan
        shards, fixed, names, casts, nbytes = [], [], [], ([], []), 0
        batches: dict[tuple, tuple[dist.ProcessGroup, list[torch.Tensor], list[torch.Tensor]]] = {}
        for s in self.m.segments[b]:
            p = self.m.entries[s.entry]
            spec, t = p.spec, self.source._tensors[p.name]
            pg = _dim0_group(t)
            if pg is None or s.lo != 0 or s.hi != spec.nbytes or t.shape[0] % dist.get_world_size(pg):
                fixed.append(None)
                continue
            local = _local(t)
            if local.dtype != spec.dtype or not local.is_contiguous():
                casts[0].append(torch.empty(local.shape, dtype=spec.dtype, device=local.device))
                casts[1].append(local)
                local = casts[0][-1]
            dst = (
                typed_view(buf, s.at, spec.nbytes, spec.dtype)
                if buf is not None
                else torch.empty(spec.nbytes // spec.dtype.itemsize, dtype=spec.dtype, device=local.device)
            )
            _, outs, ins = batches.setdefault((id(pg), spec.dtype), (pg, [], []))
            outs.append(dst)
            ins.append(local.view(-1))
            fixed.append(dst.view(spec.shape))
            shards.append(t)
            names.append(p.name)
            nbytes += spec.nbytes if buf is not None else 0
        plan = _BucketPlan(
            shards,
            LayoutGuard([_local(t) for t in shards]),
            fixed,
            batches,
            CopyPlan(*casts) if casts[0] else None,
            names,
            nbytes,
        )
        if buf is not None:
            self.plans[key] = plan
        return plan

    def _holds(self, plan: _BucketPlan) -> bool:
        live = self.source._tensors
        now = [live.get(n) for n in plan.names]
        if any(a is not b for a, b in zip(now, plan.shards)):
            return False
        return plan.key.holds([_local(t) for t in plan.shards])

    def _bucket(self, b: int, buf: torch.Tensor | None) -> list[torch.Tensor]:
        src, plan = self.source, self._plan(b, buf)
        batches = {k: (pg, list(outs), list(ins)) for k, (pg, outs, ins) in plan.batches.items()}
        out = list(plan.fixed)
        with torch.no_grad():
            if plan.casts is not None:
                plan.casts.run()
            for i, s in enumerate(self.m.segments[b]):
                if out[i] is not None:
                    continue
                p = self.m.entries[s.entry]
                out[i] = self._fresh(p.name, p.spec, s, batches)
        for w in [w for pg, outs, ins in batches.values() for w in _all_gather(pg, outs, ins)]:
            w.wait()
        src.gather_counts.update(plan.names)
        src.in_place_bytes += plan.in_place_bytes
        self.kept = {n: kept for n, kept in self.kept.items() if kept[1] > b}
        return out

    def _fresh(self, name: str, spec, s, batches: dict) -> torch.Tensor:  # type: ignore[no-untyped-def]
        """A tensor not gathered in place: split across buckets, unevenly sharded, or not dim-0 sharded."""
        src, t = self.source, self.source._tensors[name]
        if name in self.kept:
            return self.kept[name][0]
        pg = _dim0_group(t)
        if pg is not None:
            dst, local = _padded(t, pg)
            _, outs, ins = batches.setdefault((id(pg), dst.dtype), (pg, [], []))
            outs.append(dst)
            ins.append(local)
            full = dst[: t.shape[0]]
            src.gather_counts[name] += 1
            src.peak_gathered_bytes = max(src.peak_gathered_bytes, dst.numel() * dst.element_size())
        else:
            full = full_tensor(t)
            if full is not t:
                src.gather_counts[name] += 1
        if s.lo != 0 or s.hi != spec.nbytes:
            self.kept[name] = (full, self.m.last_bucket[s.entry])
        return full


def _all_gather(pg: dist.ProcessGroup, outs: list[torch.Tensor], ins: list[torch.Tensor]) -> list:
    """One coalesced all-gather where the backend has it, else one all-gather per tensor, all in flight."""
    try:
        return [pg.allgather_into_tensor_coalesced(outs, ins)]
    except (RuntimeError, NotImplementedError, AttributeError):
        return [dist.all_gather_into_tensor(o, i, group=pg, async_op=True) for o, i in zip(outs, ins)]
