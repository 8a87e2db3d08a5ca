"""Synthetic model shape sets (no weights, no downloads), from presets or a transformers config.json."""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from refit.spec import TensorSpec


@dataclass(frozen=True, kw_only=True, slots=True)
class Shape:
    """The few numbers that fix a decoder-only LM's tensor shapes."""

    layers: int
    hidden: int
    ffn: int
    vocab: int
    heads: int
    kv_heads: int
    head_dim: int
    qkv_bias: bool = False
    tied: bool = False
    experts: int = 0
    """Routed experts per layer (0: dense MLP)."""
    expert_ffn: int = 0

    def __post_init__(self) -> None:
        if min(self.layers, self.hidden, self.vocab, self.heads, self.kv_heads, self.head_dim) <= 0:
            raise ValueError(f"every dimension of a model shape must be > 0: {self}")
        if self.experts and self.expert_ffn <= 0:
            raise ValueError("an MoE shape needs expert_ffn > 0")


PRESETS: dict[str, Shape] = {
    "tiny": Shape(layers=2, hidden=256, ffn=768, vocab=1024, heads=4, kv_heads=2, head_dim=64),
    "qwen2-0.5b": Shape(layers=24, hidden=896, ffn=4864, vocab=151936, heads=14, kv_heads=2, head_dim=64,
                        qkv_bias=True, tied=True),  # fmt: skip
    "qwen2-7b": Shape(layers=28, hidden=3584, ffn=18944, vocab=152064, heads=28, kv_heads=4, head_dim=128,
                      qkv_bias=True),  # fmt: skip
    "moe": Shape(layers=24, hidden=2048, ffn=0, vocab=151936, heads=32, kv_heads=4, head_dim=128, experts=64,
                 expert_ffn=768),  # fmt: skip
    # Same tensor count as "moe" (4779), a thousandth of the bytes: per-tensor overhead dominates.
    "moe-small": Shape(layers=24, hidden=128, ffn=0, vocab=4096, heads=2, kv_heads=1, head_dim=64, experts=64,
                       expert_ffn=48),  # fmt: skip
}


def specs(shape: Shape, dtype: torch.dtype) -> list[TensorSpec]:
    """Every tensor of a decoder-only LM with `shape`, in `dtype`."""
    h, q, kv = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    out = [("model.embed_tokens.weight", (shape.vocab, h)), ("model.norm.weight", (h,))]
    if not shape.tied:
        out.append(("lm_head.weight", (shape.vocab, h)))
    for i in range(shape.layers):
        p = f"model.layers.{i}."
        out += [(p + "self_attn.q_proj.weight", (q, h)), (p + "self_attn.k_proj.weight", (kv, h)),
                (p + "self_attn.v_proj.weight", (kv, h)), (p + "self_attn.o_proj.weight", (h, q)),
                (p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,))]  # fmt: skip
        if shape.qkv_bias:
            out += [(p + "self_attn.q_proj.bias", (q,)), (p + "self_attn.k_proj.bias", (kv,)),
                    (p + "self_attn.v_proj.bias", (kv,))]  # fmt: skip
        if shape.experts:
            out.append((p + "mlp.gate.weight", (shape.experts, h)))
            for e in range(shape.experts):
                ep, f = f"{p}mlp.experts.{e}.", shape.expert_ffn
                out += [(ep + "gate_proj.weight", (f, h)), (ep + "up_proj.weight", (f, h)), (ep + "down_proj.weight", (h, f))]
        else:
            out += [(p + "mlp.gate_proj.weight", (shape.ffn, h)), (p + "mlp.up_proj.weight", (shape.ffn, h)),
                    (p + "mlp.down_proj.weight", (h, shape.ffn))]  # fmt: skip
    return [TensorSpec(n, s, dtype) for n, s in out]


def from_config(path: str) -> Shape:
    """The shape described by a transformers config.json (Llama/Qwen2/Mistral/Qwen-MoE style)."""
    with open(path) as f:
        c = json.load(f)
    try:
        hidden, heads = int(c["hidden_size"]), int(c["num_attention_heads"])
        experts = int(c.get("num_experts") or c.get("n_routed_experts") or c.get("num_local_experts") or 0)
        return Shape(
            layers=int(c["num_hidden_layers"]), hidden=hidden, ffn=int(c.get("intermediate_size", 0)),
            vocab=int(c["vocab_size"]), heads=heads, kv_heads=int(c.get("num_key_value_heads", heads)),
            head_dim=int(c.get("head_dim") or hidden // heads),
            qkv_bias=bool(c.get("attention_bias", c.get("model_type") == "qwen2")),
            tied=bool(c.get("tie_word_embeddings", False)), experts=experts,
            expert_ffn=int(c.get("moe_intermediate_size") or c.get("intermediate_size", 0)) if experts else 0,
        )  # fmt: skip
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{path} is not a decoder-only LM config refit understands: {e}") from None
