"""The FP8 quantization kernel (refit.layout.fp8_kernel) gives the bytes of the PyTorch path of the rule, bit for
bit, on CUDA; where it does not apply the PyTorch path runs; a non-finite block is refused through it too."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from refit.layout import fp8, fp8_kernel
from refit.sources.module import ModuleSource
from refit.stages.fp8 import Quantized

FORMATS = [
    fp8.BlockFormat(),
    fp8.BlockFormat(scale="ue8m0"),
    fp8.BlockFormat(scale="ue8m0", scale_dtype=torch.uint8),
    fp8.BlockFormat(dtype=torch.float8_e5m2),
    fp8.BlockFormat(block=(16, 32)),
]
SRC = os.path.join(os.path.dirname(__file__), "..", "..", "src")


def _cuda() -> None:
    if not torch.cuda.is_available() or fp8_kernel.triton is None:
        pytest.skip("needs CUDA with Triton")


def _values(shape: tuple[int, ...], dtype: torch.dtype, seed: int, device: str) -> torch.Tensor:
    """Random values whose magnitudes span 30 binades across the columns: blocks of tiny values (subnormal
    FP8 quotients), of large ones, all-zero rows and exact zeros."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    x *= torch.logspace(-25, 4, shape[-1], dtype=torch.float64)
    x = x.clamp(-60000, 60000).to(dtype)
    if x.dim() > 1:
        x[..., : min(3, x.shape[-2]), :] = 0
    return x.to(device)


def test_the_kernel_takes_only_what_it_can_launch() -> None:
    x = torch.randn(64, 64)
    q, s = torch.empty(64, 64, dtype=torch.float8_e4m3fn), torch.empty(1, 1)
    assert not fp8_kernel.applies(x, (128, 128), q, s)  # CPU, no interpreter: the PyTorch path
    if not torch.cuda.is_available() or fp8_kernel.triton is None:
        return
    x, q, s = x.cuda(), q.cuda(), s.cuda()
    assert fp8_kernel.applies(x, (128, 128), q, s)
    assert not fp8_kernel.applies(x.t(), (128, 128), q, s)  # not contiguous
    assert not fp8_kernel.applies(x, (96, 128), q, s)  # a block side that is no power of two
    assert not fp8_kernel.applies(x.to(torch.int32), (128, 128), q, s)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f"{f.dtype}-{f.scale}-{f.scale_dtype}-{f.block}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(5,), (130,), (3, 7), (128, 128), (200, 300), (2, 129, 257), (7168, 512)])
def test_the_kernel_gives_the_reference_bytes_on_cuda(
    fmt: fp8.BlockFormat, dtype: torch.dtype, shape: tuple[int, ...]
) -> None:
    _cuda()
    x = _values(shape, dtype, seed=len(shape) * 1000 + shape[-1], device="cuda")
    assert fp8_kernel.applies(x, fmt.block, torch.empty_like(x, dtype=fmt.dtype), torch.empty(1, device="cuda"))
    q, s = fp8.quantize(x, fmt)  # the kernel
    rq, rs = fp8.quantize_reference(x.cpu(), fmt)  # the PyTorch path, on the CPU
    assert torch.equal(q.cpu().view(torch.uint8), rq.view(torch.uint8))
    assert torch.equal(s.cpu(), rs)


@pytest.mark.gpu
@settings(max_examples=150, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    shape=st.lists(st.integers(1, 300), min_size=1, max_size=3).map(tuple),
    fmt=st.sampled_from(FORMATS),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    seed=st.integers(0, 1 << 30),
)
def test_the_kernel_gives_the_reference_bytes_for_random_shapes(
    shape: tuple[int, ...], fmt: fp8.BlockFormat, dtype: torch.dtype, seed: int
) -> None:
    _cuda()
    x = _values(shape, dtype, seed, device="cuda")
    q, s = fp8.quantize(x, fmt)
    rq, rs = fp8.quantize_reference(x, fmt)
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs)


@pytest.mark.gpu
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_block_is_refused_naming_the_tensor_through_the_kernel(bad: float) -> None:
    _cuda()
    tensors = {f"w{i}": torch.randn(300, 260, device="cuda", dtype=torch.bfloat16) for i in range(4)}
    tensors["w2"][200, 140] = bad
    source = Quantized(ModuleSource(tensors), {n: fp8.DEFAULT_FORMAT for n in tensors})
    with pytest.raises(ValueError, match=r"w2: block \(1, 1\) holds"):
        source.tensors(list(tensors))


@pytest.mark.gpu
def test_a_bucket_of_many_tensors_quantizes_as_each_alone() -> None:
    _cuda()
    dtypes = [torch.bfloat16, torch.float32, torch.float16]  # one launch per source dtype
    tensors = {f"w{i}": _values((64 + 37 * i, 96 + 53 * i), dtypes[i % 3], i, "cuda") for i in range(12)}
    source = Quantized(ModuleSource(tensors), {n: fp8.DEFAULT_FORMAT for n in tensors})
    names = [n for w in tensors for n in (w, w + fp8.SCALE_SUFFIX)]
    got = dict(zip(names, source.tensors(names)))
    for n, x in tensors.items():
        rq, rs = fp8.quantize_reference(x)
        assert torch.equal(got[n].view(torch.uint8), rq.view(torch.uint8)) and torch.equal(got[n + "_scale_inv"], rs)


_INTERPRETED = r"""
import torch
from refit.layout import fp8, fp8_kernel
for fmt in (fp8.BlockFormat(), fp8.BlockFormat(scale="ue8m0", scale_dtype=torch.uint8), fp8.BlockFormat(block=(16, 32))):
    items, refs = [], []
    for shape in ((130,), (3, 7), (40, 300), (2, 33, 70)):
        g = torch.Generator().manual_seed(shape[-1])
        x = (torch.randn(shape, generator=g) * torch.logspace(-20, 3, shape[-1])).to(torch.bfloat16)
        q, s = torch.empty(shape, dtype=fmt.dtype), torch.empty(fp8.scale_shape(shape, fmt), dtype=fmt.scale_dtype)
        assert fp8_kernel.applies(x, fmt.block, q, s)
        items.append((x, q, s))
        refs.append(fp8.quantize_reference(x, fmt)[1])
    group = fp8_kernel.Group(torch.device("cpu"), torch.bfloat16, fmt.dtype, fmt.scale_dtype, fmt.block, fmt.scale == "ue8m0", False)
    flags = fp8_kernel.launch(group, items, fp8_max=fmt.fp8_max, smallest=fp8.SMALLEST_SCALE)
    assert flags.tolist() == [0] * len(items), flags
    assert all(torch.equal(s, r) for (_, _, s), r in zip(items, refs)), fmt
    items[2][0].view(-1)[5] = float("nan")
    flags = fp8_kernel.launch(group, items, fp8_max=fmt.fp8_max, smallest=fp8.SMALLEST_SCALE)
    assert flags.tolist() == [0, 0, 1, 0], flags
print("ok")
"""


def test_the_kernel_under_the_triton_interpreter_gives_the_reference_scales_and_flags() -> None:
    """For machines with Triton but no GPU: one launch over tensors of several shapes gives each its reference
    scales, and flags the one holding NaN. Not the FP8 bytes: the
    interpreter's float-to-FP8 cast rounds wrongly where rounding carries into the exponent (31.8 becomes 16,
    not 32) and flushes subnormals; the CUDA tests above check the bytes on the device."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("CUDA present: the kernel is checked on the device")
    env = dict(
        os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(filter(None, [SRC, os.environ.get("PYTHONPATH")]))
    )
    r = subprocess.run([sys.executable, "-c", _INTERPRETED], env=env, capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_quantized_straight_into_a_bucket_at_its_offsets_gives_the_reference_bytes(device: str) -> None:
    # What the FP8 stage does in a pack: every tensor's q and scales are views of one bucket at their offsets,
    # quantized without a host sync; the flags are read once, after the last.
    if device == "cuda":
        _cuda()
    fmt = fp8.DEFAULT_FORMAT
    tensors = {f"w{i}": _values((40 + 61 * i, 96 + 45 * i), torch.bfloat16, i, device) for i in range(6)}
    bucket = torch.full((1 << 20,), 0xAB, dtype=torch.uint8, device=device)
    jobs, at = [], 0
    for n, x in tensors.items():
        shape = fp8.scale_shape(x.shape, fmt)
        q = bucket[at : at + x.numel()].view(fmt.dtype).view(x.shape)
        at = -(-(at + x.numel()) // 64) * 64
        s = bucket[at : at + 4 * shape[0] * shape[1]].view(torch.float32)
        jobs.append(fp8.Job(x, fmt, q, s.view(shape), n))
        at = -(-(at + s.numel() * 4) // 64) * 64
    assert fp8.non_finite(fp8.quantize_deferred(jobs)) == ""
    for job in jobs:
        rq, rs = fp8.quantize_reference(job.x)
        assert torch.equal(job.q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(job.scales, rs), job.name
    tensors["w4"][100, 200] = float("-inf")
    assert fp8.non_finite(fp8.quantize_deferred(jobs)).startswith("w4: block (0, 1) holds an infinite value")
