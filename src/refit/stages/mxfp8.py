"""MXFP8: the engine holds OCP Microscaling FP8 weights (e4m3 values in 1 x 32 blocks along the last dimension,
one E8M0 scale byte per block); the trainer holds float ones and sends them quantized. One module: the rule,
the stage the manifest lists, the trainer's quantized view of its source, the engine that states it, and the
handler that reads the statement (refit.stages.handler).

The rule, per block of 32 consecutive elements of the last dimension (a last partial block: its elements):
  amax  = max |x| over the block, in float32 (the source cast to float32 first);
  e     = floor(log2(amax)) - 8 (8: the exponent of e4m3's largest power of two, 448 = 1.75 * 2**8), clamped to
          -127..127; an all-zero block, or one whose amax is subnormal, gets -127;
  scale = the byte e + 127 (E8M0: 2**(byte - 127));
  q     = clamp(x / 2**e, -448, 448) cast to float8_e4m3fn, round-to-nearest-even, in float32.
A block holding NaN or +-Inf is refused with ValueError naming the tensor. The exponent is read from the
float's bits (no log2), and the division is by a float32 power of two, so CPU and CUDA give the same bytes.
"""

from __future__ import annotations

import json
from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from refit.engines.module import ModuleEngine
from refit.layout.spec import Slice, TensorSpec
from refit.sources.base import Source
from refit.stages.base import Stage
from refit.stages.handler import Handler

BLOCK = 32
"""Elements per block, along the last dimension."""
EMAX = 8
"""floor(log2) of float8_e4m3fn's largest value (448)."""
SUFFIX = "_scale"
"""Appended to a weight's name to name its E8M0 scales (uint8), as MXFP8 checkpoints do."""
FP8_MAX = 448.0
SOURCE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
KEY = "mxfp8"
"""The key of READY's statement: the names the engine holds in MXFP8."""


def scale_shape(shape: Sequence[int]) -> tuple[int, ...]:
    """The shape of the scales of a tensor of `shape`: (*shape[:-1], ceil(shape[-1] / 32))."""
    if not len(shape):
        raise ValueError("a 0-d tensor has no blocks: MXFP8 needs at least one dimension")
    return (*shape[:-1], -(-shape[-1] // BLOCK))


def quantize(x: torch.Tensor, *, name: str = "tensor") -> tuple[torch.Tensor, torch.Tensor]:
    """`x` by the MXFP8 rule: (q of x's shape in float8_e4m3fn, uint8 E8M0 scales of `scale_shape`), on x's
    device. ValueError for a dtype the rule does not take or a non-finite value, naming `name`."""
    if x.dtype not in SOURCE_DTYPES or x.dim() == 0:
        raise ValueError(f"{name} is a {x.dim()}-d {x.dtype} tensor; MXFP8 quantizes float tensors of 1+ dimensions")
    n = x.shape[-1]
    blocks = -(-n // BLOCK)
    v = x.detach().float().reshape(-1, n)
    if not bool(torch.isfinite(v).all()):
        raise ValueError(f"{name} holds NaN or an infinite value: refit refuses to quantize it to MXFP8")
    v = torch.nn.functional.pad(v, (0, blocks * BLOCK - n)).view(-1, blocks, BLOCK)  # zeros leave amax alone
    amax = v.abs().amax(dim=-1)
    biased = (amax.view(torch.int32) >> 23) & 0xFF  # the float32 exponent field: floor(log2) + 127 (normals)
    e = torch.where(biased == 0, -127, biased - 127 - EMAX).clamp(-127, 127)
    power = torch.ldexp(torch.ones_like(amax), e.float())  # 2**e in float32, exactly (2**-127 is subnormal)
    q = (v / power[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    q = q.view(-1, blocks * BLOCK)[:, :n].reshape(x.shape)
    return q, (e + 127).to(torch.uint8).reshape(scale_shape(x.shape))


def dequantize(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 weights from `q` and its E8M0 `scales`: each element `q.float() * 2**(scale - 127)`."""
    n = q.shape[-1]
    power = torch.ldexp(torch.ones(scales.shape), scales.long().float() - 127)
    return q.float() * power.repeat_interleave(BLOCK, dim=-1)[..., :n]


class Mxfp8Stage(Stage):
    """Listed in the manifest of a session that sends MXFP8; the bytes of every bucket pass through unchanged."""

    name = "mxfp8"


class MxQuantized(Source):
    """The trainer's source as the engine holds it: each stated tensor becomes its e4m3 values (its own name)
    and its E8M0 scales (`<name>_scale`), quantized by the rule from the live tensor whenever a bucket asks."""

    def __init__(self, source: Source, names: Iterable[str]) -> None:
        self.source = source
        wanted = set(names)
        specs = [s for s in source.specs() if wanted & set(s.names) and s.dtype in SOURCE_DTYPES]
        tied = next((s for s in specs if s.aliases), None)
        if tied is not None:
            raise ValueError(f"{tied.name!r} is tied to {list(tied.aliases)}: refit does not quantize tied tensors")
        for spec in specs:
            scale_shape(spec.shape)  # a 0-d tensor is refused here too
        self.names = {s.name for s in specs}
        self._scale_of = {n + SUFFIX: n for n in self.names}
        self.stable_tensors = source.stable_tensors

    @property
    def lookup_only(self) -> bool:
        return False  # quantized anew every bucket: a plan must never replay without `tensors`

    def specs(self) -> list[TensorSpec]:
        out = []
        for spec in self.source.specs():
            if spec.name not in self.names:
                out.append(spec)
                continue
            out.append(TensorSpec(spec.name, spec.shape, torch.float8_e4m3fn))
            out.append(TensorSpec(spec.name + SUFFIX, scale_shape(spec.shape), torch.uint8))
        return out

    def tensors(self, names: Sequence[str]) -> list[torch.Tensor]:
        wanted = list(dict.fromkeys(self._scale_of.get(n, n) for n in names))
        found = dict(zip(wanted, self.source.tensors(wanted)))
        with torch.no_grad():
            for n in [n for n in wanted if n in self.names]:
                found[n], found[n + SUFFIX] = quantize(found[n], name=n)
        return [found[n] for n in names]

    def signature(self) -> Hashable:
        return self.source.signature()

    def prepare_refit(self) -> None:
        self.source.prepare_refit()

    def holdings(self) -> dict[str, Slice | None]:
        raise ValueError("M:N refits do not quantize to MXFP8: give the engine workers float weights")


class MxEngine(ModuleEngine):
    """A module engine holding `mxfp8` names in MXFP8 (each with its `<name>_scale` uint8 scales beside it), and
    stating them with READY."""

    def __init__(self, module: nn.Module | Mapping[str, torch.Tensor], *, mxfp8: Iterable[str], **kw: Any) -> None:
        super().__init__(module, **kw)
        self.mxfp8 = sorted(mxfp8)

    def statement(self) -> dict:
        return {**super().statement(), KEY: self.mxfp8}


def stated(raw: bytes, who: str) -> list[str]:
    """The names one READY statement holds in MXFP8 (none for an empty one); ValueError for a malformed one."""
    try:
        obj = json.loads(raw) if raw else {}
    except (ValueError, RecursionError) as e:
        raise ValueError(f"{who}'s READY statement is not JSON: {e}") from None
    names = obj.get(KEY, []) if isinstance(obj, dict) else None
    if not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
        raise ValueError(f"{who}'s {KEY} statement must be a list of tensor names")
    return sorted(names)


class Mxfp8Handler(Handler):
    """Engines that state MXFP8 tensors get them quantized; all must state the same names."""

    name = "mxfp8"
    names: list[str] | None = None

    def adapt(self, source: Source, statements: Sequence[bytes]) -> tuple[Source, tuple[str, ...]]:
        held = [stated(raw, f"receiver {r}") for r, raw in enumerate(statements)]
        self.names = held[0] if held else []
        if any(h != self.names for h in held):
            raise ValueError("the engines hold other MXFP8 tensors than receiver 0: give every engine the same")
        if not self.names:
            return source, ()
        if getattr(self.options, "zero_copy", False):
            raise ValueError("the engine holds MXFP8 tensors, which zero-copy cannot map a float tensor onto")
        return MxQuantized(source, self.names), (Mxfp8Stage.name,)  # refuses a tied tensor here, at connect

    def vet(self, raw: bytes, rank: int) -> str:
        try:
            mine = stated(raw, f"receiver {rank}")
        except ValueError as e:
            return str(e)
        same = self.names is None or mine == self.names
        return "" if same else "it holds other MXFP8 tensors than the session's engines: give every engine the same"
