"""BatchedCopy: dst[i].copy_(src[i]) for many tensors in one kernel launch per dtype pair, not one per tensor.

On CUDA with Triton, the copies are cut once, at construction, into a table of chunks (source offset,
target offset, length) in device memory; each run is one launch of a kernel that walks that table
with 16-byte loads and stores, casting where source and target dtypes differ. Every pair the kernel
cannot take (CPU tensors, non-contiguous views, unaligned addresses, dtypes Triton does not cast, no
Triton) goes through `torch._foreach_copy_` or `copy_` instead, so the result is always exactly
what `copy_` gives.

The table holds raw addresses of the tensors given at construction: it is valid only while those
tensors keep their storage and layout. Whoever caches a BatchedCopy must rebuild it when they change.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass

import torch

from refit.layout.private_dir import triton_cache_private

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
"""Triton's CPU interpreter (tests only): then the kernel also takes CPU tensors."""

triton = None
if torch.cuda.is_available() or _INTERPRET:  # importing Triton takes ~0.2 s: only where it can run
    try:  # Triton ships with CUDA builds of torch; CPU builds and other platforms go without it.
        import triton
        import triton.language as tl
    except ImportError:  # pragma: no cover - depends on the install
        triton = None
    if triton is not None and not triton_cache_private():  # Triton loads host code it compiled from its cache
        triton = None

_foreach_copy = getattr(torch, "_foreach_copy_", None)

CHUNK_BYTES = 256 << 10
"""Bytes of one chunk (one program of the kernel); large enough that scheduling programs is free,
small enough that a few big tensors still spread over every multiprocessor."""
BLOCK_BYTES = 64 << 10
"""Bytes one program moves per loop step. On an H200, 64 KiB steps, 16 warps and 256 KiB chunks copied
the 7B and MoE shape sets at 1.06x a flat copy of their bytes (8 to 64 KiB, 4 to 32 warps, 256 KiB to
4 MiB chunks swept; `python -m refit.tools.bench.copybench`)."""
NUM_WARPS = 16
ALIGN = 16
"""Source and target addresses must be multiples of this for the kernel (it moves 16 bytes per access)."""

_CASTS = {
    (torch.float32, torch.bfloat16),
    (torch.bfloat16, torch.float32),
    (torch.float16, torch.bfloat16),
    (torch.float16, torch.float32),
}
"""(source, target) dtypes the kernel converts, rounding to nearest even as `copy_` does: each checked
bitwise against `copy_` on an H200 (fp16 to fp32 is exact); other casts go through torch."""
_WORDS = (torch.int32, torch.int16, torch.uint8)
"""Word types of plain copies, widest first: the widest that divides a pair's size is used."""
PROGRAMS = int(os.environ.get("REFIT_COPY_PROGRAMS", "0"))
"""0: one program per chunk (fastest alone). k > 0: at most k programs, each walking every k-th chunk: a
slower copy that leaves memory bandwidth to a collective running beside it."""
BESIDE_COLLECTIVE = 66
"""Programs for copies that overlap a broadcast on the same device: on an H200 pair, capping pack and
unpack at 24 or 66 programs took a 7B nccl refit from 1.17x to 1.06x the raw broadcast (66: MoE 1.24x)."""
_programs: ContextVar[int] = ContextVar("refit_copy_programs", default=PROGRAMS)


@contextlib.contextmanager
def sharing_device(programs: int = BESIDE_COLLECTIVE) -> Iterator[None]:
    """BatchedCopy plans made inside take at most `programs` programs (unless told otherwise): wrap the
    packing and loading that overlap a collective, so the copy leaves it memory bandwidth."""
    token = _programs.set(programs)
    try:
        yield
    finally:
        _programs.reset(token)


def available(device: torch.device) -> bool:
    """Whether the kernel can run on `device`."""
    if triton is None:
        return False
    return device.type == "cuda" or (_INTERPRET and device.type == "cpu")


if triton is not None:

    @triton.jit
    def _copy_chunks(table, num_rows, src, dst, BLOCK: tl.constexpr, VEC: tl.constexpr):
        """Program p copies table rows p, p + P, ... (source offset, target offset, length), in elements."""
        lane = tl.arange(0, BLOCK)
        for r in range(tl.program_id(0), num_rows, tl.num_programs(0)):
            row = table + r * 3
            s0 = tl.load(row)
            d0 = tl.load(row + 1)
            n = tl.load(row + 2)
            full = n - n % BLOCK
            for i in range(0, full, BLOCK):
                # Row offsets are multiples of VEC (checked when the table is built): 16-byte accesses.
                so = tl.max_contiguous(tl.multiple_of(s0 + i + lane, VEC), BLOCK)
                do = tl.max_contiguous(tl.multiple_of(d0 + i + lane, VEC), BLOCK)
                x = tl.load(src + so, cache_modifier=".cg")
                tl.store(dst + do, x.to(dst.dtype.element_ty), cache_modifier=".cs")
            if full < n:
                mask = full + lane < n
                x = tl.load(src + s0 + full + lane, mask=mask)
                tl.store(dst + d0 + full + lane, x.to(dst.dtype.element_ty), mask=mask)


@dataclass(slots=True)
class _Launch:
    """One kernel launch: the chunk table of every pair of one (device, source dtype, target dtype) group."""

    table: torch.Tensor
    src_anchor: torch.Tensor
    """A small tensor of the source element type; table offsets count elements from its address."""
    dst_anchor: torch.Tensor
    block: int
    vec: int
    num_chunks: int
    num_programs: int
    num_warps: int

    def run(self) -> None:
        device = self.table.device
        if device.type == "cuda" and device.index != torch.cuda.current_device():  # Triton launches on the current one
            with torch.cuda.device(device):
                self._go()
        else:
            self._go()

    def _go(self) -> None:
        _copy_chunks[(self.num_programs,)](
            self.table,
            self.num_chunks,
            self.src_anchor,
            self.dst_anchor,
            BLOCK=self.block,
            VEC=self.vec,
            num_warps=self.num_warps,
        )


def _key(d: torch.Tensor, s: torch.Tensor) -> tuple[torch.dtype, torch.dtype] | None:
    """The kernel's element types for the pair (d, s), or None when it goes through torch."""
    if d.device != s.device or not available(d.device) or d.numel() != s.numel() or d.numel() == 0:
        return None
    if not (d.is_contiguous() and s.is_contiguous()) or d.data_ptr() % ALIGN or s.data_ptr() % ALIGN:
        return None
    if s.is_neg() or s.is_conj() or d.is_neg() or d.is_conj():  # lazy views: the memory holds other values
        return None
    if d.dtype == s.dtype:  # a plain byte copy, in the widest words that divide its size
        word = next(w for w in _WORDS if d.nbytes % w.itemsize == 0)
        return word, word
    if (s.dtype, d.dtype) in _CASTS and d.device.type == "cuda":  # the interpreter truncates instead of rounding
        return s.dtype, d.dtype
    return None


def _table(
    pairs: list[tuple[int, int, int]],
    src_base: int,
    dst_base: int,
    src_size: int,
    dst_size: int,
    chunk: int,
    device: torch.device,
) -> torch.Tensor:
    """Rows (source offset, target offset, length) in elements, `chunk` elements at most each."""
    p = torch.tensor(pairs, dtype=torch.int64).reshape(-1, 3)
    src_off, dst_off, n = (p[:, 0] - src_base) // src_size, (p[:, 1] - dst_base) // dst_size, p[:, 2]
    counts = (n + chunk - 1) // chunk
    which = torch.repeat_interleave(torch.arange(len(n)), counts)
    start = (torch.arange(len(which)) - (torch.cumsum(counts, 0) - counts)[which]) * chunk
    length = torch.clamp(n[which] - start, max=chunk)
    return torch.stack([src_off[which] + start, dst_off[which] + start, length], 1).contiguous().to(device)


def _launch(
    device: torch.device,
    st: torch.dtype,
    dt: torch.dtype,
    pairs: list[tuple[torch.Tensor, torch.Tensor]],
    chunk_bytes: int,
    block_bytes: int,
    num_warps: int,
    programs: int,
) -> _Launch:
    src_anchor = torch.empty(ALIGN, dtype=st, device=device)
    dst_anchor = torch.empty(ALIGN, dtype=dt, device=device)
    ss, ds = src_anchor.element_size(), dst_anchor.element_size()
    rows = [(s.data_ptr(), d.data_ptr(), d.nbytes // ds if st == dt else d.numel()) for d, s in pairs]
    width = max(ss, ds)
    table = _table(rows, src_anchor.data_ptr(), dst_anchor.data_ptr(), ss, ds, chunk_bytes // width, device)
    grid = min(len(table), programs) if programs > 0 else len(table)
    return _Launch(table, src_anchor, dst_anchor, block_bytes // width, ALIGN // width, len(table), grid, num_warps)


class BatchedCopy:
    """dst[i].copy_(src[i]) for every i, planned once at construction and replayed by `run()`."""

    def __init__(
        self,
        dst: list[torch.Tensor],
        src: list[torch.Tensor],
        *,
        chunk_bytes: int = CHUNK_BYTES,
        block_bytes: int = BLOCK_BYTES,
        num_warps: int = NUM_WARPS,
        programs: int | None = None,
    ) -> None:
        """The keyword arguments tune the kernel (the bench sweeps them); the defaults suit an H200.
        `programs` None: REFIT_COPY_PROGRAMS, or what an enclosing `sharing_device` says."""
        programs = _programs.get() if programs is None else programs
        if len(dst) != len(src):
            raise ValueError(f"BatchedCopy needs as many targets ({len(dst)}) as sources ({len(src)})")
        if block_bytes < ALIGN or block_bytes & (block_bytes - 1) or chunk_bytes % block_bytes:
            raise ValueError(
                f"block_bytes ({block_bytes}) must be a power of two >= {ALIGN} dividing chunk_bytes ({chunk_bytes})"
            )
        groups: dict[tuple, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self._rest_dst: list[torch.Tensor] = []
        self._rest_src: list[torch.Tensor] = []
        for d, s in zip(dst, src):
            key = _key(d, s)
            if key is None:
                self._rest_dst.append(d)
                self._rest_src.append(s)
            else:
                groups.setdefault((d.device, *key), []).append((d, s))
        self._launches = [
            _launch(dev, st, dt, ps, chunk_bytes, block_bytes, num_warps, programs)
            for (dev, st, dt), ps in groups.items()
        ]
        self._foreach = _foreach_copy is not None and all(
            d.dtype == s.dtype and d.device == s.device for d, s in zip(self._rest_dst, self._rest_src)
        )
        self._keep = (dst, src)  # the table holds raw addresses: keep the tensors alive with it

    @property
    def num_launches(self) -> int:
        """Kernel launches per run (0 when everything goes through torch)."""
        return len(self._launches)

    @property
    def num_fallback(self) -> int:
        """Pairs copied through torch rather than the kernel."""
        return len(self._rest_dst)

    def run(self) -> None:
        for launch in self._launches:
            launch.run()
        if not self._rest_dst:
            return
        if self._foreach:
            _foreach_copy(self._rest_dst, self._rest_src)
            return
        for d, s in zip(self._rest_dst, self._rest_src):
            d.copy_(s)
