"""FP8 block quantization: the reference rule that turns a float weight into `float8_e4m3fn` blocks with
one float32 inverse scale per block, the layout of DeepSeek-V3 and Qwen3-FP8 checkpoints
(`<name>` in FP8, `<name>_scale_inv` of shape ceil(rows/128) x ceil(cols/128), `w ~ q.float() * scale_inv`).

The rule, per block (docs/FP8.md is the user-facing statement):
  amax  = max |x| over the block's existing elements, in float32 (the source cast to float32 first);
  scale = amax / fp8_max in float32 (448 for e4m3fn), at least 2**-126 (the smallest normal float32),
          1.0 for an all-zero block; with `scale="ue8m0"`, rounded up to a power of two;
  q     = clamp(x / scale, -fp8_max, fp8_max) cast to the FP8 dtype, round-to-nearest-even.
A block holding NaN or +-Inf is refused with ValueError naming the tensor and the block (`quantize`); a
bucket's quantization (`quantize_deferred`) raises flags on the device instead, read once by `non_finite`.
A block side larger than the tensor is clipped to it: the same blocks, and no padding beyond the tensor.

On CUDA with Triton each tensor is one kernel launch (refit.layout.fp8_kernel); elsewhere, and where the
kernel does not apply, the PyTorch path below runs. Both give the same bytes. The PyTorch path is vectorised
(one pass over padded blocks, no Python loop over blocks) and gives the same bytes on CPU and CUDA:
divisions are tensor by tensor, never by a Python scalar (CUDA turns those into a multiply by the
reciprocal), and the UE8M0 rounding works on the float's bits, not on log2.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal, NamedTuple

import torch

from refit.layout import fp8_kernel

SCALE_SUFFIX = "_scale_inv"
"""What DeepSeek-V3 and Qwen3-FP8 checkpoints (and vLLM's `Fp8LinearMethod`) call a weight's block scales."""

SMALLEST_SCALE = 2.0**-126
"""The smallest normal float32: the floor of every scale, so that none is subnormal or zero."""

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
SOURCE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True, kw_only=True, slots=True)
class BlockFormat:
    """How a weight is cut into blocks and how each block's scale is rounded and stored."""

    dtype: torch.dtype = torch.float8_e4m3fn
    """The FP8 dtype of the quantized values; its largest finite value is the `fp8_max` of the rule."""
    block: tuple[int, int] = (128, 128)
    """Rows x columns of a block (DeepSeek-V3's `weight_block_size`). A 1-D tensor is one row: `block[1]`."""
    scale: Literal["float32", "ue8m0"] = "float32"
    """`float32`: the scale as computed; `ue8m0`: rounded up to a power of two (DeepGEMM's UE8M0 scales)."""
    scale_dtype: torch.dtype = torch.float32
    """How a scale is stored: float32, or uint8 holding the float32's biased exponent (`ue8m0` only)."""
    suffix: str = SCALE_SUFFIX
    """Appended to a weight's name to name its scales."""

    def __post_init__(self) -> None:
        if self.dtype not in FP8_DTYPES:
            raise ValueError(f"dtype ({self.dtype}) must be one of {FP8_DTYPES}")
        if len(self.block) != 2 or any(not isinstance(b, int) or b < 1 for b in self.block):
            raise ValueError(f"block ({self.block}) must be two positive ints (rows, columns)")
        if self.scale not in ("float32", "ue8m0"):
            raise ValueError(f"scale ({self.scale!r}) must be 'float32' or 'ue8m0'")
        if self.scale_dtype not in (torch.float32, torch.uint8):
            raise ValueError(f"scale_dtype ({self.scale_dtype}) must be torch.float32 or torch.uint8")
        if self.scale_dtype == torch.uint8 and self.scale != "ue8m0":
            raise ValueError("scale_dtype torch.uint8 (an exponent byte) needs scale='ue8m0': only powers of two fit")
        if not self.suffix:
            raise ValueError("suffix must not be empty: the scales need a name apart from the weight's")

    @property
    def fp8_max(self) -> float:
        """The largest finite value of `dtype` (448.0 for float8_e4m3fn)."""
        return torch.finfo(self.dtype).max

    def scale_name(self, name: str) -> str:
        """The checkpoint name of `name`'s scales: `...proj.weight` -> `...proj.weight_scale_inv`."""
        return name + self.suffix


DEFAULT_FORMAT = BlockFormat()
"""DeepSeek-V3 / Qwen3-FP8: e4m3fn, 128 x 128 blocks, float32 scales named `<name>_scale_inv`."""


def scale_shape(shape: torch.Size | tuple[int, ...], fmt: BlockFormat = DEFAULT_FORMAT) -> tuple[int, ...]:
    """The shape of the scales of a tensor of `shape`: (*leading, ceil(rows/bm), ceil(cols/bn)); (ceil(n/bn),)
    for a vector of n."""
    shape = tuple(shape)
    if not shape:
        raise ValueError("a 0-d tensor has no blocks: quantize tensors with at least one dimension")
    bm, bn = fmt.block
    if len(shape) == 1:
        return (-(-shape[0] // bn),)
    return (*shape[:-2], -(-shape[-2] // bm), -(-shape[-1] // bn))


def wire_nbytes(shape: torch.Size | tuple[int, ...], fmt: BlockFormat = DEFAULT_FORMAT) -> int:
    """Bytes a quantized tensor of `shape` takes: one per element plus one scale (4 bytes, or 1 as an exponent
    byte) per block."""
    num_scales = math.prod(scale_shape(shape, fmt))
    return math.prod(shape) * fmt.dtype.itemsize + num_scales * fmt.scale_dtype.itemsize


def quantize(
    x: torch.Tensor, fmt: BlockFormat = DEFAULT_FORMAT, *, name: str = "tensor"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize `x` by the block rule: (q of x's shape in `fmt.dtype`, scales of `scale_shape` in
    `fmt.scale_dtype`), on x's device. `name` names the tensor in the error for a non-finite block."""
    check_source(x)
    q = torch.empty(x.shape, dtype=fmt.dtype, device=x.device)
    scales = torch.empty(scale_shape(x.shape, fmt), dtype=fmt.scale_dtype, device=x.device)
    quantize_many([Job(x, fmt, q, scales, name)])
    return q, scales


def quantize_reference(
    x: torch.Tensor, fmt: BlockFormat = DEFAULT_FORMAT, *, name: str = "tensor"
) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize` by the PyTorch path alone (never the kernel): what the kernel is checked against."""
    check_source(x)
    q = torch.empty(x.shape, dtype=fmt.dtype, device=x.device)
    scales = torch.empty(scale_shape(x.shape, fmt), dtype=fmt.scale_dtype, device=x.device)
    why = _why_non_finite(x, fmt, name) if bool(_quantize_to(x, fmt, q, scales)) else ""
    if why:
        raise ValueError(why)
    return q, scales


class Job(NamedTuple):
    """One tensor to quantize: `x` into `q` (x's shape, fmt.dtype) and `scales` (scale_shape, fmt.scale_dtype)."""

    x: torch.Tensor
    fmt: BlockFormat
    q: torch.Tensor
    scales: torch.Tensor
    name: str


Flagged = list[tuple[Sequence[Job], torch.Tensor]]
"""Jobs quantized without a host sync, each group beside its flags on the device (one per job: nonzero where the
job's tensor holds NaN or +-Inf); `non_finite` reads them."""


def quantize_many(jobs: Sequence[Job]) -> None:
    """Quantize every job by the rule (`quantize_deferred`), then read the non-finite flags (one host sync per
    device): ValueError names the first non-finite block."""
    why = non_finite(quantize_deferred(jobs))
    if why:
        raise ValueError(why)


def quantize_deferred(jobs: Sequence[Job]) -> Flagged:
    """Quantize every job by the rule without a host sync: one kernel launch per group of jobs of one format
    where `fp8_kernel` takes them (CUDA with Triton), the PyTorch path for the rest. A non-finite block is not
    refused here: its job's flag is raised, and its q and scales hold no meaningful bytes (`non_finite`)."""
    groups: dict[fp8_kernel.Group, list[Job]] = {}
    flagged: Flagged = []
    for job in jobs:
        x, fmt, q, scales, name = job
        if not fp8_kernel.applies(x, fmt.block, q, scales):
            flagged.append(((job,), _quantize_to(x, fmt, q, scales).view(1)))
            continue
        key = fp8_kernel.Group(
            x.device, x.dtype, q.dtype, scales.dtype, fmt.block, fmt.scale == "ue8m0", fp8_kernel.aligned(x, q)
        )
        groups.setdefault(key, []).append(job)
    for key, group in groups.items():
        fmt = group[0].fmt
        items = [(j.x, j.q, j.scales) for j in group]
        flagged.append((group, fp8_kernel.launch(key, items, fp8_max=fmt.fp8_max, smallest=SMALLEST_SCALE)))
    return flagged


def non_finite(flagged: Flagged) -> str:
    """Why the quantized jobs of `flagged` must not be sent (the first tensor holding NaN or +-Inf, its first
    such block, and how many in all), or ''. Reads the flags once per device (one host sync each)."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for _, flags in flagged:
        by_device.setdefault(flags.device, []).append(flags.to(torch.int32))
    if not any(bool(torch.cat(f).any()) for f in by_device.values()):
        return ""
    for group, flags in flagged:
        for job, flag in zip(group, flags.tolist()):
            if flag:
                return _why_non_finite(job.x, job.fmt, job.name)
    return ""  # pragma: no cover - a raised flag names its job above


def quantize_into(
    x: torch.Tensor,
    fmt: BlockFormat = DEFAULT_FORMAT,
    *,
    out_q: torch.Tensor,
    out_scale: torch.Tensor,
    name: str = "tensor",
) -> None:
    """Quantize `x` straight into bytes of a preallocated bucket: `out_q` (uint8, x.numel() bytes) receives q
    row-major, `out_scale` (uint8, the scales' bytes, offset a multiple of the scale's size) the scales."""
    check_source(x)
    shape = scale_shape(x.shape, fmt)
    q_nbytes, scale_nbytes = x.numel() * fmt.dtype.itemsize, math.prod(shape) * fmt.scale_dtype.itemsize
    for what, out, nbytes in (("out_q", out_q, q_nbytes), ("out_scale", out_scale, scale_nbytes)):
        if out.dtype != torch.uint8 or out.dim() != 1 or not out.is_contiguous():
            raise ValueError(
                f"{what} must be a contiguous 1-d uint8 tensor, got {out.dtype} of shape {tuple(out.shape)}"
            )
        if out.numel() != nbytes:
            raise ValueError(f"{what} holds {out.numel()} bytes; {name} of shape {tuple(x.shape)} needs {nbytes}")
        if out.device != x.device:
            raise ValueError(f"{what} is on {out.device}, {name} on {x.device}: quantize where the bucket lives")
    if out_scale.data_ptr() % fmt.scale_dtype.itemsize:
        raise ValueError(f"out_scale must start at a multiple of {fmt.scale_dtype.itemsize} bytes to hold the scales")
    why = _why_non_finite(x, fmt, name)  # before any byte of the bucket is written
    if why:
        raise ValueError(why)
    q = out_q.view(fmt.dtype).view(x.shape)
    scales = out_scale.view(fmt.scale_dtype).view(shape)
    quantize_deferred([Job(x, fmt, q, scales, name)])


def dequantize(q: torch.Tensor, scale_inv: torch.Tensor, fmt: BlockFormat = DEFAULT_FORMAT) -> torch.Tensor:
    """float32 weights from `q` and its scales: each element `q.float() * scale_inv` of its block."""
    if q.dtype != fmt.dtype:
        raise ValueError(f"q is {q.dtype}; the format's FP8 dtype is {fmt.dtype}")
    expected = scale_shape(q.shape, fmt)
    if tuple(scale_inv.shape) != expected or scale_inv.dtype != fmt.scale_dtype:
        raise ValueError(
            f"scale_inv is {scale_inv.dtype} of shape {tuple(scale_inv.shape)}; q of shape {tuple(q.shape)} "
            f"with blocks {fmt.block} needs {fmt.scale_dtype} of shape {expected}"
        )
    if scale_inv.device != q.device:
        raise ValueError(f"scale_inv is on {scale_inv.device}, q on {q.device}")
    if q.numel() == 0:
        return torch.empty(q.shape, dtype=torch.float32, device=q.device)
    fmt = _clipped(fmt, q)
    padded, rows, cols = _padded(q, fmt, torch.float32)  # a new tensor: q is FP8
    blocks = _as_blocks(padded, fmt)
    blocks.mul_(_decode_scales(scale_inv).reshape(blocks.shape[0], blocks.shape[2])[:, None, :, None])
    return padded[:, :rows, :cols].reshape(q.shape)


def _quantize_to(x: torch.Tensor, fmt: BlockFormat, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The rule, written into `q` (x's shape, fmt.dtype) and `scales` (scale_shape, fmt.scale_dtype); returns
    a 0-d bool on x's device, True where a block holds NaN or +-Inf (no host sync)."""
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.bool, device=x.device)
    fmt = _clipped(fmt, x)
    padded, rows, cols = _padded(x, fmt, x.dtype)
    blocks = _as_blocks(padded, fmt)
    amax = _amax(blocks)
    bad = ~torch.isfinite(amax).all()
    scale = torch.div(amax, amax.new_full((), fmt.fp8_max)).clamp_min_(SMALLEST_SCALE)
    scale.masked_fill_(amax == 0, 1.0)
    if fmt.scale == "ue8m0":
        scale, exponent = _ceil_to_power_of_two(scale)
    # bf16 or fp16 by float32 promotes to float32: the quotient is the float32 one of the rule.
    quotient = torch.div(blocks, scale[:, None, :, None]).clamp_(-fmt.fp8_max, fmt.fp8_max)
    # copy_ casts float32 to FP8 exactly as .to() does: round to nearest, ties to even.
    q.view(padded.shape[0], rows, cols).copy_(quotient.view(padded.shape)[:, :rows, :cols])
    stored = exponent.to(torch.uint8) if fmt.scale_dtype == torch.uint8 else scale
    scales.copy_(stored.view(scales.shape))
    return bad


def _amax(blocks: torch.Tensor) -> torch.Tensor:
    """Per block of a (n, bm, m, bn) view, max |x| in float32. |x| and max are exact in the source dtype, so
    amax needs no float32 copy of x; amax and amin propagate NaN and +-Inf, so one look at the per-block maxima
    finds every non-finite block."""
    return torch.maximum(blocks.amax(dim=(1, 3)), blocks.amin(dim=(1, 3)).neg_()).float()


def _clipped(fmt: BlockFormat, x: torch.Tensor) -> BlockFormat:
    """`fmt` with each block side at most the tensor's (a 1-D tensor is one row): the same blocks, since a
    block's amax is over its existing elements, and padding never larger than the tensor, whatever block a
    peer states."""
    rows, cols = (1, x.shape[0]) if x.dim() == 1 else (x.shape[-2], x.shape[-1])
    block = (min(fmt.block[0], max(rows, 1)), min(fmt.block[1], max(cols, 1)))
    return fmt if block == fmt.block else replace(fmt, block=block)


def _ceil_to_power_of_two(scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(2**ceil(log2(scale)), its biased exponent) for positive normal float32 `scale`, exactly: a float with
    any mantissa bit set moves up one exponent, and the mantissa is dropped."""
    bits = scale.view(torch.int32)
    exponent = (bits >> 23) + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return (exponent << 23).view(torch.float32), exponent


def _decode_scales(scale_inv: torch.Tensor) -> torch.Tensor:
    """float32 scales from stored ones: exponent bytes become 2**(byte - 127)."""
    if scale_inv.dtype == torch.uint8:
        return (scale_inv.to(torch.int32) << 23).view(torch.float32)
    return scale_inv


def _why_non_finite(x: torch.Tensor, fmt: BlockFormat, name: str) -> str:
    """Which block of `x` (by `fmt`'s blocks) first holds NaN or +-Inf, named for the user, or ''."""
    shape = scale_shape(x.shape, fmt)
    fmt = _clipped(fmt, x)
    amax = _amax(_as_blocks(_padded(x, fmt, x.dtype)[0], fmt))
    bad = ~torch.isfinite(amax)
    if not bool(bad.any()):
        return ""
    first = bad.reshape(shape).nonzero()[0]
    value = amax.reshape(shape)[tuple(first)].item()
    what = "NaN" if math.isnan(value) else "an infinite value"
    block = tuple(first.tolist())
    return (
        f"{name}: block {block} holds {what} ({int(bad.sum())} non-finite blocks in all); refit does not quantize "
        "non-finite weights to FP8: check the trainer's last step for a divergence or an overflow"
    )


def check_source(x: torch.Tensor) -> None:
    """ValueError unless `x` is a float tensor of at least one dimension (what the rule quantizes)."""
    if x.dtype not in SOURCE_DTYPES:
        raise ValueError(f"x is {x.dtype}; FP8 block quantization takes one of {SOURCE_DTYPES}")
    if x.dim() == 0:
        raise ValueError("a 0-d tensor has no blocks: quantize tensors with at least one dimension")


def _padded(t: torch.Tensor, fmt: BlockFormat, dtype: torch.dtype) -> tuple[torch.Tensor, int, int]:
    """`t` in `dtype` as contiguous (leading, rows, cols), zero-padded to whole blocks (a copy only where it
    must be), with the unpadded rows and cols. Zeros leave every amax as it is, so a partial block's amax is
    over its existing elements only."""
    rows, cols = (1, t.shape[0]) if t.dim() == 1 else (t.shape[-2], t.shape[-1])
    lead = t.numel() // (rows * cols)
    bm, bn = fmt.block
    padded_rows, padded_cols = -(-rows // bm) * bm, -(-cols // bn) * bn
    t3 = t.reshape(lead, rows, cols)
    if (padded_rows, padded_cols) == (rows, cols):
        return t3.to(dtype, memory_format=torch.contiguous_format), rows, cols
    out = torch.zeros((lead, padded_rows, padded_cols), dtype=dtype, device=t.device)
    out[:, :rows, :cols] = t3
    return out, rows, cols


def _as_blocks(padded: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """A (leading * block rows, bm, block cols, bn) view of a padded (leading, rows, cols) tensor."""
    bm, bn = fmt.block
    lead, rows, cols = padded.shape
    return padded.view(lead * (rows // bm), bm, cols // bn, bn)
