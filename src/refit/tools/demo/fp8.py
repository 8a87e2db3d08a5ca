"""The demo's quantized engines, one entry of `ENGINE_DTYPES` each: every linear layer of the decoder holds its
weight quantized with its scales beside it, and computes with the weight dequantized once per refit. `fp8`:
block FP8 with float32 `<name>_scale_inv` (DeepSeek-V3's layout); `mxfp8`: OCP MXFP8 with E8M0 `<name>_scale`.
The trainer's reference model is converted the same way and loaded with the reference rule of its live weights."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional

from refit.engines.module import ModuleEngine
from refit.layout import fp8
from refit.layout.fp8 import DEFAULT_FORMAT
from refit.stages import mxfp8


@dataclass(frozen=True, slots=True)
class EngineDtype:
    """How an engine holds its decoder's linears: the rule, its scales' suffix, the engine that states them
    (given the module, the quantized names and ModuleEngine's options) and what the demo prints of it."""

    quantize: Callable[[torch.Tensor, str], tuple[torch.Tensor, torch.Tensor]]
    dequantize: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    suffix: str
    engine: Callable[..., ModuleEngine]
    sent_as: str
    legend: str


ENGINE_DTYPES = {
    "fp8": EngineDtype(
        lambda w, n: fp8.quantize(w, name=n),
        lambda q, s: fp8.dequantize(q, s, DEFAULT_FORMAT),
        DEFAULT_FORMAT.suffix,
        lambda module, names, **kw: ModuleEngine(module, **kw),
        "block FP8 (e4m3, 128 x 128, fp32 scales)",
        "--engine-dtype fp8: MB counts the decoder's linears in FP8 with their scales; params compares the engine's "
        "FP8 bytes and scales with the trainer's own quantization of its live weights.",
    ),
    "mxfp8": EngineDtype(
        lambda w, n: mxfp8.quantize(w, name=n),
        mxfp8.dequantize,
        mxfp8.SUFFIX,
        lambda module, names, **kw: mxfp8.MxEngine(module, mxfp8=names, **kw),
        "MXFP8 (e4m3, 1 x 32, E8M0 scales)",
        "--engine-dtype mxfp8: MB counts the decoder's linears in MXFP8 with their E8M0 scales; params compares "
        "the engine's MXFP8 bytes and scales with the trainer's own quantization of its live weights.",
    ),
}
"""The demo's quantized engine dtypes by name ('float', the default, holds what the wire carries)."""


class QuantizedLinear(nn.Module):
    """A linear layer whose weight is quantized (`weight`) with its scales (`weight<suffix>`)."""

    def __init__(self, linear: nn.Linear, dtype: EngineDtype) -> None:
        super().__init__()
        q, scales = dtype.quantize(linear.weight.detach(), "weight")
        self.weight = nn.Parameter(q, requires_grad=False)
        self.register_buffer("weight" + dtype.suffix, scales)
        self.bias = linear.bias
        self.dtype = dtype
        self.dequantized: torch.Tensor | None = None
        """The weight dequantized once per refit, not per token: `refresh` drops it when new bytes land (a refit
        writes them through raw pointers, which no version counter sees)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.dequantized is None:
            self.dequantized = self.dtype.dequantize(self.weight, getattr(self, "weight" + self.dtype.suffix))
        return functional.linear(x, self.dequantized.to(x.dtype), self.bias)


def refresh(model: nn.Module) -> None:
    """After new weights landed in `model`: every QuantizedLinear dequantizes its weight again at its next forward."""
    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            module.dequantized = None


def quantize_linears(model: nn.Module, engine_dtype: str) -> list[str]:
    """Turn every nn.Linear of the decoder layers into a QuantizedLinear of `engine_dtype`, in place; the quantized
    weights' names (none for 'float')."""
    if engine_dtype not in ENGINE_DTYPES:
        return []
    layers = model.get_submodule("model.layers")
    names = []
    for path, module in list(layers.named_modules()):
        for child, sub in list(module.named_children()):
            if isinstance(sub, nn.Linear):
                setattr(module, child, QuantizedLinear(sub, ENGINE_DTYPES[engine_dtype]))
                names.append(f"model.layers.{path + '.' if path else ''}{child}.weight")
    return names


def as_held(weights: dict[str, torch.Tensor], names: list[str], engine_dtype: str) -> dict[str, torch.Tensor]:
    """The trainer's weights as the engine holds them: each of `names` quantized by `engine_dtype`'s reference
    rule, its scales beside it."""
    out = dict(weights)
    for n in names:
        dtype = ENGINE_DTYPES[engine_dtype]
        out[n], out[n + dtype.suffix] = dtype.quantize(weights[n].detach(), n)
    return out
