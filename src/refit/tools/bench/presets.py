"""Synthetic model shape sets (no weights, no downloads), from presets or a transformers config.json."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

import torch

from refit.layout.spec import TensorSpec


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
    dense_layers: int = 0
    """With experts: how many leading layers keep a dense MLP of width `ffn` (DeepSeek's first_k_dense_replace)."""
    shared_experts: int = 0
    """With experts: always-on experts per layer, fused into one MLP of width shared_experts * expert_ffn."""
    router_bias: bool = False
    """With experts: the router's fp32 `e_score_correction_bias`."""
    q_lora_rank: int = 0
    """MLA (multi-head latent attention) when kv_lora_rank > 0: the query's low-rank width (0: no q LoRA)."""
    kv_lora_rank: int = 0
    rope_head_dim: int = 0
    """MLA: the rotary part of each query/key head; `head_dim` is the non-rotary part."""
    v_head_dim: int = 0
    fp8_block: int = 0
    """> 0: linear weights are FP8 e4m3 with fp32 block scales (`<name>_scale_inv`) of this block size."""

    def __post_init__(self) -> None:
        if min(self.layers, self.hidden, self.vocab, self.heads, self.kv_heads, self.head_dim) <= 0:
            raise ValueError(f"every dimension of a model shape must be > 0: {self}")
        if self.experts and self.expert_ffn <= 0:
            raise ValueError("an MoE shape needs expert_ffn > 0")
        if self.kv_lora_rank and (self.rope_head_dim <= 0 or self.v_head_dim <= 0):
            raise ValueError("an MLA shape (kv_lora_rank > 0) needs rope_head_dim and v_head_dim > 0")

    def truncated(self, layers: int) -> Shape:
        """The same model with only its first `layers` layers (dense ones first, as in the full model)."""
        if not 1 <= layers <= self.layers:
            raise ValueError(f"layers ({layers}) must be between 1 and the model's {self.layers}")
        return dataclasses.replace(self, layers=layers)


PRESETS: dict[str, Shape] = {
    "tiny": Shape(layers=2, hidden=256, ffn=768, vocab=1024, heads=4, kv_heads=2, head_dim=64),
    "qwen2-0.5b": Shape(
        layers=24, hidden=896, ffn=4864, vocab=151936, heads=14, kv_heads=2, head_dim=64, qkv_bias=True, tied=True
    ),
    "qwen2-7b": Shape(
        layers=28, hidden=3584, ffn=18944, vocab=152064, heads=28, kv_heads=4, head_dim=128, qkv_bias=True
    ),
    "moe": Shape(
        layers=24, hidden=2048, ffn=0, vocab=151936, heads=32, kv_heads=4, head_dim=128, experts=64, expert_ffn=768
    ),
    # Same tensor count as "moe" (4779), a thousandth of the bytes: per-tensor overhead dominates.
    "moe-small": Shape(
        layers=24, hidden=128, ffn=0, vocab=4096, heads=2, kv_heads=1, head_dim=64, experts=64, expert_ffn=48
    ),
    # DeepSeek-V3 (its config.json): MLA, 3 dense then 58 MoE layers of 256 routed + 1 shared expert, FP8
    # weights with 128x128 block scales. The multi-token-prediction layer (model.layers.61) is left out.
    "deepseek-v3": Shape(
        layers=61,
        hidden=7168,
        ffn=18432,
        vocab=129280,
        heads=128,
        kv_heads=128,
        head_dim=128,
        experts=256,
        expert_ffn=2048,
        dense_layers=3,
        shared_experts=1,
        router_bias=True,
        q_lora_rank=1536,
        kv_lora_rank=512,
        rope_head_dim=64,
        v_head_dim=128,
        fp8_block=128,
    ),
}


def specs(shape: Shape, dtype: torch.dtype) -> list[TensorSpec]:
    """Every tensor of a decoder-only LM with `shape`, in `dtype` (FP8 weights and fp32 scales where the shape says)."""
    out = [
        TensorSpec("model.embed_tokens.weight", (shape.vocab, shape.hidden), dtype),
        TensorSpec("model.norm.weight", (shape.hidden,), dtype),
    ]
    if not shape.tied:
        out.append(TensorSpec("lm_head.weight", (shape.vocab, shape.hidden), dtype))
    for i in range(shape.layers):
        p = f"model.layers.{i}."
        out += [
            TensorSpec(p + "input_layernorm.weight", (shape.hidden,), dtype),
            TensorSpec(p + "post_attention_layernorm.weight", (shape.hidden,), dtype),
        ]
        attention = _mla if shape.kv_lora_rank else _attention
        out += attention(p + "self_attn.", shape, dtype)
        out += _mlp(p + "mlp.", shape, dtype, moe=shape.experts > 0 and i >= shape.dense_layers)
    return out


def _linear(name: str, out_dim: int, in_dim: int, shape: Shape, dtype: torch.dtype) -> list[TensorSpec]:
    """A linear layer's weight, plus its block scales when the shape is FP8."""
    if not shape.fp8_block:
        return [TensorSpec(name + ".weight", (out_dim, in_dim), dtype)]
    b = shape.fp8_block
    return [
        TensorSpec(name + ".weight", (out_dim, in_dim), torch.float8_e4m3fn),
        TensorSpec(name + ".weight_scale_inv", (-(-out_dim // b), -(-in_dim // b)), torch.float32),
    ]


def _attention(p: str, shape: Shape, dtype: torch.dtype) -> list[TensorSpec]:
    h, q, kv = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    out = [
        *_linear(p + "q_proj", q, h, shape, dtype),
        *_linear(p + "k_proj", kv, h, shape, dtype),
        *_linear(p + "v_proj", kv, h, shape, dtype),
        *_linear(p + "o_proj", h, q, shape, dtype),
    ]
    if shape.qkv_bias:
        out += [
            TensorSpec(p + "q_proj.bias", (q,), dtype),
            TensorSpec(p + "k_proj.bias", (kv,), dtype),
            TensorSpec(p + "v_proj.bias", (kv,), dtype),
        ]
    return out


def _mla(p: str, shape: Shape, dtype: torch.dtype) -> list[TensorSpec]:
    """Multi-head latent attention (DeepSeek-V2/V3): low-rank query and key/value projections."""
    h, n, rope = shape.hidden, shape.heads, shape.rope_head_dim
    out = [
        *_linear(p + "kv_a_proj_with_mqa", shape.kv_lora_rank + rope, h, shape, dtype),
        TensorSpec(p + "kv_a_layernorm.weight", (shape.kv_lora_rank,), dtype),
        *_linear(p + "kv_b_proj", n * (shape.head_dim + shape.v_head_dim), shape.kv_lora_rank, shape, dtype),
        *_linear(p + "o_proj", h, n * shape.v_head_dim, shape, dtype),
    ]
    q_out = n * (shape.head_dim + rope)
    if shape.q_lora_rank:
        out += [
            *_linear(p + "q_a_proj", shape.q_lora_rank, h, shape, dtype),
            TensorSpec(p + "q_a_layernorm.weight", (shape.q_lora_rank,), dtype),
            *_linear(p + "q_b_proj", q_out, shape.q_lora_rank, shape, dtype),
        ]
    else:
        out += _linear(p + "q_proj", q_out, h, shape, dtype)
    return out


def _mlp(p: str, shape: Shape, dtype: torch.dtype, *, moe: bool) -> list[TensorSpec]:
    h = shape.hidden

    def ffn(prefix: str, width: int) -> list[TensorSpec]:
        return [
            *_linear(prefix + "gate_proj", width, h, shape, dtype),
            *_linear(prefix + "up_proj", width, h, shape, dtype),
            *_linear(prefix + "down_proj", h, width, shape, dtype),
        ]

    if not moe:
        return ffn(p, shape.ffn)
    out = [TensorSpec(p + "gate.weight", (shape.experts, h), dtype)]
    if shape.router_bias:
        out.append(TensorSpec(p + "gate.e_score_correction_bias", (shape.experts,), torch.float32))
    for e in range(shape.experts):
        out += ffn(f"{p}experts.{e}.", shape.expert_ffn)
    if shape.shared_experts:
        out += ffn(p + "shared_experts.", shape.shared_experts * shape.expert_ffn)
    return out


class _Fields:
    """A config.json's fields, each read as the type it must have; a missing or wrong one is a ValueError
    naming it (not a KeyError of its name alone)."""

    def __init__(self, path: str) -> None:
        with open(path) as f:
            self.c = json.load(f)
        self.path = path
        if not isinstance(self.c, dict):
            raise ValueError(f"{path} holds a JSON {type(self.c).__name__}, not a transformers config (an object)")

    def size(self, name: str, default: int | None = None, *, least: int = 0) -> int:
        """Field `name` (a missing or null one: `default`, or an error when there is none) as an int >= `least`."""
        value = self.c.get(name)
        if value is None:
            if default is None:
                raise ValueError(f"{self.path} lacks {name}; a decoder-only LM config names it")
            return default
        if isinstance(value, bool) or not isinstance(value, int | float) or value != int(value) or value < least:
            raise ValueError(f"{self.path}: {name} must be an integer >= {least}, got {value!r}")
        return int(value)

    def first(self, *names: str) -> int:
        """The first of `names` that is set (0: none)."""
        return next((self.size(n) for n in names if self.c.get(n)), 0)


def from_config(path: str) -> Shape:
    """The shape described by a transformers config.json (Llama/Qwen2/Mistral/Qwen-MoE/DeepSeek-V3 style)."""
    f = _Fields(path)
    c = f.c
    hidden, heads = f.size("hidden_size", least=1), f.size("num_attention_heads", least=1)
    experts = f.first("num_experts", "n_routed_experts", "num_local_experts")
    common = dict(
        layers=f.size("num_hidden_layers", least=1),
        hidden=hidden,
        ffn=f.size("intermediate_size", 0),
        vocab=f.size("vocab_size", least=1),
        heads=heads,
        experts=experts,
        tied=bool(c.get("tie_word_embeddings", False)),
    )
    if not c.get("kv_lora_rank"):
        return Shape(
            **common,
            kv_heads=f.size("num_key_value_heads", heads, least=1),
            head_dim=f.size("head_dim", 0) or hidden // heads,
            qkv_bias=bool(c.get("attention_bias", c.get("model_type") == "qwen2")),
            expert_ffn=(f.size("moe_intermediate_size", 0) or f.size("intermediate_size", 0)) if experts else 0,
        )
    block = (c.get("quantization_config") or {}).get("weight_block_size") or [0]
    if not isinstance(block, list) or not block or not isinstance(block[0], int):
        raise ValueError(f"{path}: quantization_config.weight_block_size must be a list of integers, got {block!r}")
    return Shape(
        **common,
        kv_heads=heads,
        expert_ffn=f.size("moe_intermediate_size", 0),
        q_lora_rank=f.size("q_lora_rank", 0),
        kv_lora_rank=f.size("kv_lora_rank", least=1),
        rope_head_dim=f.size("qk_rope_head_dim"),
        v_head_dim=f.size("v_head_dim", least=1),
        head_dim=f.size("qk_nope_head_dim"),
        dense_layers=f.size("first_k_dense_replace", 0),
        shared_experts=f.size("n_shared_experts", 0),
        router_bias=c.get("topk_method") == "noaux_tc",
        fp8_block=block[0],
    )
