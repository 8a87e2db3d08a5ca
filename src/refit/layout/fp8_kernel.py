"""The FP8 block rule of `refit.layout.fp8` as one Triton kernel launch per tensor: each program quantizes one
block (reads the float values once, writes the FP8 bytes and the block's scale), where the PyTorch path makes
about nine passes over the tensor. Same bytes as the PyTorch path: the divisions round to nearest (`div_rn`),
the cast to FP8 rounds to nearest even, and the scale's UE8M0 rounding works on the float's bits.

A block holding NaN or +-Inf is not refused here: the kernel raises the tensor's flag, and the caller runs
the PyTorch path on a flagged tensor to name the block (refit.layout.fp8.quantize_many).
"""

from __future__ import annotations

import contextlib

import torch

from refit.layout.copy_kernel import _INTERPRET, triton

MAX_GRID_COLUMNS = 65535
"""CUDA's limit on a grid's second dimension: block columns beyond it go through the PyTorch path."""
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _quantize(x_ptr, q_ptr, s_ptr, flag_ptr, rows, cols, fp8_max, smallest,  # noqa: ANN001
                  BM: tl.constexpr, BN: tl.constexpr, UE8M0: tl.constexpr, EXPONENT: tl.constexpr):  # fmt: skip
        pid_r, pid_c = tl.program_id(0), tl.program_id(1)
        block_rows, block_cols = tl.cdiv(rows, BM), tl.cdiv(cols, BN)
        lead, br = pid_r // block_rows, pid_r % block_rows
        r = br * BM + tl.arange(0, BM)
        c = pid_c * BN + tl.arange(0, BN)
        mask = (r[:, None] < rows) & (c[None, :] < cols)
        offs = lead.to(tl.int64) * rows * cols + r[:, None].to(tl.int64) * cols + c[None, :]
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        amax = tl.max(tl.max(tl.abs(x), axis=1), axis=0)
        nans = tl.sum(tl.sum((x != x).to(tl.int32), axis=1), axis=0)
        tl.store(flag_ptr, 1, mask=(nans > 0) | (amax == float("inf")))
        scale = tl.maximum(tl.div_rn(amax, fp8_max), smallest)
        scale = tl.where(amax == 0.0, 1.0, scale)
        exponent = 0
        if UE8M0:
            bits = scale.to(tl.int32, bitcast=True)
            exponent = (bits >> 23) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
            scale = (exponent << 23).to(tl.float32, bitcast=True)
        q = tl.div_rn(x, scale)
        q = tl.minimum(tl.maximum(q, -fp8_max), fp8_max)
        tl.store(q_ptr + offs, q.to(q_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)
        if EXPONENT:
            tl.store(s_ptr + pid_r * block_cols + pid_c, exponent.to(tl.uint8))
        else:
            tl.store(s_ptr + pid_r * block_cols + pid_c, scale)


def applies(x: torch.Tensor, block: tuple[int, int], q: torch.Tensor, scales: torch.Tensor) -> bool:
    """Whether the kernel takes this tensor: Triton where it runs (CUDA, or its interpreter), contiguous
    tensors on one device, block sides that are powers of two, and a grid CUDA can launch."""
    if triton is None or not (x.is_cuda or _INTERPRET) or x.dtype not in _DTYPES or x.numel() == 0:
        return False
    if not (x.is_contiguous() and q.is_contiguous() and scales.is_contiguous()):
        return False
    if len({x.device, q.device, scales.device}) != 1:
        return False
    if any(b & (b - 1) or b > 256 for b in block):
        return False
    cols = x.shape[-1]
    return -(-cols // block[1]) <= MAX_GRID_COLUMNS


def launch(
    x: torch.Tensor,
    q: torch.Tensor,
    scales: torch.Tensor,
    flag: torch.Tensor,
    *,
    block: tuple[int, int],
    fp8_max: float,
    smallest: float,
    ue8m0: bool,
) -> None:
    """Quantize `x` into `q` (x's shape, FP8) and `scales` (float32, or uint8 exponents with `ue8m0`); sets
    `flag` (one int32) to 1 where a block holds NaN or +-Inf. Asynchronous, as any launch."""
    rows, cols = (1, x.shape[0]) if x.dim() == 1 else (x.shape[-2], x.shape[-1])
    lead = x.numel() // (rows * cols)
    bm, bn = block
    grid = (lead * -(-rows // bm), -(-cols // bn))
    with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
        _quantize[grid](
            x, q, scales, flag, rows, cols, fp8_max, smallest,
            BM=bm, BN=bn, UE8M0=ue8m0, EXPONENT=scales.dtype == torch.uint8, num_warps=8,
        )  # fmt: skip
