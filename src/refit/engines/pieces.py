"""The worker side of an M:N refit: one engine fed by every trainer rank at once, pair by pair.

`ShardTarget` wraps the engine once per worker; each (rank, worker) pair's Receiver gets a
`PieceEngine` over it. A pair's manifest names boxes `<tensor>@<offsets>` (refit.layout.reshard):
each is checked to lie inside this worker's part of that tensor, and, once every pair has its
manifest for a refit, the boxes of all pairs must tile every stated part exactly once (no gap, no
overlap) before any byte is written. Boxes land straight in the engine's tensors (`shard_target`),
or in staging tensors handed to `load_shards` once every pair has delivered its bytes.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from refit.engines.base import Engine, Region
from refit.errors import RefitError
from refit.layout.manifest import Manifest
from refit.layout.packing import CopyPlan, LayoutGuard
from refit.layout.reshard import box, parse_piece
from refit.layout.spec import Slice, TensorSpec

Box = tuple[tuple[int, ...], tuple[int, ...]]
"""(offsets, extent) of a piece in the worker's local part."""


class _Meeting:
    """Every pair arrives once per (stage, version); the last to arrive runs `action`. Broken by `abort`
    (a pair that failed) or by the timeout, so no pair waits on a peer that will never come."""

    def __init__(self, parties: int, timeout_s: float) -> None:
        self.parties, self.timeout_s = parties, timeout_s
        self._cond = threading.Condition()
        self._seen: dict[tuple[str, int], int] = {}
        self._result: dict[tuple[str, int], str] = {}
        self._aborted = ""

    def meet(self, stage: str, version: int, action: Callable[[], str]) -> str:
        key = (stage, version)
        with self._cond:
            self._seen[key] = self._seen.get(key, 0) + 1
            if self._seen[key] == self.parties and not self._aborted:
                try:
                    self._result[key] = action()
                except Exception as e:  # noqa: BLE001 - reported to every pair as this worker's failure
                    self._result[key] = f"{type(e).__name__}: {e}"
                self._cond.notify_all()
            self._cond.wait_for(lambda: key in self._result or self._aborted, timeout=self.timeout_s)
            if key in self._result:
                return self._result[key]
            late = f"not every trainer rank reached {stage} of version {version} within {self.timeout_s:.0f} s"
            return self._aborted or late

    def abort(self, reason: str) -> None:
        with self._cond:
            self._aborted = self._aborted or reason
            self._cond.notify_all()

    def reset(self) -> None:
        with self._cond:
            self._aborted = ""
            self._seen.clear()
            self._result.clear()


@dataclass
class _Part:
    """This worker's part of one tensor: where boxes land, and which boxes each pair brings."""

    name: str
    held: Slice | None
    target: torch.Tensor | None
    boxes: dict[int, list[Box]] = field(default_factory=dict)
    expected: tuple[int, ...] | None = None
    """The part's shape when there is no target to read it from (the full spec with the slice applied)."""
    wire: torch.dtype = torch.float32
    staged: torch.Tensor | None = None
    layout: tuple = ()
    """`_layout` of `target` when it was taken: a tensor changed in place (`.data =`, `set_`) is the same
    object as `target`, so only this snapshot shows what changed."""

    def __post_init__(self) -> None:
        if self.target is not None:
            self.layout = _layout(self.target)


class ShardTarget:
    """One worker's engine under M:N: its shard statement, the tiling check and the commit of all pairs."""

    def __init__(self, engine: Engine, num_pairs: int, *, timeout_s: float, device: torch.device) -> None:
        self.engine, self.device = engine, device
        self.num_pairs = num_pairs
        specs = engine.specs()
        self.ties = {s.name: list(s.aliases) for s in specs if s.aliases}
        aliases = {a for s in specs for a in s.aliases}
        stated = engine.shards()
        if stated is None:  # an engine that states no shards holds every tensor whole (but what it computes itself)
            stated = {s.name: None for s in specs if s.name not in engine.computed_names}
        self.statement: dict[str, Slice | None] = {n: h for n, h in stated.items() if n not in aliases}
        self.ignore = sorted(engine.optional_names)
        self._parts = {n: _Part(n, h, engine.shard_target(n)) for n, h in self.statement.items()}
        shapes = {s.name: tuple(s.shape) for s in specs}
        for part in self._parts.values():
            if part.target is None and engine.exact_shapes and part.name in shapes:
                part.expected = _sliced(shapes[part.name], part.held)
        self._tiled = False
        self._guard: LayoutGuard | None = None
        self.generation = 0
        """Bumped whenever a target tensor was replaced or re-laid-out: views into the old ones are stale."""
        self._meeting = _Meeting(num_pairs, timeout_s)
        self.error = ""
        self.version: int | None = None

    def to_json(self) -> dict:
        shards = {n: None if h is None else h.to_json() for n, h in self.statement.items()}
        return {"shards": shards, "ignore": self.ignore, "ties": self.ties}

    def expect(self, pair: int, m: Manifest) -> list[TensorSpec]:
        """Check a pair's manifest (every box inside this worker's part); the specs it validates against."""
        self._tiled = False
        for part in self._parts.values():
            part.boxes.pop(pair, None)
        out = []
        for spec in m.specs:
            name, at = parse_piece(spec.name)
            part = self._parts.get(name)
            if part is None:
                raise ValueError(f"trainer rank sent a piece of {name!r:.200}, which this worker did not state")
            shape, home = spec.shape, _shape(part.target) if part.target is not None else part.expected
            if len(at) != len(shape) or (home is not None and not _inside(at, shape, home)):
                raise ValueError(f"piece {spec.name!r:.200} {shape} lies outside this worker's part of {name!r}")
            part.boxes.setdefault(pair, []).append((at, shape))
            part.wire = spec.dtype
            dtype = part.target.dtype if part.target is not None else spec.dtype
            out.append(TensorSpec(spec.name, shape, dtype))
        return out

    def begin(self, version: int) -> str:
        """Called by every pair at its BEGIN: the last one checks the tiling and begins the engine."""
        return self._meeting.meet("begin", version, lambda: self._begin(version))

    def _begin(self, version: int) -> str:
        self.version = version  # first: whatever fails below fails this version
        self.engine.begin(version)  # an engine re-reads its live tensors here
        moved = self._refresh_targets()
        if moved:
            self.error = moved
            self.engine.fail(version, moved)
            return moved
        if not self._tiled:  # checked again after any pair's new manifest or a moved target
            problems = [p for p in map(_tiling, self._parts.values()) if p]
            if problems:
                self.error = "M:N pieces do not tile this worker's parts: " + "; ".join(problems[:5])
                self.engine.fail(version, self.error)
                return self.error
            self._tiled = True
        for part in self._parts.values():
            if part.target is not None or not part.boxes:
                continue
            extent = part.expected or _extent(part)
            if part.staged is None or tuple(part.staged.shape) != extent or part.staged.dtype != part.wire:
                part.staged = torch.empty(extent, dtype=part.wire, device=self.device)
                self.generation += 1  # every pair's copy plans into the old staging tensor are stale
        self.error = ""
        return ""

    def _refresh_targets(self) -> str:
        """Re-read the engine's tensors (one replaced since, say by `module.to()`, gets the bytes); one
        batched layout check while none moved. A target recast or reshaped since the plan is refused (its
        pieces were planned and checked for the old one): the error, before any byte is written."""
        direct = [p for p in self._parts.values() if p.target is not None]
        now = [self.engine.shard_target(p.name) for p in direct]
        if all(t is not None for t in now) and self._guard is not None and self._guard.holds(now):  # type: ignore[arg-type]
            return ""
        for part, t in zip(direct, now):
            shape, dtype = part.layout[3], part.layout[5]
            if t is not None and (t.dtype, tuple(t.shape)) != (dtype, shape):
                return (
                    f"this worker's tensor {part.name} changed from {dtype} {shape} to {t.dtype} {tuple(t.shape)} "
                    "since the M:N plan, which its pieces were checked for; nothing was written. Put it back, or "
                    "build a new MeshRefit for the new layout"
                )
        for part, t in zip(direct, now):
            if t is None or _layout(t) != part.layout:
                part.target, part.layout = t, () if t is None else _layout(t)
                self.generation += 1
                self._tiled = False
        self._guard = LayoutGuard([p.target for p in direct if p.target is not None])
        return ""

    def view(self, pair: int, name: str, at: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
        part = self._parts[name]
        home = part.target if part.target is not None else part.staged
        assert home is not None
        return box(home, at, shape)

    def settle(self, version: int) -> str:
        """Every pair has delivered its bytes: load staged parts into the engine and commit it (once, before
        any pair answers DONE, so an engine that fails to commit fails the refit everywhere). The engine then
        reads 'updating' again until the ranks' verdict (`MeshReceiver`)."""
        return self._meeting.meet("settle", version, lambda: self._settle(version))

    def _settle(self, version: int) -> str:
        staged = [(p.name, p.staged) for p in self._parts.values() if p.staged is not None]
        with torch.no_grad():
            if staged:
                self.engine.load_shards(staged)  # type: ignore[arg-type]
            self.engine.versions.hold(version)  # 'updating' until the ranks' verdict, never current before it
            self.engine.commit(version)
        return ""

    def held(self, name: str) -> torch.Tensor | None:
        part = self._parts[name]
        if part.target is not None:
            return part.target
        return self.engine.held_shard(name)

    def abort(self, reason: str) -> None:
        self._meeting.abort(reason)

    def reset(self) -> None:
        self._meeting.reset()


def _layout(t: torch.Tensor) -> tuple:
    return (id(t), t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype, t.device)


def _shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.shape) or (1,)


def _inside(at: tuple[int, ...], shape: tuple[int, ...], home: tuple[int, ...]) -> bool:
    return len(home) == len(at) and all(a + n <= h for a, n, h in zip(at, shape, home))


def _sliced(shape: tuple[int, ...], held: Slice | None) -> tuple[int, ...]:
    shape = shape or (1,)
    return shape if held is None else tuple(held.length if d == held.dim else n for d, n in enumerate(shape))


def _extent(part: _Part) -> tuple[int, ...]:
    boxes = [b for bs in part.boxes.values() for b in bs]
    return tuple(max(a[d] + s[d] for a, s in boxes) for d in range(len(boxes[0][0])))


def _tiling(part: _Part) -> str:
    """'' when the boxes of every pair cover the part exactly once, else what is wrong."""
    boxes = [b for bs in part.boxes.values() for b in bs]
    if part.target is None and not boxes:
        return f"{part.name}: no trainer rank sent any of it"
    home = _shape(part.target) if part.target is not None else part.expected or _extent(part)
    covered = sum(math.prod(s) for _, s in boxes)
    if covered != math.prod(home) or any(_overlap(a, b) for i, a in enumerate(boxes) for b in boxes[i + 1 :]):
        return f"{part.name}: boxes {[(list(a), list(s)) for a, s in boxes][:8]} do not tile its part {list(home)}"
    return ""


def _overlap(a: Box, b: Box) -> bool:
    return all(x < y + m and y < x + n for x, n, y, m in zip(a[0], a[1], b[0], b[1]))


class PieceEngine(Engine):
    """The engine as one (rank, worker) pair's Receiver sees it: the pair's pieces, written into the
    worker's parts. The worker's real engine is begun by the first BEGIN of all pairs and committed by
    `refit.topology.mesh.MeshReceiver` once every pair committed."""

    def __init__(self, target: ShardTarget, pair: int) -> None:
        super().__init__()
        self.target, self.pair = target, pair
        self._specs: dict[str, TensorSpec] = {}
        self._plans: dict[int, tuple[list, CopyPlan]] = {}
        self._failed = ""
        self._settled: int | None = None
        self._generation = -1

    def prepare(self, manifest: Manifest) -> None:
        """The Receiver's hook before validation: the pair's pieces, checked against this worker's parts."""
        self._specs, self._plans = {s.name: s for s in self.target.expect(self.pair, manifest)}, {}

    def specs(self) -> list[TensorSpec]:
        return list(self._specs.values())

    def begin(self, version: int) -> None:
        super().begin(version)
        self._settled = None
        self._failed = self.target.begin(version)
        if self._generation != self.target.generation:  # a target moved: views into it are stale
            self._plans, self._generation = {}, self.target.generation

    def load(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        if self._failed:
            raise RefitError(self._failed)
        hit = self._plans.get(id(tensors))
        if hit is None or hit[0] is not tensors:
            dst = [self._view(n) for n, _ in tensors]
            hit = (tensors, CopyPlan(dst, [t for _, t in tensors]))
            self._plans[id(tensors)] = hit
        with torch.no_grad():
            hit[1].run()

    def _view(self, piece: str) -> torch.Tensor:
        name, at = parse_piece(piece)
        return self.target.view(self.pair, name, at, self._specs[piece].shape)

    def _settle(self) -> None:
        version = self.weights.target
        assert version is not None
        if self._settled != version:
            self._settled = version
            failed = self.target.settle(version)
            if failed:
                self._failed = failed
        if self._failed:
            raise RefitError(self._failed)

    def held(self, name: str) -> tuple[torch.Tensor, Region | None] | None:
        tensor, at = parse_piece(name)
        if self.weights.state.value == "updating":  # the fingerprint, after this pair's last bucket
            try:
                self._settle()
            except RefitError:
                return None  # the commit that follows fails with the reason
        whole = self.target.held(tensor)
        return None if whole is None else (box(whole, at, self._specs[name].shape), None)

    def commit(self, version: int) -> None:
        self._settle()
        super().commit(version)

    def fail(self, version: int, reason: str) -> None:
        super().fail(version, reason)
        self.target.abort(f"another trainer rank's pair failed: {reason}")

    def release_buffers(self) -> None:
        self._plans = {}
