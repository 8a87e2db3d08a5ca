"""FP8 block quantization (refit.layout.fp8) against a plain per-block reference, bit for bit, plus each edge
rule of docs/FP8.md and CPU-versus-CUDA equality."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from refit.layout.fp8 import (
    DEFAULT_FORMAT,
    SMALLEST_SCALE,
    BlockFormat,
    dequantize,
    quantize,
    quantize_into,
    quantize_reference,
    scale_shape,
    wire_nbytes,
)

FAST = settings(max_examples=60, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SLOW = settings(max_examples=800, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SOURCES = [torch.float32, torch.bfloat16, torch.float16]
E4M3 = torch.float8_e4m3fn


# ---- the reference: one Python iteration per block, scales in Python floats ----


def _f32(v: float) -> float:
    """v rounded to float32 (nearest, ties to even)."""
    return torch.tensor(v, dtype=torch.float64).float().item()


def _ref_scale(amax: float, fmt: BlockFormat) -> float:
    if amax == 0.0:
        return 1.0
    # float64 division then one rounding to float32 equals float32 division (53 >= 2 * 24 + 2).
    scale = max(_f32(amax / fmt.fp8_max), 2.0**-126)
    if fmt.scale == "ue8m0":
        scale = 2.0 ** math.ceil(math.log2(scale))
    return scale


def _matrices(shape: tuple[int, ...]) -> tuple[int, int, int]:
    if len(shape) == 1:
        return 1, 1, shape[0]
    return math.prod(shape[:-2]), shape[-2], shape[-1]


def reference_quantize(x: torch.Tensor, fmt: BlockFormat) -> tuple[torch.Tensor, torch.Tensor]:
    lead, rows, cols = _matrices(tuple(x.shape))
    bm, bn = fmt.block
    mats = x.double().reshape(lead, rows, cols)  # every bf16/fp16/fp32 value is exact in float64
    q = torch.empty((lead, rows, cols), dtype=fmt.dtype)
    scales = torch.empty((lead, -(-rows // bm), -(-cols // bn)), dtype=torch.float64)
    for m in range(lead):
        for i in range(scales.shape[1]):
            for j in range(scales.shape[2]):
                blk = mats[m, i * bm : (i + 1) * bm, j * bn : (j + 1) * bn]
                amax = max(abs(v) for v in blk.flatten().tolist())
                scale = _ref_scale(amax, fmt)
                quotient = (blk / scale).float()  # float64 quotient, rounded once to float32
                q[m, i * bm : (i + 1) * bm, j * bn : (j + 1) * bn] = quotient.clamp(-fmt.fp8_max, fmt.fp8_max).to(
                    fmt.dtype
                )
                scales[m, i, j] = scale
    s = scales.float().reshape(scale_shape(x.shape, fmt))
    if fmt.scale_dtype == torch.uint8:
        s = torch.tensor([int(math.log2(v)) + 127 for v in s.flatten().tolist()], dtype=torch.uint8).reshape(s.shape)
    return q.reshape(x.shape), s


def reference_dequantize(q: torch.Tensor, s: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    lead, rows, cols = _matrices(tuple(q.shape))
    bm, bn = fmt.block
    scales = s.reshape(lead, -(-rows // bm), -(-cols // bn))
    out = torch.empty((lead, rows, cols), dtype=torch.float32)
    qm = q.reshape(lead, rows, cols)
    for m in range(lead):
        for i in range(scales.shape[1]):
            for j in range(scales.shape[2]):
                scale = 2.0 ** (int(scales[m, i, j]) - 127) if s.dtype == torch.uint8 else float(scales[m, i, j])
                blk = qm[m, i * bm : (i + 1) * bm, j * bn : (j + 1) * bn].float()
                out[m, i * bm : (i + 1) * bm, j * bn : (j + 1) * bn] = blk * torch.full_like(blk, scale)
    return out.reshape(q.shape)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int32)


def assert_bitwise(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(_bits(a.cpu()), _bits(b.cpu()))


# ---- inputs: magnitudes over many binades, subnormals, zeros, exact saturation and ties ----

_EXPONENTS = {torch.float32: (-149, 120), torch.bfloat16: (-133, 120), torch.float16: (-24, 14)}
_E4M3_GRID = torch.arange(0, 127, dtype=torch.uint8).view(E4M3).double()
_GRID_AND_TIES = torch.cat([_E4M3_GRID, (_E4M3_GRID[1:] + _E4M3_GRID[:-1]) / 2])


@st.composite
def formats(draw: st.DrawFn, small: bool = True) -> BlockFormat:
    block = draw(st.tuples(st.integers(1, 5), st.integers(1, 5))) if small else (128, 128)
    scale = draw(st.sampled_from(["float32", "ue8m0"]))
    stored = torch.uint8 if scale == "ue8m0" and draw(st.booleans()) else torch.float32
    dtype = draw(st.sampled_from([E4M3, E4M3, torch.float8_e5m2]))
    return BlockFormat(dtype=dtype, block=block, scale=scale, scale_dtype=stored)


@st.composite
def tensors(draw: st.DrawFn, max_side: int = 12) -> torch.Tensor:
    ndim = draw(st.sampled_from([1, 2, 2, 3]))
    shape = tuple(draw(st.integers(1, 3 if d == 0 and ndim == 3 else max_side)) for d in range(ndim))
    dtype = draw(st.sampled_from(SOURCES))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    lowest, highest = _EXPONENTS[dtype]
    lo = draw(st.integers(lowest, highest))
    hi = min(highest, lo + draw(st.integers(0, 40)))
    n = math.prod(shape)
    sign = torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0).double()
    power = torch.randint(lo, hi + 1, (n,), generator=gen).double().exp2()
    if draw(st.booleans()):  # exact FP8 grid points and midpoints (ties), with the block maximum 448 often present
        pick = _GRID_AND_TIES[torch.randint(len(_GRID_AND_TIES), (n,), generator=gen)]
        pick = torch.where(torch.rand(n, generator=gen) < 0.3, 448.0, pick)
        values = sign * pick * 2.0 ** min(lo, highest - 9)  # 448 * 2**e stays finite in the source dtype
    else:
        values = sign * (1 + torch.rand(n, generator=gen, dtype=torch.float64)) * power
    zeros = draw(st.sampled_from([0.0, 0.2, 0.9]))
    values = torch.where(torch.rand(n, generator=gen) < zeros, 0.0, values)
    return values.to(dtype).reshape(shape)


def _check_against_reference(x: torch.Tensor, fmt: BlockFormat) -> None:
    q, s = quantize(x, fmt)
    rq, rs = reference_quantize(x, fmt)
    assert_bitwise(q, rq)
    assert_bitwise(s, rs)
    assert_bitwise(dequantize(q, s, fmt), reference_dequantize(q, s, fmt))


@FAST
@given(x=tensors(), fmt=formats())
def test_quantize_matches_the_per_block_reference_bitwise(x: torch.Tensor, fmt: BlockFormat) -> None:
    _check_against_reference(x, fmt)


@pytest.mark.slow
@SLOW
@given(x=tensors(max_side=40), fmt=formats())
def test_quantize_matches_the_per_block_reference_bitwise_many(x: torch.Tensor, fmt: BlockFormat) -> None:
    _check_against_reference(x, fmt)


@pytest.mark.parametrize("shape", [(130, 257), (128, 128), (300,), (2, 129, 5)])
@pytest.mark.parametrize("scale", ["float32", "ue8m0"])
def test_default_128_blocks_match_the_reference_with_partial_edges(shape: tuple[int, ...], scale: str) -> None:
    gen = torch.Generator().manual_seed(7)
    x = (torch.randn(shape, generator=gen) * torch.rand(shape, generator=gen).pow(8) * 3).to(torch.bfloat16)
    _check_against_reference(x, BlockFormat(scale=scale))


# ---- the edge rules ----


def test_all_zero_block_has_scale_one_and_dequantizes_to_exact_zero() -> None:
    x = torch.zeros(6, 6)
    x[:3, 3:] = 2.0
    q, s = quantize(x, BlockFormat(block=(3, 3)))
    assert s.tolist() == [[1.0, _f32(2.0 / 448.0)], [1.0, 1.0]]
    deq = dequantize(q, s, BlockFormat(block=(3, 3)))
    assert torch.equal(deq[3:], torch.zeros(3, 6)) and not deq[3:].signbit().any()


def test_negative_zero_keeps_its_sign_and_dequantizes_to_zero() -> None:
    q, s = quantize(torch.tensor([-0.0, 0.0]), BlockFormat(block=(1, 2)))
    assert s.item() == 1.0 and q.view(torch.uint8).tolist() == [0x80, 0x00]


@pytest.mark.parametrize("bad,word", [(float("nan"), "NaN"), (float("inf"), "infinite"), (-float("inf"), "infinite")])
def test_non_finite_values_are_refused_naming_tensor_and_block(bad: float, word: str) -> None:
    x = torch.ones(3, 2, 10, dtype=torch.bfloat16)
    x[1, 1, 7] = bad
    with pytest.raises(ValueError, match=rf"layers\.0\.w: block \(1, 0, 1\) holds (an )?{word}"):
        quantize(x, BlockFormat(block=(4, 4)), name="layers.0.w")


def test_a_block_amax_of_448_gives_scale_one_and_exact_values() -> None:
    x = torch.tensor([448.0, -448.0, 1.0, -0.5, 2.0**-9, 240.0])
    q, s = quantize(x, BlockFormat(block=(1, 8)))
    assert s.item() == 1.0 and torch.equal(q.float(), x)
    assert q.view(torch.uint8)[0].item() == 0x7E  # 448, the largest finite e4m3fn


def test_quotients_just_above_448_saturate_to_448_not_nan() -> None:
    amax = 248.65304565429688  # float32 amax / float32(amax / 448) rounds to 448.00003
    assert torch.tensor(amax) / (torch.tensor(amax) / torch.tensor(448.0)) > 448.0
    q, s = quantize(torch.tensor([amax, -amax, 1.0]), BlockFormat(block=(1, 4)))
    assert q.view(torch.uint8).tolist()[:2] == [0x7E, 0xFE]


def test_ties_round_to_the_even_fp8_value() -> None:
    # with 448 in the block the scale is 1: 1.0625 lies between 1.0 and 1.125, 1.1875 between 1.125 and 1.25,
    # 2**-10 between 0 and the smallest subnormal 2**-9, 3 * 2**-10 between 2**-9 and 2**-8.
    x = torch.tensor([448.0, 1.0625, 1.1875, 2.0**-10, 3 * 2.0**-10, -1.0625])
    q, _ = quantize(x, BlockFormat(block=(1, 8)))
    assert q.float().tolist() == [448.0, 1.0, 1.25, 0.0, 2.0**-8, -1.0]


def test_tiny_amax_clamps_the_scale_to_the_smallest_normal_float32() -> None:
    x = torch.tensor([1e-40, -3e-41, 0.0])  # float32 subnormals: amax / 448 would be 2e-43 (subnormal)
    for fmt in (BlockFormat(block=(1, 4)), BlockFormat(block=(1, 4), scale="ue8m0", scale_dtype=torch.uint8)):
        q, s = quantize(x, fmt)
        assert dequantize(q, s, fmt).tolist()[2] == 0.0
        assert (s.item() == SMALLEST_SCALE) if s.dtype == torch.float32 else (s.item() == 1)
        # the values land among e4m3fn's subnormals: the error is at most half their step, 2**-10 * scale
        assert ((dequantize(q, s, fmt) - x).abs() <= 2.0**-10 * SMALLEST_SCALE).all()


def test_ue8m0_rounds_the_scale_up_to_a_power_of_two_exactly() -> None:
    fmt = BlockFormat(block=(1, 1), scale="ue8m0")
    x = torch.tensor([448.0, 448.0 * 2**-20, 448.0 * (1 + 2**-23), 447.99997, 1.0, 3e38])
    _, s = quantize(x, fmt)
    assert s.tolist() == [1.0, 2.0**-20, 2.0, 1.0, 2.0**-8, 2.0**120]
    _, b = quantize(x, BlockFormat(block=(1, 1), scale="ue8m0", scale_dtype=torch.uint8))
    assert b.tolist() == [127, 107, 128, 127, 119, 247]


def test_ue8m0_bytes_and_float_scales_dequantize_alike() -> None:
    x = torch.randn(9, 17)
    f32 = BlockFormat(block=(4, 4), scale="ue8m0")
    u8 = BlockFormat(block=(4, 4), scale="ue8m0", scale_dtype=torch.uint8)
    (q1, s1), (q2, s2) = quantize(x, f32), quantize(x, u8)
    assert_bitwise(q1, q2)
    assert torch.equal(s1, torch.exp2(s2.double() - 127).float())
    assert_bitwise(dequantize(q1, s1, f32), dequantize(q2, s2, u8))


def test_empty_tensors_give_empty_results() -> None:
    q, s = quantize(torch.empty(0, 5))
    assert q.shape == (0, 5) and s.shape == (0, 1)
    assert dequantize(q, s).shape == (0, 5)


def test_source_values_are_not_modified() -> None:
    x = torch.randn(256, 128)
    before = x.clone()
    quantize(x)
    assert torch.equal(x, before)


def test_dequantize_is_within_half_an_fp8_step() -> None:
    x = torch.randn(200, 300) * 10
    q, s = quantize(x)
    scale = s.repeat_interleave(128, 0)[:200].repeat_interleave(128, 1)[:, :300]
    err = (dequantize(q, s) - x).abs()
    assert (err <= x.abs() * 2.0**-4 + scale * 2.0**-10).all()


# ---- layout, names, sizes, and writing into a bucket ----


def test_scale_shapes_follow_the_checkpoint_layout() -> None:
    assert scale_shape((7168, 18432)) == (56, 144)
    assert scale_shape((129, 1)) == (2, 1)
    assert scale_shape((300,)) == (3,)
    assert scale_shape((256, 2048, 7168)) == (256, 16, 56)
    assert scale_shape((10, 10), BlockFormat(block=(4, 3))) == (3, 4)
    assert DEFAULT_FORMAT.scale_name("model.layers.0.mlp.down_proj.weight") == (
        "model.layers.0.mlp.down_proj.weight_scale_inv"
    )


def test_wire_bytes_are_one_per_element_plus_one_scale_per_block() -> None:
    assert wire_nbytes((128, 128)) == 128 * 128 + 4
    assert wire_nbytes((129, 128)) == 129 * 128 + 2 * 4
    assert wire_nbytes((7168, 18432), BlockFormat(scale="ue8m0", scale_dtype=torch.uint8)) == 7168 * 18432 + 56 * 144
    assert wire_nbytes((7168, 18432)) / (7168 * 18432 * 2) == 0.5 + 4 / (2 * 128 * 128)


def test_quantize_into_writes_the_bytes_of_quantize_at_an_offset() -> None:
    x = torch.randn(3, 130, 70, dtype=torch.bfloat16)
    fmt = BlockFormat(block=(64, 64))
    q, s = quantize(x, fmt)
    bucket = torch.full((x.numel() + s.numel() * 4 + 24,), 0xAB, dtype=torch.uint8)
    out_q, out_s = bucket[4 : 4 + x.numel()], bucket[8 + x.numel() : 8 + x.numel() + s.numel() * 4]
    assert out_s.data_ptr() % 4 == 0
    quantize_into(x, fmt, out_q=out_q, out_scale=out_s)
    assert torch.equal(out_q, q.view(torch.uint8).flatten())
    assert torch.equal(out_s, s.flatten().view(torch.uint8))
    assert bucket[:4].eq(0xAB).all() and bucket[4 + x.numel() : 8 + x.numel()].eq(0xAB).all()


def test_quantize_into_refuses_wrong_sizes_dtypes_and_alignment() -> None:
    x = torch.randn(10, 10)
    fmt = BlockFormat(block=(4, 4))
    bucket = torch.zeros(200, dtype=torch.uint8)
    with pytest.raises(ValueError, match="out_q holds 99 bytes"):
        quantize_into(x, fmt, out_q=bucket[:99], out_scale=bucket[100:136])
    with pytest.raises(ValueError, match="out_scale must be a contiguous 1-d uint8"):
        quantize_into(x, fmt, out_q=bucket[:100], out_scale=torch.zeros(9))
    with pytest.raises(ValueError, match="multiple of 4 bytes"):
        quantize_into(x, fmt, out_q=bucket[:100], out_scale=bucket[101:137])


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"dtype": torch.bfloat16}, "dtype"),
        ({"block": (0, 128)}, "block"),
        ({"block": (128,)}, "block"),
        ({"scale": "e8m0"}, "scale"),
        ({"scale_dtype": torch.uint8}, "needs scale='ue8m0'"),
        ({"suffix": ""}, "suffix"),
    ],
)
def test_block_format_refuses_bad_settings(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        BlockFormat(**kwargs)


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(ValueError, match="0-d"):
        quantize(torch.tensor(1.0))
    with pytest.raises(ValueError, match="float64"):
        quantize(torch.ones(4, dtype=torch.float64))
    q, s = quantize(torch.ones(4, 4))
    with pytest.raises(ValueError, match=r"needs torch.float32 of shape \(1, 1\)"):
        dequantize(q, s.reshape(1), DEFAULT_FORMAT)
    with pytest.raises(ValueError, match="FP8 dtype"):
        dequantize(q.float(), s)


# ---- CPU and CUDA give the same bytes ----


def _cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")


def _check_cpu_equals_cuda(x: torch.Tensor, fmt: BlockFormat) -> None:
    q, s = quantize(x, fmt)
    qc, sc = quantize(x.cuda(), fmt)
    assert_bitwise(q, qc)
    assert_bitwise(s, sc)
    assert_bitwise(dequantize(q, s, fmt), dequantize(qc, sc, fmt))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", SOURCES)
@pytest.mark.parametrize("scale", ["float32", "ue8m0"])
@pytest.mark.parametrize("shape", [(4099, 1000), (7, 2048, 384), (100_003,), (128, 128)])
def test_cpu_and_cuda_give_the_same_bytes(dtype: torch.dtype, scale: str, shape: tuple[int, ...]) -> None:
    _cuda()
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(shape, generator=gen) * torch.randn(shape, generator=gen).exp2() * 2.0**-20).to(dtype)
    x.view(-1)[::997] = 0.0
    _check_cpu_equals_cuda(x, BlockFormat(scale=scale))


@pytest.mark.gpu
@settings(max_examples=300, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(x=tensors(max_side=40), fmt=formats())
def test_cpu_and_cuda_give_the_same_bytes_for_every_edge(x: torch.Tensor, fmt: BlockFormat) -> None:
    _cuda()
    _check_cpu_equals_cuda(x, fmt)


@pytest.mark.gpu
def test_quantize_into_a_cuda_bucket_matches_cpu() -> None:
    _cuda()
    x = torch.randn(1000, 777, dtype=torch.bfloat16)
    q, s = quantize(x)
    bucket = torch.zeros(wire_nbytes(x.shape), dtype=torch.uint8, device="cuda")
    quantize_into(x.cuda(), out_q=bucket[: x.numel()], out_scale=bucket[x.numel() :])
    assert torch.equal(bucket.cpu(), torch.cat([q.view(torch.uint8).flatten(), s.flatten().view(torch.uint8)]))


def test_a_refused_tensor_leaves_the_bucket_untouched() -> None:
    x = torch.randn(8, 8)
    x[7, 7] = float("nan")
    bucket = torch.full((64 + 16,), 0xAB, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"block \(1, 1\) holds NaN"):
        quantize_into(x, BlockFormat(block=(4, 4)), out_q=bucket[:64], out_scale=bucket[64:])
    assert bucket.eq(0xAB).all()


def test_a_block_larger_than_the_tensor_is_clipped_to_it_not_padded() -> None:
    # A peer may state any block: one of 2**24 x 2**24 must not make the rule pad to 2**48 elements.
    huge = BlockFormat(block=(1 << 24, 1 << 24))
    for t in (torch.randn(300, 260), torch.randn(2, 70, 9), torch.randn(70)):
        q, s = quantize(t, huge, name="w")
        whole = BlockFormat(block=(1 if t.dim() == 1 else t.shape[-2], t.shape[-1]))
        q_ref, s_ref = quantize_reference(t, whole)
        assert s.shape == scale_shape(t.shape, huge) == s_ref.shape
        assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref)
        assert torch.equal(dequantize(q, s, huge), dequantize(q_ref, s_ref, whole))
    bad = torch.randn(300, 260)
    bad[299, 0] = float("inf")
    with pytest.raises(ValueError, match=r"w: block \(0, 0\) holds an infinite value"):
        quantize(bad, huge, name="w")
