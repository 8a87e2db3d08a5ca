"""Digest: a 64-bit, position-weighted sum of a tensor's bytes, equal on every device, for many tensors at once.

Read the bytes as little-endian int64 words w_0 .. w_{k-1} (the last one zero-padded). Word p, at global
word position p, is weighted by the odd number W(p) = 2 * M * p + 1, and

    digest = sum(w_p * W(p)) + nbytes = 2M * sum(p * w_p) + sum(w_p) + nbytes   (mod 2^64, M = 0x9E3779B97F4A7C15)

Every weight is odd, so each word's term is a bijection of the word: any change of one word (any single
flipped bit) changes the digest. A word moved to another position changes it too (a transposed, shifted
or stale layout). The digest of a range of words starting at word `offset` of a tensor uses the global
positions offset + i, so the digests of disjoint ranges add up (mod 2^64) to the tensor's. Integer sums
wrap identically in any order and on any device, so a trainer's GPU and an engine's CPU agree bit for
bit. It is a check against mistakes, not against an adversary.

On CUDA with Triton, all tensors of one call are cut into 1 MiB chunks listed in one table (built once
per layout of addresses and sizes, and cached) and summed by one kernel launch in tiles of ROWS x COLS
words with 16-byte loads: per word, additions and one multiply by its row in the tile (0 to ROWS - 1),
never by its position (column sums and running sums give the positions' products once per chunk); it
reads at the memory-read floor on an H200 (BENCHMARKS.md).
Elsewhere each tensor's words are summed as rows of a matrix times the vector of positions: one reading
pass too. Every path computes the same two sums, sum(w_p) and sum(p * w_p); the weights are applied
once, at the end. The REFIT_DIGEST_* variables override the kernel's tuning (for
`refit.tools.bench.digestbench` sweeps).
"""

from __future__ import annotations

import contextlib
import operator
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch._utils import _flatten_dense_tensors

from refit.layout.copy_kernel import available, triton

M = 0x9E3779B97F4A7C15 - (1 << 64)
"""The odd multiplier, as a signed int64."""
STEP = 2 * M + (1 << 64)
"""2M (mod 2^64), as a signed int64: the weights W(p) = STEP * p + 1 step by it and are all odd."""
ROW_WORDS = 1 << 15
"""Words per row of the CPU path: 256 KiB."""
CHUNK_WORDS = int(os.environ.get("REFIT_DIGEST_CHUNK_WORDS", 1 << 17))
"""Words per chunk of the kernels (one program each): 1 MiB."""
ROWS = int(os.environ.get("REFIT_DIGEST_ROWS", 8))
COLS = int(os.environ.get("REFIT_DIGEST_COLS", 1024))
"""A kernel tile: ROWS x COLS words (64 KiB) per loop step, each thread holding whole columns of two words."""
NUM_WARPS = int(os.environ.get("REFIT_DIGEST_WARPS", 16))
_NBYTES, _DTYPE, _DEVICE = (operator.attrgetter(a) for a in ("nbytes", "dtype", "device"))

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _tile_sums(w, a, t, b, ROWS: tl.constexpr):
        """One [ROWS, COLS] tile of words into the per-column accumulators: a += column sums, then t += a
        (so that, after K tiles, sum_k k * colsum_k = K * a - t: no 64-bit multiply by a position per
        word), b += sum_r r * w[r] (r a small per-register constant)."""
        rows = tl.arange(0, ROWS)[:, None].to(tl.int64)
        a += tl.sum(w, axis=0)
        return a, t + a, b + tl.sum(w * rows, axis=0)

    @triton.jit
    def _finish(a, t, b, tiles, base, ROWS: tl.constexpr, COLS: tl.constexpr):
        """(sum w, sum position * w) of a chunk of `tiles` tiles whose first word is at position `base`."""
        cols = tl.arange(0, COLS).to(tl.int64)
        row_sum = ROWS * (tiles * a - t) + b  # per column: sum over the chunk's rows of row index * word
        s0 = tl.sum(a, axis=0)
        return s0, tl.sum(COLS * row_sum + cols * a, axis=0) + base * s0

    @triton.jit
    def _digest_chunks(table, anchor, out, ROWS: tl.constexpr, COLS: tl.constexpr):
        """Chunk c = row c of `table`: (word offset from `anchor`, position of its first word, words). Whole
        tiles first, with 16-byte loads (offsets of chunks with a whole tile are even), then one masked tile."""
        c = tl.program_id(0).to(tl.int64)
        off = tl.load(table + c * 3)
        base = tl.load(table + c * 3 + 1)
        n = tl.load(table + c * 3 + 2)
        idx = (tl.arange(0, ROWS)[:, None] * COLS + tl.arange(0, COLS)[None, :]).to(tl.int64)
        a = tl.zeros([COLS], dtype=tl.int64)
        t = tl.zeros([COLS], dtype=tl.int64)
        b = tl.zeros([COLS], dtype=tl.int64)
        full = n // (ROWS * COLS)
        for k in range(0, full):
            at = tl.multiple_of(off + k * (ROWS * COLS), 2)
            w = tl.load(anchor + at + idx, cache_modifier=".cg")
            a, t, b = _tile_sums(w, a, t, b, ROWS)
        done = full * (ROWS * COLS)
        if done < n:
            w = tl.load(anchor + off + done + idx, mask=idx < n - done, other=0)
            a, t, b = _tile_sums(w, a, t, b, ROWS)
            full += 1
        s0, s1 = _finish(a, t, b, full, base, ROWS, COLS)
        tl.store(out + c * 2, s0)
        tl.store(out + c * 2 + 1, s1)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """`t`'s bytes, flat, as uint8 starting at an 8-byte aligned address (copied only when it must be)."""
    raw = t.detach().resolve_neg().resolve_conj().contiguous().reshape(-1).view(torch.uint8)
    # viewing bytes as words needs the view's storage offset aligned too, not only its address
    return raw if raw.data_ptr() % 8 == 0 and raw.storage_offset() % 8 == 0 else raw.clone()


def _positions(n: int, device: torch.device) -> torch.Tensor:
    return torch.arange(n, dtype=torch.int64, device=device)


def _sums_rows(words: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum w_i, sum i * w_i) of a large 1-D int64 tensor in one pass: rows of the matrix times positions."""
    whole = words.numel() - words.numel() % ROW_WORDS
    rows = words[:whole].view(-1, ROW_WORDS)
    pos = _positions(ROW_WORDS, words.device)
    # Integer matmul wraps like the sums; CUDA has none, so there it multiplies and sums.
    row_s1 = rows @ pos if words.device.type == "cpu" else (rows * pos).sum(dim=1)
    row_s0 = rows.sum(dim=1)
    rest = words[whole:]
    bases = _positions(rows.shape[0], words.device) * ROW_WORDS
    s0 = row_s0.sum() + rest.sum()
    s1 = (row_s1 + row_s0 * bases).sum() + (rest * (_positions(rest.numel(), words.device) + whole)).sum()
    return s0, s1


def _sums_small(words: list[torch.Tensor], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The two sums of many small tensors at once: one concatenation and two segmented sums."""
    sizes = torch.tensor([w.numel() for w in words], dtype=torch.int64)
    return _sums_segments(torch.cat(words), sizes, device)


def _sums_segments(flat: torch.Tensor, sizes: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The two sums of each run of `flat` (int64 words), run k being the next `sizes[k]` words."""
    owner = torch.repeat_interleave(torch.arange(len(sizes)), sizes).to(device)
    starts = (torch.cumsum(sizes, 0) - sizes).to(device)
    local = _positions(flat.numel(), device) - starts[owner]
    s0 = torch.zeros(len(sizes), dtype=torch.int64, device=device).index_add_(0, owner, flat)
    s1 = torch.zeros(len(sizes), dtype=torch.int64, device=device).index_add_(0, owner, flat * local)
    return s0, s1


def digests(tensors: Sequence[torch.Tensor], offsets: Sequence[int] | None = None) -> torch.Tensor:
    """The digest of each tensor, as a 1-D int64 tensor on their (common) device; no host synchronisation.

    `offsets[k]`: the global word position of tensor k's first word, when it is a range of a larger run of
    words (default 0); digests of disjoint ranges then add up to the digest of the whole. A range must start
    at a whole word of the whole, and only the last range may end in a partial word."""
    if not tensors:
        return torch.zeros(0, dtype=torch.int64)
    if offsets is not None and len(offsets) != len(tensors):
        raise ValueError(f"{len(offsets)} offsets for {len(tensors)} tensors: give one word offset per tensor")
    device = tensors[0].device
    if available(device):
        fast = _digests_cached(tensors, offsets, device)
        if fast is not None:
            return fast
    s0, s1 = _sums(tensors, device)
    if offsets is not None and any(offsets):
        s1 = s1 + torch.tensor(offsets, dtype=torch.int64, device=device) * s0
    nbytes = torch.tensor(list(map(_NBYTES, tensors)), dtype=torch.int64, device=device)
    return s1 * STEP + s0 + nbytes


def _digests_cached(
    tensors: Sequence[torch.Tensor], offsets: Sequence[int] | None, device: torch.device
) -> torch.Tensor | None:
    """The digests of regular tensors (`_regular`) on CUDA through a plan cached per layout: per call, a few
    passes over the tensors' attributes in C and three launches, no host-to-device copy. None where a
    tensor is not regular (the general path takes the call)."""
    T = torch.Tensor
    if not all(map(T.is_contiguous, tensors)) or any(map(T.is_neg, tensors)) or any(map(T.is_conj, tensors)):
        return None
    ptrs, nbytes = tuple(map(T.data_ptr, tensors)), tuple(map(_NBYTES, tensors))
    key = ("digest", device, ptrs, nbytes, None if offsets is None else tuple(offsets))
    plan = _plan(key, lambda: _digest_plan(ptrs, nbytes, offsets, device))
    if plan is None:
        return None
    sums = torch.zeros(len(ptrs), 2, dtype=torch.int64, device=device)
    if plan.num_chunks:
        out = torch.empty(plan.num_chunks, 2, dtype=torch.int64, device=device)
        with _on(device):
            _digest_chunks[(plan.num_chunks,)](
                plan.table, plan.anchors[0], out, ROWS=ROWS, COLS=COLS, num_warps=NUM_WARPS
            )
        sums.index_add_(0, plan.owner, out)
    s0, s1 = sums[:, 0], sums[:, 1]
    if plan.offsets is not None:
        s1 = s1 + plan.offsets * s0
    return s1 * STEP + s0 + plan.nbytes


def prepared(tensors: Sequence[torch.Tensor]) -> Callable[[], torch.Tensor] | None:
    """`digests(tensors)` planned once, where the cached CUDA path takes every tensor: a callable with no pass
    over the tensors per call. It holds raw addresses: valid only while every tensor keeps its storage and
    layout (the caller's layout guard rebuilds it otherwise). None elsewhere: call `digests`."""
    if not tensors:
        return None
    device = tensors[0].device
    T = torch.Tensor
    if not available(device) or len(set(map(_DEVICE, tensors))) != 1 or not all(map(T.is_contiguous, tensors)):
        return None
    if any(map(T.is_neg, tensors)) or any(map(T.is_conj, tensors)):
        return None
    ptrs, nbytes = tuple(map(T.data_ptr, tensors)), tuple(map(_NBYTES, tensors))
    plan = _digest_plan(ptrs, nbytes, None, device)
    if plan is None:
        return None
    keep, n = list(tensors), len(ptrs)
    launch = _digest_chunks[(plan.num_chunks,)] if plan.num_chunks else None

    def run() -> torch.Tensor:
        assert keep  # the tensors stay alive with the table of their addresses
        sums = torch.zeros(n, 2, dtype=torch.int64, device=device)
        if launch is not None:
            out = torch.empty(plan.num_chunks, 2, dtype=torch.int64, device=device)
            with _on(device):
                launch(plan.table, plan.anchors[0], out, ROWS=ROWS, COLS=COLS, num_warps=NUM_WARPS)
            sums.index_add_(0, plan.owner, out)
        return sums[:, 1] * STEP + sums[:, 0] + plan.nbytes

    return run


def kernel(tensors: Sequence[torch.Tensor]) -> Callable[[], object]:
    """For benchmarks: a callable that launches the kernel alone over `tensors`' cached table (no Python per
    tensor, no reduction). Tensors as `digests`' cached path takes them: contiguous, whole words, 8-byte
    addresses, on one CUDA device (or Triton's interpreter)."""
    device = tensors[0].device
    ptrs, nbytes = tuple(map(torch.Tensor.data_ptr, tensors)), tuple(map(_NBYTES, tensors))
    plan = _plan(("digest", device, ptrs, nbytes, None), lambda: _digest_plan(ptrs, nbytes, None, device))
    if plan is None or not plan.num_chunks or not available(device):
        raise ValueError("the digest kernel alone needs Triton and whole-word tensors at 8-byte addresses")
    out = torch.empty(plan.num_chunks, 2, dtype=torch.int64, device=device)
    launch = _digest_chunks[(plan.num_chunks,)]
    return lambda: launch(plan.table, plan.anchors[0], out, ROWS=ROWS, COLS=COLS, num_warps=NUM_WARPS)


def _sums(tensors: Sequence[torch.Tensor], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum w_p, sum p * w_p) of each tensor's words, positions counted from its first word."""
    if not available(device):
        flat = _sums_flat(tensors, device)
        return flat if flat is not None else _sums_general(tensors, device)
    regular = _regular(tensors)
    if all(regular):
        return _sums_words(tensors, device)
    if not any(regular):
        return _sums_general(tensors, device)
    s0 = torch.empty(len(tensors), dtype=torch.int64, device=device)
    s1 = torch.empty(len(tensors), dtype=torch.int64, device=device)
    for flag, sums_some in ((True, _sums_words), (False, _sums_general)):
        idx = [i for i, r in enumerate(regular) if r == flag]
        where = torch.tensor(idx, device=device)
        a, b = sums_some([tensors[i] for i in idx], device)
        s0.index_copy_(0, where, a)
        s1.index_copy_(0, where, b)
    return s0, s1


def _regular(tensors: Sequence[torch.Tensor]) -> list[bool]:
    """Per tensor: contiguous, not a lazy neg/conj view, 8-byte aligned and whole words, so that its words are
    its memory as it is (the usual case; read in a few C passes)."""
    T = torch.Tensor
    return [
        c and not n and not j and p % 8 == 0 and b % 8 == 0
        for c, n, j, p, b in zip(
            map(T.is_contiguous, tensors),
            map(T.is_neg, tensors),
            map(T.is_conj, tensors),
            map(T.data_ptr, tensors),
            map(_NBYTES, tensors),
        )
    ]


def _sums_words(tensors: Sequence[torch.Tensor], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's sums of regular tensors (`_regular`), its table made from their addresses and sizes
    alone: no per-tensor views or copies."""
    num_words = [n // 8 for n in map(_NBYTES, tensors)]
    return _sums_table(list(map(torch.Tensor.data_ptr, tensors)), num_words, device)


def _sums_general(tensors: Sequence[torch.Tensor], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Any tensors: each read as its bytes (copied where not contiguous or aligned), the partial last word
    zero-padded."""
    raws = [_bytes(t) for t in tensors]
    words = [r[: r.numel() - r.numel() % 8].view(torch.int64) for r in raws]
    if available(device):  # CUDA with Triton (or Triton's CPU interpreter, in tests)
        s0, s1 = _sums_table([w.data_ptr() for w in words], [w.numel() for w in words], device)
    else:
        s0, s1 = _sums_each(words, device)
    for i, r in enumerate(raws):
        if r.numel() % 8:  # the last, partial word, zero-padded
            word = r.new_zeros(8)
            word[: r.numel() % 8] = r[r.numel() - r.numel() % 8 :]
            tail = word.view(torch.int64)[0]
            s0[i] += tail
            s1[i] += tail * words[i].numel()
    return s0, s1


def _sums_flat(tensors: Sequence[torch.Tensor], device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Many small tensors of whole words: each dtype's tensors flattened by one C call into one run of words
    (in each tensor's logical order, as `_bytes` reads it), then two segmented sums; no per-tensor views.
    None where a tensor has a partial word or is large (the general path takes those)."""
    nbytes = list(map(_NBYTES, tensors))
    if max(nbytes) > ROW_WORDS * 8 or any(n % 8 for n in nbytes) or any(t.device != device for t in tensors):
        return None
    if any(map(torch.Tensor.is_neg, tensors)) or any(map(torch.Tensor.is_conj, tensors)):
        return None  # lazy views: the general path resolves them
    groups: dict[torch.dtype, list[int]] = {}
    for i, dtype in enumerate(map(_DTYPE, tensors)):
        groups.setdefault(dtype, []).append(i)
    s0 = torch.zeros(len(tensors), dtype=torch.int64, device=device)
    s1 = torch.zeros(len(tensors), dtype=torch.int64, device=device)
    for idx in groups.values():
        with torch.no_grad():
            flat = _flatten_dense_tensors([tensors[i] for i in idx]).view(torch.uint8)  # one tensor: itself
            if flat.storage_offset() % 8 or flat.data_ptr() % 8:
                flat = flat.clone()
            flat = flat.view(torch.int64)
        a, b = _sums_segments(flat, torch.tensor([nbytes[i] // 8 for i in idx], dtype=torch.int64), device)
        where = torch.tensor(idx, dtype=torch.int64, device=device)
        s0.index_copy_(0, where, a)
        s1.index_copy_(0, where, b)
    return s0, s1


def _sums_each(words: list[torch.Tensor], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    small = [i for i, w in enumerate(words) if w.numel() <= ROW_WORDS]
    s0 = torch.zeros(len(words), dtype=torch.int64, device=device)
    s1 = torch.zeros(len(words), dtype=torch.int64, device=device)
    if small:
        idx = torch.tensor(small, dtype=torch.int64, device=device)
        a, b = _sums_small([words[i] for i in small], device)
        s0.index_copy_(0, idx, a)
        s1.index_copy_(0, idx, b)
    for i in set(range(len(words))) - set(small):
        s0[i], s1[i] = _sums_rows(words[i])
    return s0, s1


def _sums_table(ptrs: list[int], num_words: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The two sums of each run of int64 words at address `ptrs[k]` (8-byte aligned, live until the kernel
    ran), `num_words[k]` long: one kernel launch over a table of chunks (cached per layout), one reduction."""
    s0 = torch.zeros(len(ptrs), dtype=torch.int64, device=device)
    s1 = torch.zeros(len(ptrs), dtype=torch.int64, device=device)
    if sum(num_words) == 0:
        return s0, s1
    plan = _plan(
        ("words", device, tuple(ptrs), tuple(num_words)),
        lambda: _digest_plan(ptrs, num_words, None, device, words=True),
    )
    assert plan is not None  # whole words at 8-byte addresses, as the callers guarantee
    out = torch.empty(plan.num_chunks, 2, dtype=torch.int64, device=device)
    with _on(device):
        _digest_chunks[(plan.num_chunks,)](plan.table, plan.anchors[0], out, ROWS=ROWS, COLS=COLS, num_warps=NUM_WARPS)
    return s0.index_add_(0, plan.owner, out[:, 0]), s1.index_add_(0, plan.owner, out[:, 1])


@dataclass(frozen=True, slots=True)
class ChunkPlan:
    """A kernel's table of chunks in device memory, built once per layout: rows of (word offsets from the
    anchors, position of the chunk's first word in its tensor, words), and each chunk's tensor."""

    table: torch.Tensor
    owner: torch.Tensor
    anchors: tuple[torch.Tensor, ...]
    """Small tensors whose addresses the table's offsets count from (held, so they stay put)."""
    num_chunks: int
    nbytes: torch.Tensor | None = None
    """Each tensor's byte length, on the device (the digest's last term)."""
    offsets: torch.Tensor | None = None
    """Each tensor's global word offset, on the device, where given."""
    rest: tuple[int, ...] = ()
    """Tensors the kernel does not take (the fused copy's fallback)."""


_PLANS: OrderedDict[tuple, ChunkPlan | None] = OrderedDict()
_ROWS_KEPT = 1 << 20
"""Chunk rows of the plans kept (32 MiB of tables at most): a refit digests and copies a few lists of tensors
(the model, each bucket) over and over, each with its own plan; the least recently used go first."""


_PLANS_LOCK = threading.Lock()
"""The cache is shared by every thread of the process that digests or copies."""


def _plan(key: tuple, build: Callable[[], ChunkPlan | None]) -> ChunkPlan | None:
    """The cached plan for `key` (the device, the addresses and the sizes: all a table depends on)."""
    with _PLANS_LOCK:
        if key in _PLANS:
            _PLANS.move_to_end(key)
            return _PLANS[key]
        plan = _PLANS[key] = build()
        rows = lambda p: p.num_chunks if p is not None else 0  # noqa: E731
        total = sum(map(rows, _PLANS.values()))
        while total > _ROWS_KEPT and len(_PLANS) > 1:
            total -= rows(_PLANS.popitem(last=False)[1])
        return plan


def _digest_plan(
    ptrs: Sequence[int],
    sizes: Sequence[int],
    offsets: Sequence[int] | None,
    device: torch.device,
    *,
    words: bool = False,
) -> ChunkPlan | None:
    """The table of runs at `ptrs`, `sizes` long (in words if `words`, else in bytes: then None unless every
    run is whole words at an 8-byte address)."""
    if not words and any(p % 8 or n % 8 for p, n in zip(ptrs, sizes)):
        return None
    num_words = torch.tensor(sizes, dtype=torch.int64) // (1 if words else 8)
    anchor = torch.zeros(2, dtype=torch.int64, device=device)
    starts = (torch.tensor(ptrs, dtype=torch.int64) - anchor.data_ptr()) // 8
    rows, owner = chunk_rows([starts], num_words)
    nbytes = None if words else torch.tensor(sizes, dtype=torch.int64).to(device)
    where = None if offsets is None or not any(offsets) else torch.tensor(offsets, dtype=torch.int64).to(device)
    return ChunkPlan(rows.to(device), owner.to(device), (anchor,), len(rows), nbytes, where)


def chunk_rows(starts: list[torch.Tensor], sizes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Table rows (*word offsets, position, words) of runs of `sizes[k]` words at word offsets `starts[j][k]`
    (one offset tensor per operand, all of one parity per run), cut into chunks of CHUNK_WORDS; and the run
    of each row. A run at an odd offset gives its first word a row of its own, so that every row with a
    whole tile starts at an even word (16-byte aligned), which the kernels' vector loads need."""
    head = (starts[0] & 1) * (sizes > 0)
    peeled = torch.nonzero(head).flatten()
    runs = torch.arange(len(sizes))
    seg_starts = [torch.cat([s[peeled], s + head]) for s in starts]
    seg_base = torch.cat([torch.zeros(len(peeled), dtype=torch.int64), head])
    seg_n = torch.cat([torch.ones(len(peeled), dtype=torch.int64), sizes - head])
    seg_run = torch.cat([peeled, runs])
    counts = (seg_n + CHUNK_WORDS - 1) // CHUNK_WORDS
    which = torch.repeat_interleave(torch.arange(len(seg_n)), counts)
    step = (torch.arange(len(which)) - (torch.cumsum(counts, 0) - counts)[which]) * CHUNK_WORDS
    n = torch.clamp(seg_n[which] - step, max=CHUNK_WORDS)
    cols = [s[which] + step for s in seg_starts] + [seg_base[which] + step, n]
    return torch.stack(cols, dim=1).contiguous(), seg_run[which].contiguous()


@contextlib.contextmanager
def _on(device: torch.device) -> Iterator[None]:
    """Triton launches on the current CUDA device: make it `device` for the launch."""
    if device.type == "cuda" and device.index is not None and device.index != torch.cuda.current_device():
        with torch.cuda.device(device):
            yield
    else:
        yield


class Pending:
    """Digests computed on their devices, not yet read back (so no host synchronisation until `hexes`)."""

    def __init__(self) -> None:
        self._parts: list[tuple[Sequence[int], torch.Tensor]] = []
        self.count = 0

    def add(self, tensors: Sequence[torch.Tensor], offsets: Sequence[int] | None = None) -> None:
        """Digest `tensors` (any devices) after those added before; `offsets` as for `digests`."""
        if offsets is not None and len(offsets) != len(tensors):
            raise ValueError(f"{len(offsets)} offsets for {len(tensors)} tensors: give one word offset per tensor")
        base, self.count = self.count, self.count + len(tensors)
        devices = set(map(_DEVICE, tensors))
        if len(devices) == 1:  # the usual case: no per-tensor indexing
            self._parts.append((range(base, self.count), digests(tensors, offsets)))
            return
        for device in devices:
            idx = [i for i, t in enumerate(tensors) if t.device == device]
            some = None if offsets is None else [offsets[i] for i in idx]
            self._parts.append(([base + i for i in idx], digests([tensors[i] for i in idx], some)))

    def add_digests(self, values: torch.Tensor) -> None:
        """Digests already computed (a `prepared` digest's result), as if their tensors were added."""
        base, self.count = self.count, self.count + len(values)
        self._parts.append((range(base, self.count), values))

    def values(self) -> torch.Tensor:
        """Every digest so far, in the order added, as one int64 tensor on the CPU."""
        out = torch.empty(self.count, dtype=torch.int64)
        for idx, values in self._parts:
            if isinstance(idx, range):
                out[idx.start : idx.stop] = values.cpu()
            else:
                out[torch.tensor(idx, dtype=torch.int64)] = values.cpu()
        return out

    def hexes(self) -> list[str]:
        """Every digest so far, in the order added, as 16-digit hex strings."""
        out = [""] * self.count
        for idx, values in self._parts:
            for i, v in zip(idx, values.cpu().tolist()):
                out[i] = f"{v & ((1 << 64) - 1):016x}"
        return out
