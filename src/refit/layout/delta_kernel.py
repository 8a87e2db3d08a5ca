"""The delta stage's scan and scatter (refit.stages.delta) as Triton kernels, for a bucket on CUDA. Same bytes as
the PyTorch path: the bucket compared in 2-byte units with its image (an odd last byte against the image's zero
pad), the changed units found in increasing order, the payload laid out as docs/PROTOCOL.md says.

The scan of one bucket: where the bucket is sampled, a zeroing and one launch that counts the changed units of
the sample; one launch in which each program compares a chunk of CHUNK units and counts its changed ones (it
does nothing when the sample already says dense); a cumulative sum of the counts; one host sync that reads the
sample's count and the bucket's. For a delta, one more launch writes the table and the values (each program's
place in them is its chunk's prefix) into a scratch payload and the changed units into the image, and one copy
puts the payload into the slot. Written in place the payload would race: its bytes land on units that other
programs are still comparing.

The scatter of a delta payload: a cumulative sum of the block counts, one launch that checks every offset (the
host reads its verdict: one sync), one launch that writes the values into the image. Both check and write from
the payload in the slot, so the image is written only once the whole payload passed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Literal, NamedTuple

import torch

from refit.layout.copy_kernel import _INTERPRET, triton

CHUNK = 16384
"""Units one program of the compare takes (32 KiB of the bucket and of the image); a divisor of a block."""
TILE = 4096
"""Units one program compares per loop step."""
SAMPLES = 1024
"""Sampled units per program of the sample's launch."""
INT32_MAX = (1 << 31) - 1

Scratch = Callable[[str, int, torch.dtype], torch.Tensor]
"""`scratch(name, n, dtype)`: `n` elements of a tensor kept between buckets under `name` (WireImage._scratch)."""

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _units(new, old, u, n, last):  # noqa: ANN001, ANN202
        """Units `u` of the bucket (the odd last byte's unit with a zero high byte) and where they differ from
        the image's."""
        valid = u < n
        a = tl.load(new + u, mask=valid, other=0)
        a = tl.where(u == last, a & 0xFF, a).to(tl.int16)
        b = tl.load(old + u, mask=valid, other=0)
        return a, (a != b) & valid

    @triton.jit
    def _sample(at, new, old, counts, runs, slot, SB: tl.constexpr):  # noqa: ANN001
        """Adds the changed units among the sampled ones (`at`, all whole units) to counts[slot]."""
        i = tl.program_id(0) * SB + tl.arange(0, SB)
        m = i < runs
        u = tl.load(at + i, mask=m, other=0)
        changed = tl.load(new + u, mask=m, other=0) != tl.load(old + u, mask=m, other=0)
        tl.atomic_add(counts + slot, tl.sum(changed.to(tl.int32), axis=0))

    @triton.jit(do_not_specialize=["n", "last", "limit"])
    def _count(new, old, counts, n, last, limit, slot, CHUNK: tl.constexpr, TILE: tl.constexpr):  # noqa: ANN001
        """counts[p]: the changed units of chunk p; 0 (nothing read) when the sample's count exceeds `limit`."""
        start = tl.program_id(0).to(tl.int64) * CHUNK
        n = tl.where(tl.load(counts + slot) <= limit, n, 0)
        acc = tl.zeros([TILE], tl.int32)
        for t in range(0, tl.minimum(n - start, CHUNK).to(tl.int32), TILE):
            _, m = _units(new, old, start + t + tl.arange(0, TILE), n, last)
            acc += m.to(tl.int32)
        tl.store(counts + tl.program_id(0), tl.sum(acc, axis=0))

    @triton.jit(do_not_specialize=["n", "last", "chunks", "count", "at", "head"])
    def _write(
        new,
        old,
        inc,
        p16,
        p32,
        p64,
        n,
        last,
        chunks,
        count,
        at,
        head,  # noqa: ANN001
        CHUNK: tl.constexpr,
        TILE: tl.constexpr,
        PER_BLOCK: tl.constexpr,
    ):
        """Chunk p's changed units into the payload (offsets from int16 `at`, values from int16 `head`, ranks
        from the inclusive prefix `inc`) and the image; a block's first chunk writes the block's count, chunk 0
        the total and the zero pad after the offsets."""
        pid = tl.program_id(0)
        first = tl.load(inc + pid - 1, mask=pid > 0, other=0)
        if pid % PER_BLOCK == 0:
            end = tl.minimum(pid + PER_BLOCK, chunks)
            tl.store(p32 + 2 + pid // PER_BLOCK, (tl.load(inc + end - 1) - first).to(tl.int32))
        if pid == 0:
            tl.store(p64, count.to(tl.int64))
            pad = at + count + tl.arange(0, 4)
            tl.store(p16 + pad, tl.zeros([4], tl.int16), mask=pad < head)
        if tl.load(inc + pid) > first:
            rank = first
            start = pid.to(tl.int64) * CHUNK
            for t in range(0, tl.minimum(n - start, CHUNK).to(tl.int32), TILE):
                u = start + t + tl.arange(0, TILE)
                a, m = _units(new, old, u, n, last)
                r = rank + tl.cumsum(m.to(tl.int32), axis=0) - 1
                tl.store(p16 + at + r, (u & 0xFFFF).to(tl.int16), mask=m)
                tl.store(p16 + head + r, a, mask=m)
                tl.store(old + u, a, mask=m)
                rank += tl.sum(m.to(tl.int32), axis=0)

    @triton.jit(do_not_specialize=["count", "n", "at"])
    def _check(p16, counts, starts, bad, count, n, at, BLOCK: tl.constexpr, TILE: tl.constexpr):  # noqa: ANN001
        """bad[0] += 1 where block p's count is negative; bad[1] += 1 where its count exceeds a block or its
        offsets are not increasing inside the image (reading only the offsets its cumulative count places
        inside the payload's)."""
        pid = tl.program_id(0)
        c = tl.load(counts + pid)
        lo = tl.load(starts + pid) - c
        wrong = (c > BLOCK).to(tl.int32)
        for t in range(0, tl.minimum(c, BLOCK), TILE):
            i = t + tl.arange(0, TILE)
            m = (i < c) & (lo + i >= 0) & (lo + i < count)
            o = tl.load(p16 + at + lo + i, mask=m, other=0).to(tl.int32) & 0xFFFF
            prev = tl.load(p16 + at + lo + i - 1, mask=m & (i > 0), other=0).to(tl.int32) & 0xFFFF
            prev = tl.where(i > 0, prev, -1)
            out = (o <= prev) | (pid.to(tl.int64) * BLOCK + o >= n)
            wrong += tl.sum((m & out).to(tl.int32), axis=0)
        tl.atomic_add(bad, (c < 0).to(tl.int32))
        tl.atomic_add(bad + 1, wrong)

    @triton.jit(do_not_specialize=["at", "head"])
    def _scatter(p16, counts, starts, image, at, head, BLOCK: tl.constexpr, TILE: tl.constexpr):  # noqa: ANN001
        """Block p's changed units into the image (the payload checked by `_check`)."""
        pid = tl.program_id(0)
        c = tl.load(counts + pid)
        lo = tl.load(starts + pid) - c
        for t in range(0, c, TILE):
            i = t + tl.arange(0, TILE)
            m = i < c
            o = tl.load(p16 + at + lo + i, mask=m, other=0).to(tl.int64) & 0xFFFF
            v = tl.load(p16 + head + lo + i, mask=m, other=0)
            tl.store(image + pid.to(tl.int64) * BLOCK + o, v, mask=m)


def scans(buf: torch.Tensor, image: torch.Tensor, nbytes: int) -> bool:
    """Whether `count` and `write` take a bucket of `nbytes` in `buf` against `image`: both hold its whole
    units (where `scatters` takes them)."""
    units = 2 * -(-nbytes // 2)
    return nbytes > 0 and scatters(buf, image) and min(buf.numel(), image.numel()) >= units


def scatters(buf: torch.Tensor, image: torch.Tensor) -> bool:
    """Whether the kernels take `buf` and `image`: Triton where it runs (CUDA, or its interpreter), both flat
    uint8 on one device, 2-byte aligned."""
    if triton is None or not (buf.is_cuda or _INTERPRET) or buf.device != image.device:
        return False
    return all(
        t.dtype == torch.uint8 and t.dim() == 1 and t.is_contiguous() and t.data_ptr() % 2 == 0 for t in (buf, image)
    )


class Counted(NamedTuple):
    """What `count` found in a bucket, and what `write` needs of it."""

    sampled: int
    """Changed units among the sampled ones (0 without a sample)."""
    count: int
    """Changed units of the bucket (0, uncompared, when `sampled` exceeded the limit)."""
    inc: torch.Tensor
    """Per chunk, the changed units up to its end (int64)."""
    nbytes: int


def count(
    buf: torch.Tensor, image: torch.Tensor, nbytes: int, *, at: torch.Tensor | None, limit: int, scratch: Scratch
) -> Counted:
    """Compare bucket `buf[:nbytes]` with `image` (at the sampled units `at` first: over `limit` changed there,
    the whole is not compared). One host sync."""
    n, last = -(-nbytes // 2), nbytes // 2 if nbytes % 2 else -1
    chunks = -(-n // CHUNK)
    counts = scratch("delta.counts", chunks + 1, torch.int32)
    inc = scratch("delta.inc", chunks + 1, torch.int64)
    new, old = _halves(buf, n), _halves(image, n)
    with _on(buf.device):
        counts[chunks:].zero_()
        if at is not None:
            _sample[(-(-at.numel() // SAMPLES),)](at, new, old, counts, at.numel(), chunks, SB=SAMPLES)
        else:
            limit = INT32_MAX
        _count[(chunks,)](new, old, counts, n, last, limit, chunks, CHUNK=CHUNK, TILE=TILE, num_warps=8)
        torch.cumsum(counts, 0, dtype=torch.int64, out=inc)
    total, with_sample = inc[chunks - 1 :].tolist()  # the sample's count rides in the last slot
    return Counted(with_sample - total, total, inc[:chunks], nbytes)


def write(counted: Counted, buf: torch.Tensor, image: torch.Tensor, *, head: int, block: int, scratch: Scratch) -> None:
    """The delta payload of what `count` found into `buf` (its table `head` bytes long, one count per `block`
    units), and the changed units into `image`. Asynchronous."""
    nbytes, total = counted.nbytes, counted.count
    assert block % CHUNK == 0 and head % 8 == 0
    n, last = -(-nbytes // 2), nbytes // 2 if nbytes % 2 else -1
    chunks, size = counted.inc.numel(), head + 2 * total
    payload = scratch("delta.payload", -(-size // 8), torch.int64)
    new, old = _halves(buf, n), _halves(image, n)
    with _on(buf.device):
        _write[(chunks,)](
            new,
            old,
            counted.inc,
            payload.view(torch.int16),
            payload.view(torch.int32),
            payload,
            n,
            last,
            chunks,
            total,
            4 + 2 * -(-n // block),
            head // 2,
            CHUNK=CHUNK,
            TILE=TILE,
            PER_BLOCK=block // CHUNK,
            num_warps=8,
        )
        buf[:size].copy_(payload.view(torch.uint8)[:size])


def scatter(
    payload: torch.Tensor, image: torch.Tensor, *, units: int, count: int, head: int, block: int, scratch: Scratch
) -> Literal["sum", "order"] | None:
    """Write the `count` (> 0) changed units of a delta `payload` (uint8, its table `head` bytes) into `image` of
    `units` units, once its block counts are checked to add up to `count` ("sum" where not) and its offsets to
    increase inside the image ("order" where not): then the image is left untouched. One host sync."""
    blocks = -(-units // block)
    p16 = payload[: head + 2 * count].view(torch.int16)
    counts = payload[8 : 8 + 4 * blocks].view(torch.int32)
    starts = scratch("delta.starts", blocks, torch.int64)
    bad = scratch("delta.bad", 2, torch.int32)
    at, tile = 4 + 2 * blocks, min(TILE, block)
    with _on(payload.device):
        torch.cumsum(counts, 0, dtype=torch.int64, out=starts)
        bad.zero_()
        _check[(blocks,)](p16, counts, starts, bad, count, units, at, BLOCK=block, TILE=tile, num_warps=8)
        total, negative, disordered = torch.cat([starts[-1:], bad.to(torch.int64)]).tolist()
        if negative or total != count:
            return "sum"
        if disordered:
            return "order"
        _scatter[(blocks,)](
            p16, counts, starts, image.view(torch.int16), at, head // 2, BLOCK=block, TILE=tile, num_warps=8
        )
    return None


def _halves(t: torch.Tensor, n: int) -> torch.Tensor:
    return t[: 2 * n].view(torch.int16)


def _on(device: torch.device) -> contextlib.AbstractContextManager[object]:
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
