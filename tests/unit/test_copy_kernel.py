"""BatchedCopy gives exactly what `copy_` gives, for any shapes, dtypes, offsets and odd sizes.

On CPU the torch fallback runs, and (where Triton is installed) the kernel itself under Triton's
interpreter in a subprocess; on CUDA (`gpu`) the compiled kernel, casts included.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from locations import HELPERS, SRC

from refit.layout import copy_kernel
from refit.layout.copy_kernel import BatchedCopy
from refit.layout.packing import CopyPlan

SHAPES = [(1,), (3,), (7,), (8,), (33, 65), (4096,), (1000003,), (128, 8), (5, 7, 9), (262147,)]
DTYPES = [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32), (torch.uint8, torch.uint8),
          (torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32), (torch.float16, torch.bfloat16),
          (torch.float8_e4m3fn, torch.float8_e4m3fn), (torch.int64, torch.int64), (torch.float16, torch.float32),
          (torch.float32, torch.float16), (torch.bfloat16, torch.float16)]  # fmt: skip


def _random(shape: tuple[int, ...], dtype: torch.dtype, device: str, g: torch.Generator) -> torch.Tensor:
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g, device=device) * 3).to(dtype)
    return torch.randint(0, 120, shape, generator=g, device=device).to(dtype)


def _pairs(device: str, src_dtype: torch.dtype, dst_dtype: torch.dtype, *, offset: int):
    """Sources and poisoned targets, as views `offset` elements into larger storage (unaligned when odd)."""
    g = torch.Generator(device=device).manual_seed(offset + 17)
    src, dst = [], []
    for shape in SHAPES:
        n = torch.Size(shape).numel()
        src.append(_random((n + offset,), src_dtype, device, g)[offset:].view(shape))
        poison = torch.full((n + offset,), 77, dtype=torch.uint8, device=device).view(torch.uint8)
        dst.append(poison.to(dst_dtype)[offset:].view(shape))
    src.append(_random((64, 48), src_dtype, device, g).t())  # non-contiguous source
    dst.append(torch.zeros((48, 64), dtype=dst_dtype, device=device))
    return dst, src


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def _check(device: str, src_dtype: torch.dtype, dst_dtype: torch.dtype, offset: int,
           programs: int | None = None) -> BatchedCopy:  # fmt: skip
    dst, src = _pairs(device, src_dtype, dst_dtype, offset=offset)
    ref = [torch.empty_like(d).copy_(s) for d, s in zip(dst, src)]
    # Small chunks: many per tensor, and (with programs > 0) many per program.
    copy = BatchedCopy(dst, src, chunk_bytes=1 << 16, block_bytes=1 << 12, programs=programs)
    copy.run()
    g = torch.Generator(device=device).manual_seed(offset)
    for _ in range(2):  # a replay copies the sources' current values
        for s in src:
            s.copy_(_random(tuple(s.shape), s.dtype, device, g))
        ref = [torch.empty_like(d).copy_(s) for d, s in zip(dst, src)]
        copy.run()
    for d, r, s in zip(dst, ref, src):
        assert torch.equal(_bits(d), _bits(r)), (tuple(s.shape), src_dtype, dst_dtype, offset)
    return copy


@pytest.mark.parametrize("src_dtype,dst_dtype", DTYPES)
@pytest.mark.parametrize("offset", [0, 1])
def test_batched_copy_equals_copy_bitwise_on_cpu(src_dtype: torch.dtype, dst_dtype: torch.dtype, offset: int) -> None:
    _check("cpu", src_dtype, dst_dtype, offset)


def test_copy_plan_replays_current_values_and_rejects_mismatched_lists() -> None:
    src = [torch.arange(10.0), torch.arange(3.0)]
    dst = [torch.zeros(10), torch.zeros(3)]
    plan = CopyPlan(dst, src)
    plan.run()
    src[0].mul_(2)
    plan.run()
    assert dst[0].tolist() == [2.0 * i for i in range(10)] and dst[1].tolist() == [0.0, 1.0, 2.0]
    with pytest.raises(ValueError, match="as many targets"):
        BatchedCopy(dst, src[:1])


def test_sharing_device_caps_programs_for_plans_made_inside() -> None:
    with copy_kernel.sharing_device(5):
        assert copy_kernel._programs.get() == 5
    assert copy_kernel._programs.get() == copy_kernel.PROGRAMS


_INTERPRETED = r"""
import sys, torch
sys.path.insert(0, sys.argv[1])
import test_copy_kernel as t
from test_copy_kernel import _check, DTYPES
# The interpreter runs each program in Python: small tensors, still several chunks each (64 KiB chunks).
t.SHAPES[:] = [s for s in t.SHAPES if torch.Size(s).numel() < 100_000] + [(40_000,), (3, 30_001)]
same = [(s, d) for s, d in DTYPES if s == d]
for offset in (0, 1, 8):
    for s, d in same:
        c = _check("cpu", s, d, offset)
        assert offset or c.num_launches >= 1, (s, offset)
_check("cpu", torch.bfloat16, torch.bfloat16, 0, programs=3)  # few programs, each walking many chunks
from refit.layout import copy_kernel
with copy_kernel.sharing_device(2):
    c = _check("cpu", torch.int32, torch.int32, 0)
assert all(l.num_programs <= 2 for l in c._launches), [l.num_programs for l in c._launches]
print("ok")
"""


def test_kernel_equals_copy_bitwise_under_triton_interpreter() -> None:
    """For machines with Triton but no GPU. Where CUDA runs the kernel itself, the CUDA tests below check it
    (Triton 3.6's interpreter cannot run the kernel's grid-stride loop under numpy 2)."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("CUDA present: the kernel is checked on the device by test_kernel_equals_copy_bitwise_on_cuda")
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [SRC, HELPERS,
                                                      env.get("PYTHONPATH")]))  # fmt: skip
    r = subprocess.run([sys.executable, "-c", _INTERPRETED, os.path.dirname(__file__)], env=env, capture_output=True,
                       text=True, timeout=600)  # fmt: skip
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.parametrize("src_dtype,dst_dtype", DTYPES)
@pytest.mark.parametrize("offset", [0, 1, 8])
@pytest.mark.parametrize("programs", [0, 3])
def test_kernel_equals_copy_bitwise_on_cuda(src_dtype: torch.dtype, dst_dtype: torch.dtype, offset: int,
                                            programs: int) -> None:  # fmt: skip
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    c = _check("cuda", src_dtype, dst_dtype, offset, programs)
    aligned = all(offset * t.itemsize % 16 == 0 for t in (src_dtype, dst_dtype))
    if aligned and (src_dtype == dst_dtype or (src_dtype, dst_dtype) in copy_kernel._CASTS):
        assert c.num_launches >= 1 and c.num_fallback <= 1  # only the transposed source falls back
