"""MXFP8 (refit.stages.mxfp8): the bytes of the rule against a float64 reference written from the OCP
Microscaling rule, block by block; the edges (zero, partial, saturating, tiny and huge blocks, non-finite);
and refits into an engine that states MXFP8, bitwise, with the fingerprint on."""

from __future__ import annotations

import math

import pytest
import torch
from threaded import refit_both, session

from refit import HandshakeError, ModuleSource, RefitError, Settings
from refit.stages import mxfp8
from refit.topology.stats import RefitStats

E4M3 = torch.float8_e4m3fn
SETTINGS = Settings(bucket_bytes=64 << 10, timeout_s=60.0)


def reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The OCP rule in float64, one block at a time: e = floor(log2(amax)) - 8, clamped; q = x / 2**e saturated
    to +-448, cast to e4m3 round-to-nearest-even."""
    n = x.shape[-1]
    rows = x.double().reshape(-1, n)
    q = torch.empty(rows.shape, dtype=E4M3)
    scales = []
    for r, row in enumerate(rows):
        for start in range(0, n, 32):
            block = row[start : start + 32]
            amax = float(block.abs().max())
            e = -127 if amax < 2.0**-126 else max(-127, min(127, math.frexp(amax)[1] - 1 - 8))
            q[r, start : start + 32] = (block / 2.0**e).clamp(-448.0, 448.0).to(E4M3)
            scales.append(e + 127)
    return q.reshape(x.shape), torch.tensor(scales, dtype=torch.uint8).reshape(mxfp8.scale_shape(x.shape))


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _edges() -> torch.Tensor:
    g = torch.Generator().manual_seed(11)
    x = torch.randn(6, 80, generator=g)  # 80: two whole blocks and a partial one of 16
    x[0, :32] = 0.0  # an all-zero block
    x[1, :32] *= 1e30  # a huge block
    x[2, :32] *= 1e-39  # subnormal amax: the exponent clamps to -127
    x[3, :32] = torch.full((32,), 511.0)  # amax just under a power of two: x / 2**e beyond 448 saturates
    x[4, 32:64] = torch.full((32,), 2.0**-130)  # normal-free block, tiny
    x[5, 64:] *= 3e38 / x[5, 64:].abs().max()  # near float32's max
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_rule_gives_the_bytes_of_the_float64_reference(dtype: torch.dtype) -> None:
    cases = [torch.randn(5, 7, 96, generator=torch.Generator().manual_seed(2)) * 50, torch.randn(33)]
    for x in [_edges()] * (dtype != torch.float16) + cases:  # float16 cannot hold the huge edges
        x = x.to(dtype)
        q, s = mxfp8.quantize(x)
        rq, rs = reference(x.float())
        assert _same(q, rq) and _same(s, rs), dtype


def test_the_scale_is_the_power_of_two_below_amax_over_two_to_the_eighth() -> None:
    x = torch.zeros(1, 64)
    x[0, 0], x[0, 32] = 448.0, 1.0
    q, s = mxfp8.quantize(x)
    assert s.tolist() == [[127 + 0, 127 - 8]]  # floor(log2(448)) - 8 = 0; floor(log2(1)) - 8 = -8
    assert q[0, 0].float() == 448.0 and q[0, 32].float() == 256.0
    assert torch.equal(mxfp8.dequantize(q, s), x)


def test_a_non_finite_value_or_a_0d_tensor_is_refused_naming_the_tensor() -> None:
    with pytest.raises(ValueError, match="w holds NaN"):
        mxfp8.quantize(torch.tensor([1.0, float("nan")]), name="w")
    with pytest.raises(ValueError, match="w is a 0-d"):
        mxfp8.quantize(torch.tensor(1.0), name="w")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_gives_the_cpu_bytes() -> None:
    x = _edges()
    q, s = mxfp8.quantize(x)
    cq, cs = mxfp8.quantize(x.cuda())
    assert _same(cq.cpu(), q) and _same(cs.cpu(), s)


QUANTIZED = ("q.weight",)


def _live() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(4)
    return {"q.weight": torch.randn(300, 100, generator=g), "norm.weight": torch.randn(100, generator=g)}


def _engine(live: dict[str, torch.Tensor]) -> mxfp8.MxEngine:
    held = {
        "q.weight": torch.zeros(300, 100, dtype=E4M3),
        "q.weight_scale": torch.zeros(mxfp8.scale_shape((300, 100)), dtype=torch.uint8),
        "norm.weight": torch.zeros(100),
    }
    return mxfp8.MxEngine(held, mxfp8=QUANTIZED)


def test_refits_land_the_rules_bytes_in_an_engine_that_states_mxfp8() -> None:
    live = _live()
    engine = _engine(live)
    with session(ModuleSource(live), engine, SETTINGS) as (sender, peer):
        for version in (1, 2):
            with torch.no_grad():
                live["q.weight"].mul_(1.5)
            stats, got = refit_both(sender, peer, version)
            assert isinstance(stats, RefitStats) and isinstance(got, RefitStats), (stats, got)
            q, s = mxfp8.quantize(live["q.weight"])
            assert _same(engine.tensor("q.weight"), q) and _same(engine.tensor("q.weight_scale"), s)
            assert torch.equal(engine.tensor("norm.weight"), live["norm.weight"])
        assert sender.manifest is not None and sender.manifest.stages == ("mxfp8",)
        with torch.no_grad():  # the engine's copy changed behind the refit's back: the fingerprint names it
            engine.tensor("q.weight_scale").add_(1)
        stats, got = refit_both(sender, peer, 3)
        assert isinstance(stats, RefitStats)  # refit 3 rewrites it: the fingerprint proves the new bytes
        assert _same(engine.tensor("q.weight_scale"), mxfp8.quantize(live["q.weight"])[1])


@pytest.mark.slow
def test_a_tied_tensor_stated_in_mxfp8_is_refused_at_connect() -> None:
    shared = torch.randn(300, 100)
    live = {"q.weight": shared, "lm_head.weight": shared, "norm.weight": torch.randn(100)}
    engine = _engine(live)
    with session(ModuleSource(live), engine, SETTINGS) as (sender, peer):
        stats, got = refit_both(sender, peer, 1)
        assert isinstance(stats, HandshakeError) and "tied to" in str(stats)
        assert isinstance(got, RefitError) and "tied to" in str(got)
