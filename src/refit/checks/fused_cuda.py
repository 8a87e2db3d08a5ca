"""Fused copy and digest on CUDA: dst[i].copy_(src[i]) for many pairs in one Triton launch that reads each
source word once, writes it, and sums it into the digest of its destination (docs/PROTOCOL.md: word
positions are positions in the destination tensor).

The kernel walks a table of chunks (source offset, destination offset, position, words), built once per
layout and cached (`refit.checks.digest.chunk_rows`), with 16-byte loads and stores, and accumulates the
digest's two sums without a 64-bit multiply per word (`refit.checks.digest._tile_sums`). Pairs it cannot
take (partial last words, addresses that are not whole words or not of one parity, lazy views, a source
on another device, no Triton) are copied by torch and their destinations digested afterwards: the same
values, one more read.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import torch

from refit.checks import digest
from refit.checks.digest import COLS, NUM_WARPS, ROWS, STEP, ChunkPlan, chunk_rows, digests
from refit.layout.copy_kernel import available, triton

_NBYTES = operator.attrgetter("nbytes")

if triton is not None:
    import triton.language as tl

    from refit.checks.digest import _finish, _tile_sums

    @triton.jit
    def _copy_digest_chunks(table, src, dst, out, ROWS: tl.constexpr, COLS: tl.constexpr):
        """Chunk c = row c of `table`: (source and destination word offsets from `src` and `dst`, position
        of its first word in the destination, words): copied, and its two sums stored."""
        c = tl.program_id(0).to(tl.int64)
        so = tl.load(table + c * 4)
        do = tl.load(table + c * 4 + 1)
        base = tl.load(table + c * 4 + 2)
        n = tl.load(table + c * 4 + 3)
        idx = (tl.arange(0, ROWS)[:, None] * COLS + tl.arange(0, COLS)[None, :]).to(tl.int64)
        a = tl.zeros([COLS], dtype=tl.int64)
        t = tl.zeros([COLS], dtype=tl.int64)
        b = tl.zeros([COLS], dtype=tl.int64)
        full = n // (ROWS * COLS)
        for k in range(0, full):
            s_at = tl.multiple_of(so + k * (ROWS * COLS), 2)
            d_at = tl.multiple_of(do + k * (ROWS * COLS), 2)
            w = tl.load(src + s_at + idx, cache_modifier=".cg")
            tl.store(dst + d_at + idx, w, cache_modifier=".cs")
            a, t, b = _tile_sums(w, a, t, b, ROWS)
        done = full * (ROWS * COLS)
        if done < n:
            mask = idx < n - done
            w = tl.load(src + so + done + idx, mask=mask, other=0)
            tl.store(dst + do + done + idx, w, mask=mask)
            a, t, b = _tile_sums(w, a, t, b, ROWS)
            full += 1
        s0, s1 = _finish(a, t, b, full, base, ROWS, COLS)
        tl.store(out + c * 2, s0)
        tl.store(out + c * 2 + 1, s1)


def copy_digest_cuda(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> torch.Tensor:
    """Copy srcs[i] into dsts[i] (contiguous, same dtype and element count) and return the digest of each
    destination's bytes, as an int64 tensor on the destinations' device: equal to `digests(dsts)` bit for
    bit. No host synchronisation."""
    _check(dsts, srcs)
    if not dsts:
        return torch.zeros(0, dtype=torch.int64)
    device = dsts[0].device
    fused = _fusable(dsts, srcs, device)
    s0 = torch.zeros(len(dsts), dtype=torch.int64, device=device)
    s1 = torch.zeros(len(dsts), dtype=torch.int64, device=device)
    if any(fused):
        idx = [i for i, f in enumerate(fused) if f]
        a, b = _run([dsts[i] for i in idx], [srcs[i] for i in idx], device)
        if len(idx) == len(dsts):
            s0, s1 = a, b
        else:
            where = torch.tensor(idx, dtype=torch.int64, device=device)
            s0.index_copy_(0, where, a)
            s1.index_copy_(0, where, b)
    nbytes = torch.tensor(list(map(_NBYTES, dsts)), dtype=torch.int64, device=device)
    out = s1 * STEP + s0 + nbytes
    rest = [i for i, f in enumerate(fused) if not f]
    if rest:
        for i in rest:
            dsts[i].copy_(srcs[i])
        out.index_copy_(0, torch.tensor(rest, dtype=torch.int64, device=device), digests([dsts[i] for i in rest]))
    return out


def _check(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> None:
    if len(dsts) != len(srcs):
        raise ValueError(f"copy_digest_cuda needs as many destinations ({len(dsts)}) as sources ({len(srcs)})")
    for k, (d, s) in enumerate(zip(dsts, srcs)):
        if d.dtype != s.dtype or d.numel() != s.numel() or not d.is_contiguous():
            raise ValueError(
                f"pair {k}: destination {d.dtype} x {d.numel()} (contiguous: {d.is_contiguous()}) and source "
                f"{s.dtype} x {s.numel()}: give contiguous destinations of the sources' dtype and element count"
            )
        if d.device != dsts[0].device:
            raise ValueError(f"pair {k}: destinations on {d.device} and {dsts[0].device}: give one device per call")


def _fusable(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor], device: torch.device) -> list[bool]:
    """Per pair: the kernel takes it (whole words at 8-byte addresses of one parity, no lazy views)."""
    if not available(device):
        return [False] * len(dsts)
    T = torch.Tensor
    return [
        sd == device and sc and not (sn or sj or dn or dj) and nb % 8 == 0 and sp % 8 == 0 and (dp - sp) % 16 == 0
        for sd, sc, sn, sj, dn, dj, nb, sp, dp in zip(
            (s.device for s in srcs),
            map(T.is_contiguous, srcs),
            map(T.is_neg, srcs),
            map(T.is_conj, srcs),
            map(T.is_neg, dsts),
            map(T.is_conj, dsts),
            map(_NBYTES, dsts),
            map(T.data_ptr, srcs),
            map(T.data_ptr, dsts),
        )
    ]


def _run(dsts: list[torch.Tensor], srcs: list[torch.Tensor], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel over pairs it takes: one launch, then one reduction of the chunks' sums per pair."""
    s0 = torch.zeros(len(dsts), dtype=torch.int64, device=device)
    s1 = torch.zeros(len(dsts), dtype=torch.int64, device=device)
    dptrs, sptrs = [d.data_ptr() for d in dsts], [s.data_ptr() for s in srcs]
    words = [d.nbytes // 8 for d in dsts]
    if sum(words) == 0:
        return s0, s1
    key = ("copy", device, tuple(dptrs), tuple(sptrs), tuple(words))
    plan = digest._plan(key, lambda: _copy_plan(dptrs, sptrs, words, device))
    out = torch.empty(plan.num_chunks, 2, dtype=torch.int64, device=device)
    with digest._on(device):
        _copy_digest_chunks[(plan.num_chunks,)](
            plan.table, plan.anchors[0], plan.anchors[1], out, ROWS=ROWS, COLS=COLS, num_warps=NUM_WARPS
        )
    return s0.index_add_(0, plan.owner, out[:, 0]), s1.index_add_(0, plan.owner, out[:, 1])


def _copy_plan(dptrs: list[int], sptrs: list[int], words: list[int], device: torch.device) -> ChunkPlan:
    src_anchor = torch.zeros(2, dtype=torch.int64, device=device)
    dst_anchor = torch.zeros(2, dtype=torch.int64, device=device)
    src_off = (torch.tensor(sptrs, dtype=torch.int64) - src_anchor.data_ptr()) // 8
    dst_off = (torch.tensor(dptrs, dtype=torch.int64) - dst_anchor.data_ptr()) // 8
    rows, owner = chunk_rows([dst_off, src_off], torch.tensor(words, dtype=torch.int64))
    table = rows[:, [1, 0, 2, 3]].contiguous()  # (source, destination, position, words)
    return ChunkPlan(table.to(device), owner.to(device), (src_anchor, dst_anchor), len(rows))
