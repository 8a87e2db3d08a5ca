"""Reshard plan: which bytes of which tensor move from each trainer rank to each engine worker (M:N).

Both sides state what they hold. A trainer rank holds, per tensor, the whole tensor or one slice
along one dimension (FSDP2 `Shard(d)`, uneven shards included; Megatron column- or row-parallel; a
pipeline stage or an expert-parallel rank holds its tensors whole and the others none). An engine
worker needs, per tensor, the whole tensor or one slice along one dimension (its tensor-parallel
part, its experts). Each holder stores its part contiguously, row-major, in the tensor's wire dtype.

The plan intersects the two statements once per epoch (pure: no memory is touched) into strided
byte runs per (rank, worker) pair, so every byte a worker needs moves once, from one rank that holds
it, into the place it keeps it; nothing is gathered into a whole tensor. A tensor held whole by
several ranks (replicated) is sent by one of them, chosen per worker to spread the load. Statements
that do not fit (a slice no rank holds, overlapping or gapped slices across ranks, a slice outside
the tensor) raise `ValueError` naming the tensor, the slices and the fix.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from refit.layout.spec import Slice, TensorSpec

Holding = Slice | None
"""A holder's part of one tensor: a slice, or None for the whole tensor."""

MAX_STATEMENT_TENSORS = 1_000_000


def statement_to_json(held: Mapping[str, Holding]) -> dict[str, list[int] | None]:
    return {n: None if h is None else h.to_json() for n, h in held.items()}


def statement_from_json(raw: object, who: str) -> dict[str, Holding]:
    """A holder's statement as a peer sent it (JSON), every entry checked; ValueError names what is wrong."""
    if not isinstance(raw, dict) or len(raw) > MAX_STATEMENT_TENSORS:
        raise ValueError(f"{who}'s shard statement must be an object of at most {MAX_STATEMENT_TENSORS} names")
    out: dict[str, Holding] = {}
    for name, h in raw.items():
        if h is None:
            out[name] = None
            continue
        ok = isinstance(h, list) and len(h) == 3 and all(type(v) is int and 0 <= v < 1 << 62 for v in h)
        if not ok:
            raise ValueError(f"{who}'s shard statement for {name!r:.200} is {h!r:.80}, not [dim, start, length]")
        out[name] = Slice(*h)
    return out


@dataclass(frozen=True, slots=True)
class Run:
    """`count` copies of `nbytes` contiguous bytes: the i-th from `src + i * src_stride` in the rank's
    local part to `dst + i * dst_stride` in the worker's local part."""

    src: int
    dst: int
    nbytes: int
    count: int = 1
    src_stride: int = 0
    dst_stride: int = 0

    @property
    def total(self) -> int:
        return self.nbytes * self.count

    def to_json(self) -> list[int]:
        return [self.src, self.dst, self.nbytes, self.count, self.src_stride, self.dst_stride]


@dataclass(frozen=True, slots=True)
class Move:
    """What one rank sends one worker of one tensor."""

    name: str
    rank: int
    worker: int
    runs: tuple[Run, ...]
    shape: tuple[int, ...] = ()
    """The moved box's extent per dimension."""
    src_at: tuple[int, ...] = ()
    """Where the box starts in the rank's local part (per dimension)."""
    dst_at: tuple[int, ...] = ()
    """Where the box starts in the worker's local part (per dimension)."""

    @property
    def nbytes(self) -> int:
        return sum(r.total for r in self.runs)


@dataclass(frozen=True, slots=True)
class ReshardPlan:
    """Every move of one epoch, with the bytes per worker and per rank, and a digest of the whole."""

    num_ranks: int
    num_workers: int
    moves: tuple[Move, ...]
    paths: dict[str, str] = field(default_factory=dict)
    """Per tensor: 'direct' (one run per pair), 'strided' (rows of a slice along another dim) or 'replica'."""

    def pair(self, rank: int, worker: int) -> list[Move]:
        """The moves from `rank` to `worker`, in tensor order."""
        return [m for m in self.moves if m.rank == rank and m.worker == worker]

    def worker_bytes(self) -> list[int]:
        out = [0] * self.num_workers
        for m in self.moves:
            out[m.worker] += m.nbytes
        return out

    def rank_bytes(self) -> list[int]:
        out = [0] * self.num_ranks
        for m in self.moves:
            out[m.rank] += m.nbytes
        return out

    @property
    def digest(self) -> bytes:
        """First 16 bytes of SHA-256 over the canonical JSON of every move."""
        body = [[m.name, m.rank, m.worker, [r.to_json() for r in m.runs]] for m in self.moves]
        doc = {"num_ranks": self.num_ranks, "num_workers": self.num_workers, "moves": body}
        return hashlib.sha256(json.dumps(doc, separators=(",", ":")).encode()).digest()[:16]


def plan_reshard(
    specs: Sequence[TensorSpec],
    ranks: Sequence[Mapping[str, Holding]],
    workers: Sequence[Mapping[str, Holding]],
) -> ReshardPlan:
    """The moves that give each worker exactly the parts `workers` states, from the parts `ranks` hold.

    `ranks[r]` and `workers[w]` map tensor names to what that holder keeps; a name absent from a
    rank is not held there, a name absent from a worker is not needed there.
    """
    by_name = {s.name: s for s in specs}
    for w, needs in enumerate(workers):
        unknown = sorted(set(needs) - by_name.keys())
        if unknown:
            raise ValueError(f"worker {w} states tensors the trainer does not send: {unknown[:5]}; fix its shard spec")
    moves: list[Move] = []
    paths: dict[str, str] = {}
    for spec in sorted(specs, key=lambda s: s.name):
        holders = [(r, _box(spec, held.get(spec.name, _ABSENT), f"rank {r}")) for r, held in enumerate(ranks)]
        holders = [(r, box) for r, box in holders if box is not None]
        needed = [
            (w, _box(spec, needs[spec.name], f"worker {w}")) for w, needs in enumerate(workers) if spec.name in needs
        ]
        if not needed:
            continue
        if not holders:
            raise ValueError(
                f"tensor {spec.name!r}: workers {[w for w, _ in needed]} need it, but no trainer rank holds it"
            )
        found, path = _tensor_moves(spec, holders, needed)
        moves.extend(found)
        paths[spec.name] = path
    return ReshardPlan(len(ranks), len(workers), tuple(moves), paths)


_ABSENT = object()
Box = tuple[tuple[int, int], ...]
"""Per dimension, [start, stop)."""


def _box(spec: TensorSpec, held: object, who: str) -> Box | None:
    """The holder's part as a box; None where it holds nothing."""
    if held is _ABSENT:
        return None
    shape = spec.shape or (1,)
    full = tuple((0, n) for n in shape)
    if held is None:
        return full
    assert isinstance(held, Slice)
    if held.dim >= len(shape) or held.start + held.length > shape[held.dim]:
        raise ValueError(
            f"tensor {spec.name!r} {tuple(spec.shape)}: {who} states slice (dim {held.dim}, start {held.start}, "
            f"length {held.length}), outside the tensor; fix that holder's shard spec"
        )
    return tuple((held.start, held.start + held.length) if d == held.dim else full[d] for d in range(len(shape)))


def _tensor_moves(
    spec: TensorSpec, holders: list[tuple[int, Box]], needed: list[tuple[int, Box]]
) -> tuple[list[Move], str]:
    full = tuple((0, n) for n in (spec.shape or (1,)))
    whole = [r for r, box in holders if box == full]
    moves = []
    if whole:  # replicated (or one pipeline stage): one holder per worker, spread over the holders
        for w, need in needed:
            r = whole[w % len(whole)]
            moves.append(_move(spec, r, w, full, need, need))
        return [m for m in moves if m.runs], "replica"
    _check_partition(spec, holders)
    strided = False
    for w, need in needed:
        for r, box in holders:
            inter = _intersect(box, need)
            if inter is None:
                continue
            move = _move(spec, r, w, box, need, inter)
            strided |= len(move.runs) > 1 or any(run.count > 1 for run in move.runs)
            moves.append(move)
    return moves, "strided" if strided else "direct"


def _move(spec: TensorSpec, rank: int, worker: int, src: Box, dst: Box, inter: Box) -> Move:
    return Move(
        spec.name,
        rank,
        worker,
        _runs(spec, src, dst, inter),
        tuple(hi - lo for lo, hi in inter),
        tuple(lo - s for (lo, _), (s, _) in zip(inter, src)),
        tuple(lo - d for (lo, _), (d, _) in zip(inter, dst)),
    )


def _check_partition(spec: TensorSpec, holders: list[tuple[int, Box]]) -> None:
    """The ranks' slices of a sharded tensor: along one dimension, disjoint, covering it."""
    dims = {d for _, box in holders for d, (a, b) in enumerate(box) if (a, b) != (0, (spec.shape or (1,))[d])}
    desc = [(r, box) for r, box in holders]
    if len(dims) > 1:
        raise ValueError(
            f"tensor {spec.name!r} {tuple(spec.shape)}: the ranks slice it along different dims {sorted(dims)} "
            f"({_describe(desc)}); every rank must shard it along one dim, or hold it whole"
        )
    d = dims.pop() if dims else 0
    spans = sorted((box[d], r) for r, box in holders)
    at = 0
    for (a, b), r in spans:
        if a < at:
            raise ValueError(
                f"tensor {spec.name!r} {tuple(spec.shape)}: rank {r}'s slice [{a}, {b}) of dim {d} overlaps "
                f"another rank's ({_describe(desc)}); each byte must have one holder: fix the ranks' shard specs"
            )
        if a > at:
            raise ValueError(
                f"tensor {spec.name!r} {tuple(spec.shape)}: no rank holds [{at}, {a}) of dim {d} "
                f"({_describe(desc)}); the ranks' slices must cover the tensor"
            )
        at = b
    if at != (spec.shape or (1,))[d]:
        raise ValueError(
            f"tensor {spec.name!r} {tuple(spec.shape)}: no rank holds [{at}, {(spec.shape or (1,))[d]}) of dim {d} "
            f"({_describe(desc)}); the ranks' slices must cover the tensor"
        )


def _describe(holders: list[tuple[int, Box]]) -> str:
    return ", ".join(f"rank {r}: {[list(x) for x in box]}" for r, box in holders)


def _intersect(a: Box, b: Box) -> Box | None:
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))
    return None if any(lo >= hi for lo, hi in out) else out


def _strides(box: Box, itemsize: int) -> list[int]:
    """Byte strides of a box stored contiguously, row-major."""
    out, step = [], itemsize
    for lo, hi in reversed(box):
        out.append(step)
        step *= hi - lo
    return out[::-1]


def _runs(spec: TensorSpec, src: Box, dst: Box, inter: Box) -> tuple[Run, ...]:
    """`inter` as strided runs from its place in `src`'s local storage to its place in `dst`'s."""
    if any(lo >= hi for lo, hi in inter):
        return ()
    size = spec.dtype.itemsize
    s_str, d_str = _strides(src, size), _strides(dst, size)
    # The innermost dims where `inter` spans both local parts whole form one contiguous block.
    cut = len(inter) - 1
    while cut > 0 and inter[cut] == src[cut] == dst[cut]:
        cut -= 1
    block = (inter[cut][1] - inter[cut][0]) * s_str[cut]
    outer = list(range(cut))
    loop = outer[-1] if outer else None
    fixed = outer[:-1]
    runs = []
    for index in _indices([inter[d] for d in fixed]):
        s0 = sum((i - src[d][0]) * s_str[d] for d, i in zip(fixed, index)) + (inter[cut][0] - src[cut][0]) * s_str[cut]
        d0 = sum((i - dst[d][0]) * d_str[d] for d, i in zip(fixed, index)) + (inter[cut][0] - dst[cut][0]) * d_str[cut]
        if loop is None:
            runs.append(Run(s0, d0, block))
            continue
        lo, hi = inter[loop]
        s0 += (lo - src[loop][0]) * s_str[loop]
        d0 += (lo - dst[loop][0]) * d_str[loop]
        runs.append(Run(s0, d0, block, hi - lo, s_str[loop], d_str[loop]))
    return tuple(_merged(runs))


def _indices(spans: list[tuple[int, int]]) -> list[tuple[int, ...]]:
    if not spans:
        return [()]
    if math.prod(hi - lo for lo, hi in spans) > 1 << 20:
        raise ValueError(f"a reshard of more than {1 << 20} row groups in one tensor; shard along an outer dim")
    out: list[tuple[int, ...]] = [()]
    for lo, hi in spans:
        out = [(*prefix, i) for prefix in out for i in range(lo, hi)]
    return out


def _merged(runs: list[Run]) -> list[Run]:
    """A strided run whose rows touch on both sides is one contiguous run."""
    out = []
    for r in runs:
        if r.count > 1 and r.src_stride == r.nbytes and r.dst_stride == r.nbytes:
            r = Run(r.src, r.dst, r.nbytes * r.count)
        out.append(r)
    return out


PIECE_MARK = "@"
"""A pair manifest names each moved box `<tensor>@<o0>,<o1>,...`: the box starts at those offsets of the
worker's local part, and its spec's shape is the box's extent."""


def piece_name(name: str, dst_at: Sequence[int]) -> str:
    return f"{name}{PIECE_MARK}{','.join(map(str, dst_at))}"


def parse_piece(piece: str) -> tuple[str, tuple[int, ...]]:
    """(tensor name, offsets) of a piece name; ValueError when it is not one."""
    name, mark, at = piece.rpartition(PIECE_MARK)
    parts = at.split(",")
    if not (mark and name and all(p.isdigit() and len(p) < 19 for p in parts)):
        raise ValueError(f"{piece!r:.200} is not an M:N piece name (<tensor>@<offsets>)")
    return name, tuple(int(p) for p in parts)


def box(t: torch.Tensor, at: Sequence[int], shape: Sequence[int]) -> torch.Tensor:
    """The view of `t` starting at `at` with extent `shape` (a 0-d tensor is the box of shape (1,))."""
    if t.dim() == 0:
        return t.reshape(1)
    for d, (a, n) in enumerate(zip(at, shape)):
        t = t.narrow(d, a, n)
    return t
