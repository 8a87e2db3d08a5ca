"""Stand-ins for training a PEFT LoRA adapter, shared by the LoRA tests."""

from __future__ import annotations

import torch


def adapter_step(model: torch.nn.Module, version: int) -> None:
    """A deterministic stand-in for an optimizer step on the adapter alone (PEFT starts lora_B at zero, where the
    adapter does nothing): every lora_ tensor moves by noise drawn from `version`."""
    g = torch.Generator().manual_seed(version)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.add_(torch.randn(p.shape, generator=g) * 0.3)
