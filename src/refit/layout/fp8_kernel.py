"""The FP8 block rule of `refit.layout.fp8` as one Triton kernel launch for many tensors (a bucket's, per
format): each program quantizes one block (reads the float values once, writes the FP8 bytes and the block's
scale), where the PyTorch path makes about nine passes over each tensor and a launch per tensor. Same bytes
as the PyTorch path: the divisions round to nearest (`div_rn`), the cast to FP8 rounds to nearest even, and
the scale's UE8M0 rounding works on the float's bits.

A block holding NaN or +-Inf is not refused here: the kernel raises the tensor's flag, and the caller runs
the PyTorch path on a flagged tensor to name the block (refit.layout.fp8.quantize_many).
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch

from refit.layout.copy_kernel import _INTERPRET, triton

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _quantize(table, owner, x_base, q_base, s_base, flags, fp8_max, smallest,  # noqa: ANN001
                  BM: tl.constexpr, BN: tl.constexpr, UE8M0: tl.constexpr, EXPONENT: tl.constexpr,
                  ALIGNED: tl.constexpr):  # fmt: skip
        """Program p quantizes one block of tensor owner[p]; its table row holds (x, q, scales offsets in
        elements from the bases, rows, cols, the tensor's first program). ALIGNED: every offset and column
        count is a multiple of 16, which the compiler cannot see in values read from the table: said, its
        loads and stores go 16 bytes wide."""
        pid = tl.program_id(0)
        i = tl.load(owner + pid)
        row = table + i * 6
        x0, q0, s0 = tl.load(row), tl.load(row + 1), tl.load(row + 2)
        rows, cols, first = tl.load(row + 3), tl.load(row + 4), tl.load(row + 5)
        if ALIGNED:
            x0, q0, cols = tl.multiple_of(x0, 16), tl.multiple_of(q0, 16), tl.multiple_of(cols, 16)
        block_rows, block_cols = tl.cdiv(rows, BM), tl.cdiv(cols, BN)
        local = pid - first
        pid_r, pid_c = local // block_cols, local % block_cols
        lead, br = pid_r // block_rows, pid_r % block_rows
        r = br * BM + tl.arange(0, BM)
        c = pid_c * BN + tl.arange(0, BN)
        mask = (r[:, None] < rows) & (c[None, :] < cols)
        offs = lead * rows * cols + r[:, None].to(tl.int64) * cols + c[None, :]
        x = tl.load(x_base + x0 + offs, mask=mask, other=0.0).to(tl.float32)
        amax = tl.max(tl.max(tl.abs(x), axis=1), axis=0)
        nans = tl.sum(tl.sum((x != x).to(tl.int32), axis=1), axis=0)
        tl.store(flags + i, 1, mask=(nans > 0) | (amax == float("inf")))
        scale = tl.maximum(tl.div_rn(amax, fp8_max), smallest)
        scale = tl.where(amax == 0.0, 1.0, scale)
        exponent = 0
        if UE8M0:
            bits = scale.to(tl.int32, bitcast=True)
            exponent = (bits >> 23) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
            scale = (exponent << 23).to(tl.float32, bitcast=True)
        q = tl.div_rn(x, scale)
        q = tl.minimum(tl.maximum(q, -fp8_max), fp8_max)
        out = q.to(q_base.dtype.element_ty, fp_downcast_rounding="rtne")
        tl.store(q_base + q0 + offs, out, mask=mask)
        if EXPONENT:
            tl.store(s_base + s0 + pid_r * block_cols + pid_c, exponent.to(tl.uint8))
        else:
            tl.store(s_base + s0 + pid_r * block_cols + pid_c, scale)


def applies(x: torch.Tensor, block: tuple[int, int], q: torch.Tensor, scales: torch.Tensor) -> bool:
    """Whether the kernel takes this tensor: Triton where it runs (CUDA, or its interpreter), contiguous
    tensors on one device, block sides that are powers of two."""
    if triton is None or not (x.is_cuda or _INTERPRET) or x.dtype not in _DTYPES or x.numel() == 0:
        return False
    if not (x.is_contiguous() and q.is_contiguous() and scales.is_contiguous()):
        return False
    if len({x.device, q.device, scales.device}) != 1:
        return False
    return not any(b & (b - 1) or b > 256 for b in block)


class Group(NamedTuple):
    """Tensors one launch quantizes: the same device, source dtype, FP8 dtype, scale dtype and format."""

    device: torch.device
    x_dtype: torch.dtype
    q_dtype: torch.dtype
    s_dtype: torch.dtype
    block: tuple[int, int]
    ue8m0: bool
    aligned: bool
    """Every tensor's rows are a multiple of 16 elements long and its x and q start 16 elements aligned."""


def aligned(x: torch.Tensor, q: torch.Tensor) -> bool:
    """Whether (x, q) may share a launch whose loads and stores are 16 elements wide (Group.aligned)."""
    return x.shape[-1] % 16 == 0 and all(t.data_ptr() % (16 * t.element_size()) == 0 for t in (x, q))


def launch(group: Group, items: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], *, fp8_max: float,
           smallest: float) -> torch.Tensor:  # fmt: skip
    """Quantize every (x, q, scales) of `group` in one launch: q (x's shape, FP8) and scales (float32, or uint8
    exponents). Returns one int32 flag per item, set to 1 where a block holds NaN or +-Inf. Asynchronous."""
    device, bm, bn = group.device, *group.block
    bases = [torch.empty(1, dtype=d, device=device) for d in (group.x_dtype, group.q_dtype, group.s_dtype)]
    rows_of, first, programs = [], [], 0
    for x, q, scales in items:
        rows, cols = (1, x.shape[0]) if x.dim() == 1 else (x.shape[-2], x.shape[-1])
        offsets = [_offset(t, b) for t, b in zip((x, q, scales), bases)]
        rows_of.append([*offsets, rows, cols, programs])
        first.append(programs)
        programs += x.numel() // (rows * cols) * -(-rows // bm) * -(-cols // bn)
    counts = torch.tensor([b - a for a, b in zip(first, [*first[1:], programs])], device=device)
    table = torch.tensor(rows_of, dtype=torch.int64, device=device)
    owner = torch.repeat_interleave(
        torch.arange(len(items), dtype=torch.int32, device=device), counts, output_size=programs
    )
    flags = torch.zeros(len(items), dtype=torch.int32, device=device)
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        _quantize[(programs,)](
            table, owner, *bases, flags, fp8_max, smallest,
            BM=bm, BN=bn, UE8M0=group.ue8m0, EXPONENT=group.s_dtype == torch.uint8, ALIGNED=group.aligned,
            num_warps=8,
        )  # fmt: skip
    return flags


def _offset(t: torch.Tensor, base: torch.Tensor) -> int:
    """`t`'s address in elements from `base`'s (its dtype's size divides every allocation's address)."""
    delta = t.data_ptr() - base.data_ptr()
    if delta % t.element_size():
        raise ValueError(f"a tensor at {t.data_ptr():#x} is not aligned to its {t.element_size()}-byte elements")
    return delta // t.element_size()
