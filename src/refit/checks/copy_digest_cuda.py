"""Fused copy and digest on CUDA: dst[i].copy_(src[i]) for many pairs in one Triton launch that reads each
source word once, writes it, and sums it into the digest of its destination (docs/PROTOCOL.md: word
positions are positions in the destination tensor).

The kernel walks a table of chunks (source offset, destination offset, position, words), built once per
layout and cached (`refit.checks.tensor_digest.chunk_rows`), with 16-byte loads and stores, and accumulates the
digest's two sums without a 64-bit multiply per word (`refit.checks.tensor_digest._tile_sums`). Pairs it cannot
take (partial last words, addresses that are not whole words or not of one parity, lazy views, a source
on another device, no Triton) are copied by torch and their destinations digested afterwards: the same
values, one more read.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from itertools import chain

import torch

from refit.checks import tensor_digest as digest
from refit.checks.tensor_digest import COLS, NUM_WARPS, ROWS, STEP, ChunkPlan, chunk_rows, digests
from refit.layout.copy_kernel import available, triton

_NBYTES, _DTYPE, _DEVICE = (operator.attrgetter(a) for a in ("nbytes", "dtype", "device"))

if triton is not None:
    import triton.language as tl

    from refit.checks.tensor_digest import _finish, _tile_sums

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
    """Copy srcs[i] into dsts[i] (contiguous, same element count; a pair of two dtypes is cast by torch) and
    return the digest of each destination's bytes, as an int64 tensor on the destinations' device: equal to
    `digests(dsts)` bit for bit. No host synchronisation; the kernel's table is cached per layout (addresses
    and sizes)."""
    _check(dsts, srcs)
    if not dsts:
        return torch.zeros(0, dtype=torch.int64)
    device = dsts[0].device
    if not available(device):
        return _by_torch(dsts, srcs, list(range(len(dsts))), torch.empty(len(dsts), dtype=torch.int64, device=device))
    # the usual case: every pair regular, alignment left to the cached plan; else the pairs the kernel takes
    idx = None if _uniform(dsts, srcs, device) else [i for i, f in enumerate(_fusable(dsts, srcs, device)) if f]
    pd = dsts if idx is None else [dsts[i] for i in idx]
    ps = srcs if idx is None else [srcs[i] for i in idx]
    T = torch.Tensor
    dptrs, sptrs, nbytes = tuple(map(T.data_ptr, pd)), tuple(map(T.data_ptr, ps)), tuple(map(_NBYTES, pd))
    plan = digest._plan(("copy", device, dptrs, sptrs, nbytes), lambda: _copy_plan(dptrs, sptrs, nbytes, device))
    assert plan is not None
    sums = torch.zeros(len(pd), 2, dtype=torch.int64, device=device)
    if plan.num_chunks:
        out = torch.empty(plan.num_chunks, 2, dtype=torch.int64, device=device)
        with digest._on(device):
            _copy_digest_chunks[(plan.num_chunks,)](
                plan.table, plan.anchors[0], plan.anchors[1], out, ROWS=ROWS, COLS=COLS, num_warps=NUM_WARPS
            )
        sums.index_add_(0, plan.owner, out)
    assert plan.nbytes is not None
    fused = sums[:, 1] * STEP + sums[:, 0] + plan.nbytes
    if idx is None and not plan.rest:
        return fused
    taken = range(len(dsts)) if idx is None else idx
    result = fused if idx is None else torch.empty(len(dsts), dtype=torch.int64, device=device)
    if idx is not None and idx:
        result.index_copy_(0, torch.tensor(idx, dtype=torch.int64, device=device), fused)
    rest = sorted({*(taken[r] for r in plan.rest), *(set(range(len(dsts))) - set(taken))})
    return _by_torch(dsts, srcs, rest, result)


def prepared(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> Callable[[], torch.Tensor] | None:
    """`copy_digest_cuda(dsts, srcs)` planned once: a callable that replays the copy and returns the digests,
    with no pass over the tensors per call. Like `BatchedCopy`, it holds raw addresses: valid only while every
    tensor keeps its storage and layout (the caller's layout guard rebuilds it otherwise). None unless every
    pair is of the usual case (one dtype, contiguous, whole words the kernel takes): call `copy_digest_cuda`."""
    _check(dsts, srcs)
    if not dsts:
        return None
    device = dsts[0].device
    if not available(device) or not _uniform(dsts, srcs, device):
        return None
    T = torch.Tensor
    dptrs, sptrs, nbytes = tuple(map(T.data_ptr, dsts)), tuple(map(T.data_ptr, srcs)), tuple(map(_NBYTES, dsts))
    plan = _copy_plan(dptrs, sptrs, nbytes, device)
    if plan.rest:
        return None
    keep, n, size = (list(dsts), list(srcs)), len(dsts), plan.nbytes
    assert size is not None
    launch = _copy_digest_chunks[(plan.num_chunks,)] if plan.num_chunks else None

    def run() -> torch.Tensor:
        assert keep  # the tensors stay alive with the table of their addresses
        sums = torch.zeros(n, 2, dtype=torch.int64, device=device)
        if launch is not None:
            out = torch.empty(plan.num_chunks, 2, dtype=torch.int64, device=device)
            with digest._on(device):
                launch(plan.table, plan.anchors[0], plan.anchors[1], out, ROWS=ROWS, COLS=COLS, num_warps=NUM_WARPS)
            sums.index_add_(0, plan.owner, out)
        return sums[:, 1] * STEP + sums[:, 0] + size

    return run


def kernel(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> Callable[[], object]:
    """For benchmarks: a callable that launches the fused kernel alone over the pairs' cached table (no
    Python per pair, no reduction). Pairs as the usual case of `copy_digest_cuda` takes them."""
    device = dsts[0].device
    T = torch.Tensor
    dptrs, sptrs, nbytes = tuple(map(T.data_ptr, dsts)), tuple(map(T.data_ptr, srcs)), tuple(map(_NBYTES, dsts))
    plan = digest._plan(("copy", device, dptrs, sptrs, nbytes), lambda: _copy_plan(dptrs, sptrs, nbytes, device))
    if plan is None or plan.rest or not plan.num_chunks or not available(device):
        raise ValueError("the fused kernel alone needs Triton and whole-word pairs at 8-byte addresses of one parity")
    out = torch.empty(plan.num_chunks, 2, dtype=torch.int64, device=device)
    launch = _copy_digest_chunks[(plan.num_chunks,)]
    return lambda: launch(plan.table, *plan.anchors, out, ROWS=ROWS, COLS=COLS, num_warps=NUM_WARPS)


def _by_torch(
    dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor], rest: list[int], out: torch.Tensor
) -> torch.Tensor:
    """Pairs `rest` copied by torch and their destinations digested (a second read), into `out`."""
    for i in rest:
        dsts[i].copy_(srcs[i])
    where = torch.tensor(rest, dtype=torch.int64, device=out.device)
    return out.index_copy_(0, where, digests([dsts[i] for i in rest]).to(out.device))


def _check(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> None:
    """One clear error for the first pair that breaks the contract; a few C passes when none does."""
    if len(dsts) != len(srcs):
        raise ValueError(f"copy_digest_cuda needs as many destinations ({len(dsts)}) as sources ({len(srcs)})")
    T = torch.Tensor
    numels_match = list(map(T.numel, dsts)) == list(map(T.numel, srcs))
    if numels_match and all(map(T.is_contiguous, dsts)) and len(set(map(_DEVICE, dsts))) <= 1:
        return
    for k, (d, s) in enumerate(zip(dsts, srcs)):
        if d.numel() != s.numel() or not d.is_contiguous():
            raise ValueError(
                f"pair {k}: destination of {d.numel()} elements (contiguous: {d.is_contiguous()}), source of "
                f"{s.numel()}: give contiguous destinations of the sources' element count"
            )
        if d.device != dsts[0].device:
            raise ValueError(f"pair {k}: destinations on {d.device} and {dsts[0].device}: give one device per call")


def _uniform(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor], device: torch.device) -> bool:
    """Every pair of one dtype, every source contiguous on `device`, no lazy views: then only addresses and
    sizes decide (the plan)."""
    T = torch.Tensor
    return (
        list(map(_DTYPE, dsts)) == list(map(_DTYPE, srcs))
        and all(map(T.is_contiguous, srcs))
        and set(map(_DEVICE, srcs)) == {device}
        and not any(map(T.is_neg, chain(dsts, srcs)))
        and not any(map(T.is_conj, chain(dsts, srcs)))
    )


def _fusable(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor], device: torch.device) -> list[bool]:
    """Per pair: the kernel takes it (one dtype, whole words at 8-byte addresses of one parity, no lazy views)."""
    T = torch.Tensor
    return [
        sd == device
        and st == dt
        and sc
        and not (sn or sj or dn or dj)
        and nb % 8 == 0
        and sp % 8 == 0
        and (dp - sp) % 16 == 0
        for sd, st, dt, sc, sn, sj, dn, dj, nb, sp, dp in zip(
            map(_DEVICE, srcs),
            map(_DTYPE, srcs),
            map(_DTYPE, dsts),
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


def _copy_plan(dptrs: Sequence[int], sptrs: Sequence[int], nbytes: Sequence[int], device: torch.device) -> ChunkPlan:
    """The table of the pairs the kernel takes (whole words, 8-byte addresses of one parity); the rest listed."""
    ok = [n % 8 == 0 and s % 8 == 0 and (d - s) % 16 == 0 for d, s, n in zip(dptrs, sptrs, nbytes)]
    taken = torch.tensor([i for i, f in enumerate(ok) if f], dtype=torch.int64)
    src_anchor = torch.zeros(2, dtype=torch.int64, device=device)
    dst_anchor = torch.zeros(2, dtype=torch.int64, device=device)
    src_off = (torch.tensor(sptrs, dtype=torch.int64)[taken] - src_anchor.data_ptr()) // 8
    dst_off = (torch.tensor(dptrs, dtype=torch.int64)[taken] - dst_anchor.data_ptr()) // 8
    rows, owner = chunk_rows([dst_off, src_off], torch.tensor(nbytes, dtype=torch.int64)[taken] // 8)
    table = rows[:, [1, 0, 2, 3]].contiguous()  # (source, destination, position, words)
    size = torch.tensor(nbytes, dtype=torch.int64).to(device)
    rest = tuple(i for i, f in enumerate(ok) if not f)
    return ChunkPlan(table.to(device), taken[owner].to(device), (src_anchor, dst_anchor), len(rows), size, None, rest)
