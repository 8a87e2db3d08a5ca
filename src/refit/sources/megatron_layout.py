"""GptLayout: a megatron-core GPTModel's parameters as Hugging Face checkpoint tensors (Llama, Qwen2, and
Qwen3-MoE: per-expert checkpoint names, as transformers saves them and vLLM loads them).

Pure layout, no megatron import: which Megatron parameter ("slot") each HF name comes from, the
global shapes on both sides, how tensor-parallel shards concatenate, and the conversions:
- `linear_qkv` holds, per query group, that group's query heads then one key and one value head;
  consecutive TP ranks hold consecutive groups, so the concatenated shards split into q, k, v;
- `linear_fc1` holds [gate; up] on each TP rank, so the concatenation is [g0; u0; g1; u1; ...];
- the layer norms are separate (local spec: `input_layernorm`, `pre_mlp_layernorm`) or folded into
  the next linear layer (Transformer Engine spec: `linear_qkv.layer_norm_weight`,
  `linear_fc1.layer_norm_weight`); both name the same slot;
- MoE (SequentialMLP, no expert parallelism): the router is `mlp.gate`, each local expert's fc1/fc2
  splits like the dense MLP's into `mlp.experts.E.{gate,up,down}_proj`;
- the vocabulary: Megatron pads it (`make_vocab_size_divisible_by` x TP) to `padded_vocab_size` rows of
  the embedding and output layer, the checkpoint holds `vocab_size`; the padded rows (the last ones) are
  gathered with the rest and cut off the global tensor, never sent.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.linear_(fc[12])\.weight$")
_LAYER_PARAMS = {
    "input_layernorm.weight": "attn_norm",
    "self_attention.linear_qkv.layer_norm_weight": "attn_norm",
    "self_attention.linear_qkv.weight": "qkv",
    "self_attention.linear_qkv.bias": "qkv_bias",
    "self_attention.linear_proj.weight": "proj",
    "pre_mlp_layernorm.weight": "mlp_norm",
    "mlp.linear_fc1.layer_norm_weight": "mlp_norm",
    "mlp.linear_fc1.weight": "fc1",
    "mlp.linear_fc2.weight": "fc2",
    "self_attention.q_layernorm.weight": "q_norm",
    "self_attention.k_layernorm.weight": "k_norm",
    "mlp.router.weight": "router",
}
_VOCAB_SLOTS = ("embed", "output")
"""The slots with one row per vocabulary entry (Megatron pads them)."""
_MODEL_PARAMS = {
    "embedding.word_embeddings.weight": "embed",
    "decoder.final_layernorm.weight": "final_norm",
    "output_layer.weight": "output",
}


@dataclass(frozen=True, slots=True)
class Slot:
    """One Megatron parameter of the whole model (all stages, all TP ranks)."""

    key: str
    """'embed', 'final_norm', 'output', or 'L.kind' for layer L (global index), e.g. '3.qkv'."""
    shape: tuple[int, ...]
    """Global shape: the TP shards concatenated on `partition_dim`."""
    partition_dim: int | None
    """The dimension TP shards split, None when every TP rank holds all of it."""
    hf_names: tuple[str, ...]
    """The checkpoint tensors it converts to."""


@dataclass(kw_only=True, slots=True)
class GptLayout:
    """The numbers that fix a GPT model's layout on both sides."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    """Key/value heads (Megatron's query groups; HF num_key_value_heads)."""
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    """The checkpoint's vocabulary: the rows of the embedding and lm_head the engine expects."""
    padded_vocab_size: int = 0
    """Megatron's rows of the embedding and output layer, `vocab_size` padded (0: not padded)."""
    qkv_bias: bool = False
    """Qwen2: q, k and v projections carry biases."""
    tied_embeddings: bool = False
    """lm_head shares the input embedding: one tensor sent under both names."""
    qk_norm: bool = False
    """Qwen3: RMSNorm over each query and key head (`q_norm`, `k_norm`)."""
    num_experts: int = 0
    """MoE experts per layer (0: a dense MLP)."""
    moe_ffn_hidden_size: int = 0
    """Each expert's intermediate size."""
    tp: int = 1
    """Tensor-parallel size (the shards' concatenation order depends on it)."""
    slots: dict[str, Slot] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.padded_vocab_size:
            self.padded_vocab_size = self.vocab_size
        if not 0 < self.vocab_size <= self.padded_vocab_size:
            raise ValueError(
                f"vocab_size ({self.vocab_size}) must be at least 1 and at most the model's padded vocabulary "
                f"({self.padded_vocab_size} rows): pass the checkpoint's vocab_size, e.g. the HF config's"
            )
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of num_query_groups "
                f"({self.num_query_groups})"
            )
        for what, n in (
            ("num_query_groups", self.num_query_groups),
            ("ffn_hidden_size", self.ffn_hidden_size),
            ("padded_vocab_size", self.padded_vocab_size),
            ("num_attention_heads", self.num_attention_heads),
        ):
            if n % self.tp:
                raise ValueError(f"{what} ({n}) must be divisible by the tensor-parallel size ({self.tp})")
        self.slots = {s.key: s for s in self._slots()}

    @classmethod
    def from_megatron(  # type: ignore[no-untyped-def]
        cls, config, *, vocab_size: int, tied_embeddings: bool, padded_vocab_size: int = 0
    ) -> GptLayout:
        """From a megatron-core TransformerConfig (duck-typed: no megatron import here); `padded_vocab_size`:
        the model's rows (GPTModel.vocab_size), `vocab_size`: the checkpoint's."""
        experts = getattr(config, "num_moe_experts", None) or 0
        if experts:
            _check_moe(config)
        if not config.gated_linear_unit:
            raise ValueError("the Llama/Qwen2 layout needs gated_linear_unit=True (SwiGLU); set it in the config")
        if config.add_bias_linear:
            raise ValueError("add_bias_linear has no Llama/Qwen2 counterpart; turn it off")
        return cls(
            num_layers=config.num_layers,
            hidden_size=config.hidden_size,
            num_attention_heads=config.num_attention_heads,
            num_query_groups=config.num_query_groups or config.num_attention_heads,
            head_dim=config.kv_channels or config.hidden_size // config.num_attention_heads,
            ffn_hidden_size=config.ffn_hidden_size,
            vocab_size=vocab_size,
            padded_vocab_size=padded_vocab_size,
            qkv_bias=bool(config.add_qkv_bias),
            tied_embeddings=tied_embeddings,
            tp=config.tensor_model_parallel_size,
            qk_norm=bool(config.qk_layernorm),
            num_experts=experts,
            moe_ffn_hidden_size=config.moe_ffn_hidden_size or 0,
        )

    def _slots(self) -> list[Slot]:
        h, d, ng = self.hidden_size, self.head_dim, self.num_query_groups
        qkv_rows = (self.num_attention_heads + 2 * ng) * d
        out = [
            Slot("embed", (self.padded_vocab_size, h), 0, ("model.embed_tokens.weight",)),
            Slot("final_norm", (h,), None, ("model.norm.weight",)),
        ]
        if not self.tied_embeddings:
            out.append(Slot("output", (self.padded_vocab_size, h), 0, ("lm_head.weight",)))
        for i in range(self.num_layers):
            p = f"model.layers.{i}."
            attn = tuple(p + f"self_attn.{x}_proj." for x in "qkv")
            layer = [
                Slot(f"{i}.attn_norm", (h,), None, (p + "input_layernorm.weight",)),
                Slot(f"{i}.qkv", (qkv_rows, h), 0, tuple(a + "weight" for a in attn)),
                Slot(f"{i}.proj", (h, self.num_attention_heads * d), 1, (p + "self_attn.o_proj.weight",)),
                Slot(f"{i}.mlp_norm", (h,), None, (p + "post_attention_layernorm.weight",)),
            ]
            if self.qkv_bias:
                layer.append(Slot(f"{i}.qkv_bias", (qkv_rows,), 0, tuple(a + "bias" for a in attn)))
            if self.qk_norm:
                layer += [Slot(f"{i}.{x}_norm", (d,), None, (p + f"self_attn.{x}_norm.weight",)) for x in "qk"]
            out.extend(layer + self._mlp_slots(i))
        return out

    def _mlp_slots(self, i: int) -> list[Slot]:
        p, h = f"model.layers.{i}.mlp.", self.hidden_size
        if not self.num_experts:
            return [
                Slot(f"{i}.fc1", (2 * self.ffn_hidden_size, h), 0, (p + "gate_proj.weight", p + "up_proj.weight")),
                Slot(f"{i}.fc2", (h, self.ffn_hidden_size), 1, (p + "down_proj.weight",)),
            ]
        f, out = self.moe_ffn_hidden_size, [Slot(f"{i}.router", (self.num_experts, h), None, (p + "gate.weight",))]
        for e in range(self.num_experts):
            x = f"{p}experts.{e}."
            out += [
                Slot(f"{i}.expert.{e}.fc1", (2 * f, h), 0, (x + "gate_proj.weight", x + "up_proj.weight")),
                Slot(f"{i}.expert.{e}.fc2", (h, f), 1, (x + "down_proj.weight",)),
            ]
        return out

    def hf_shapes(self, *, padded: bool = False) -> dict[str, tuple[int, ...]]:
        """Every checkpoint name the engine expects and its global shape, in name order; `padded`: the
        shapes as gathered from Megatron's shards, before `trim` (the vocabulary padded)."""
        shapes = {}
        for s in self.slots.values():
            for name, t in zip(s.hf_names, self._split_shapes(s)):
                shapes[name] = t if padded or s.key not in _VOCAB_SLOTS else (self.vocab_size, *t[1:])
        return dict(sorted(shapes.items()))

    def trim(self, key: str, t: torch.Tensor) -> torch.Tensor:
        """Slot `key`'s global tensor (or its checkpoint tensor) without Megatron's vocabulary padding: the
        first `vocab_size` rows of the embedding and output layer (a view); other slots as they are."""
        return t[: self.vocab_size] if key in _VOCAB_SLOTS else t

    def aliases(self) -> dict[str, str]:
        """Checkpoint names that are another name's tensor (tied lm_head -> the embedding)."""
        return {"lm_head.weight": "model.embed_tokens.weight"} if self.tied_embeddings else {}

    def _split_shapes(self, s: Slot) -> list[tuple[int, ...]]:
        kind = s.key.rsplit(".", 1)[-1]
        rest = s.shape[1:]
        if kind in ("qkv", "qkv_bias"):
            q, kv = self.num_attention_heads * self.head_dim, self.num_query_groups * self.head_dim
            return [(q, *rest), (kv, *rest), (kv, *rest)]
        if kind == "fc1":
            return [(s.shape[0] // 2, *rest)] * 2
        return [s.shape]

    def slot_of(self, megatron_name: str, layer_offset: int = 0) -> str | None:
        """The slot a stage-local Megatron parameter name fills (layer indices shifted by the stage's
        first global layer); None for names with no checkpoint counterpart."""
        m = _LAYER.match(megatron_name)
        if m is None:
            return _MODEL_PARAMS.get(megatron_name)
        layer, rest = int(m.group(1)) + layer_offset, m.group(2)
        expert = _EXPERT.match(rest)
        if expert is not None:
            return f"{layer}.expert.{expert.group(1)}.{expert.group(2)}"
        kind = _LAYER_PARAMS.get(rest)
        return f"{layer}.{kind}" if kind else None

    def to_hf(self, key: str, t: torch.Tensor, *, ranks: int | None = None) -> list[torch.Tensor]:
        """A slot's tensor as its checkpoint tensors (views where the layout allows, else copies).

        `t` is the slot's global tensor (the TP shards concatenated: `ranks` defaults to the TP size)
        or one rank's shard (`ranks=1`): a shard converts to the same rank's shard of each checkpoint
        tensor, so shards may be converted before they are gathered. A global embedding or output layer
        loses its vocabulary padding (`trim`); a shard keeps it (its rows are cut after the gather)."""
        if key in _VOCAB_SLOTS:
            return [t if ranks is not None else self.trim(key, t)]
        kind = key.rsplit(".", 1)[-1]
        rest = t.shape[1:]
        if kind in ("qkv", "qkv_bias"):
            per = self.num_attention_heads // self.num_query_groups
            groups = t.view(-1, per + 2, self.head_dim, *rest)
            return [
                groups[:, :per].reshape(-1, *rest),
                groups[:, per].reshape(-1, *rest),
                groups[:, per + 1].reshape(-1, *rest),
            ]
        if kind == "fc1":
            halves = t.view(self.tp if ranks is None else ranks, 2, -1, *rest)
            return [halves[:, 0].reshape(-1, *rest), halves[:, 1].reshape(-1, *rest)]
        return [t]


def merge(gathered: torch.Tensor, dim: int | None, shape: tuple[int, ...]) -> torch.Tensor:
    """[ranks, *shard] (an all-gather's output) -> the global tensor: the shards concatenated on `dim`."""
    if dim is None or dim == 0 or gathered.shape[0] == 1:
        return gathered.view(shape)
    return gathered.movedim(0, dim).reshape(shape)


def _check_moe(config) -> None:  # type: ignore[no-untyped-def]
    """What the MoE layout covers: SequentialMLP experts, all on every rank of their stage."""
    problems = []
    if (config.expert_model_parallel_size or 1) != 1:
        problems.append(
            f"expert_model_parallel_size ({config.expert_model_parallel_size}) must be 1 (EP is not supported yet)"
        )
    if (config.expert_tensor_parallel_size or config.tensor_model_parallel_size) != config.tensor_model_parallel_size:
        problems.append("expert_tensor_parallel_size must equal tensor_model_parallel_size")
    if config.moe_grouped_gemm:
        problems.append("moe_grouped_gemm must be off (SequentialMLP experts)")
    if config.moe_shared_expert_intermediate_size:
        problems.append("shared experts are not supported (Qwen3-MoE has none)")
    if problems:
        raise ValueError("MegatronSource cannot send this MoE model: " + "; ".join(problems))
