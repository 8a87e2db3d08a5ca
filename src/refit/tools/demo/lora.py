"""`refit demo --lora`: the trainer trains a PEFT LoRA adapter on every linear layer of the demo model and refits
the adapter alone; the engine process holds the same base (built from the same seed) and keeps adapter versions
side by side (refit.stages.lora)."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from refit.checks.fingerprints import fingerprints
from refit.stages.lora import AdapterTensors, LoraEngine, LoraSource
from refit.tools.demo.model import greedy, train_step

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""Every linear layer of a decoder layer (the lm_head stays frozen)."""
ADAPTER = "default"
BASE_SEED = 0
"""The trainer's base model seed: the engine builds the same base, so the base never moves."""


def wrap(model: torch.nn.Module, rank: int) -> torch.nn.Module:
    """`model` with a fresh LoRA adapter of `rank` (alpha 2 x rank) on every linear layer of each decoder layer."""
    import peft

    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(TARGETS), lora_dropout=0.0)
    return peft.get_peft_model(model, config)


class LoraTrainer:
    """The plain trainer's LoRA twin: AdamW over the adapter alone, which is all a refit sends."""

    def __init__(self, model: torch.nn.Module, ids: torch.Tensor, *, rank: int, lr: float) -> None:
        self.full_model_bytes = sum(p.numel() * 2 for p in model.parameters())  # the whole model in bf16
        self.model, self.ids = wrap(model, rank).eval(), ids
        self.opt = torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad], lr=lr)
        self.source = LoraSource(self.model, adapter=ADAPTER, wire_dtype=torch.bfloat16)

    def step(self) -> float:
        return train_step(self.model, self.opt, self.ids)

    def refit(self, engine, version: int):  # type: ignore[no-untyped-def]  # as PlainTrainer.refit
        return engine.refit(version)

    def full_weights(self) -> dict[str, torch.Tensor]:
        """What a refit sends: the adapter's tensors, by their wire names."""
        return dict(AdapterTensors(self.model, ADAPTER))


def targets(reference: torch.nn.Module) -> Mapping[str, torch.Tensor]:
    """Where the trainer's reference model takes the weights as sent: the adapter of a PEFT model, else all."""
    if hasattr(reference, "peft_config"):
        return AdapterTensors(reference, ADAPTER)
    return reference.state_dict(keep_vars=True)


def reference_greedy(reference: torch.nn.Module, prompts: list[list[int]]) -> list[list[int]]:
    return greedy(reference, prompts, adapter=ADAPTER if hasattr(reference, "peft_config") else None)


def engine_report(engine: LoraEngine, wire: Mapping[str, torch.dtype], prompts: list[list[int]]) -> dict:
    """The fingerprints of the adapter version new requests get, and the greedy output with it (pinned)."""
    with engine.adapter() as name:
        held = AdapterTensors(engine.model, name)
        return {
            "fingerprints": fingerprints(held.items(), wire, held=True),
            "generated": greedy(engine.model, prompts, adapter=name),
            "live": {str(v): n for v, n in engine.live.items()},
        }
