"""The demo's FP8 engine: every linear layer of the decoder holds its weight in block FP8 with float32 scales
beside it (`<name>_scale_inv`, DeepSeek-V3's layout), and computes with the dequantized weight. The trainer's
reference model is converted the same way and loaded with the reference quantization of its live weights."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional

from refit.layout import fp8
from refit.layout.fp8 import DEFAULT_FORMAT, BlockFormat


class Fp8Linear(nn.Module):
    """A linear layer whose weight is block FP8 (`weight`) with its inverse scales (`weight_scale_inv`)."""

    def __init__(self, linear: nn.Linear, fmt: BlockFormat = DEFAULT_FORMAT) -> None:
        super().__init__()
        q, scales = fp8.quantize(linear.weight.detach(), fmt, name="weight")
        self.weight = nn.Parameter(q, requires_grad=False)
        self.register_buffer("weight_scale_inv", scales)
        self.bias = linear.bias
        self.fmt = fmt
        self.dequantized: torch.Tensor | None = None
        """The weight dequantized once per refit, not per token: `refresh` drops it when new bytes land (a refit
        writes them through raw pointers, which no version counter sees)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.dequantized is None:
            self.dequantized = fp8.dequantize(self.weight, self.weight_scale_inv, self.fmt)
        return functional.linear(x, self.dequantized.to(x.dtype), self.bias)


def refresh(model: nn.Module) -> None:
    """After new weights landed in `model`: every Fp8Linear dequantizes its weight again at its next forward."""
    for module in model.modules():
        if isinstance(module, Fp8Linear):
            module.dequantized = None


def to_fp8(model: nn.Module) -> list[str]:
    """Turn every nn.Linear of the decoder layers into an Fp8Linear, in place; the FP8 weights' names."""
    layers = model.get_submodule("model.layers")
    names = []
    for path, module in list(layers.named_modules()):
        for child, sub in list(module.named_children()):
            if isinstance(sub, nn.Linear):
                setattr(module, child, Fp8Linear(sub))
                names.append(f"model.layers.{path + '.' if path else ''}{child}.weight")
    return names


def as_held(weights: dict[str, torch.Tensor], names: list[str]) -> dict[str, torch.Tensor]:
    """The trainer's weights as an FP8 engine holds them: each of `names` quantized by the reference rule, its
    scales beside it."""
    out = dict(weights)
    for n in names:
        q, scales = fp8.quantize(weights[n].detach(), name=n)
        out[n], out[DEFAULT_FORMAT.scale_name(n)] = q, scales
    return out
