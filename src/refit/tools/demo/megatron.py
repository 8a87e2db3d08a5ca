"""The demo's trainer as a megatron-core GPTModel with TP and PP over gloo on CPU (`refit demo --trainer megatron`).

The model mirrors the demo's Llama config (local layer spec, no Transformer Engine, CPU initialisation).
megatron-core 0.16 assumes CUDA in three places a CPU run reaches; `cpu_shims` covers them (the RoPE
frequencies' device, the dropout RNG tracker, the default causal mask) without changing the maths:
dropout is off and the causal mask is passed explicitly. The training loop is real megatron-core
forward and backward; with PP it is a one-microbatch schedule of our own (megatron's schedules
allocate CUDA tensors), activations and gradients passed between stages with send/recv.
"""

from __future__ import annotations

import contextlib
import warnings

import torch
import torch.distributed as dist

from refit.integrations.megatron import megatron_refit
from refit.sources.megatron import MegatronSource, unwrap
from refit.topology.stats import RefitStats

# megatron-core warns about what a CPU demo lacks on purpose (Apex, Transformer Engine, CUDA settings)
warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")


def cpu_shims() -> None:
    """Let megatron-core 0.16 run forward and backward on a CPU-only torch (see the module docstring)."""
    from megatron.core import tensor_parallel

    if not torch.cuda.is_available():
        torch.cuda.current_device = lambda: torch.device("cpu")  # RoPE moves its frequencies "to the GPU"
        tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):  # 0.16 reads it unguarded when Transformer Engine is absent
        moe_utils.te_general_gemm = None


def _transformer_config(c, *, tp: int, pp: int):  # type: ignore[no-untyped-def]
    """Megatron's TransformerConfig for the architecture of transformers config `c`, on CPU in fp32."""
    from megatron.core.transformer import TransformerConfig

    experts = getattr(c, "num_experts", None) or 0
    moe = (
        {
            "num_moe_experts": experts,
            "moe_router_topk": c.num_experts_per_tok,
            "moe_ffn_hidden_size": c.moe_intermediate_size,
            "moe_token_dispatcher_type": "allgather",
            "moe_router_load_balancing_type": "none",
        }
        if experts
        else {}
    )
    return TransformerConfig(
        num_layers=c.num_hidden_layers,
        hidden_size=c.hidden_size,
        num_attention_heads=c.num_attention_heads,
        num_query_groups=c.num_key_value_heads,
        kv_channels=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
        ffn_hidden_size=c.intermediate_size,
        normalization="RMSNorm",
        layernorm_epsilon=c.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=c.model_type == "qwen2" or bool(getattr(c, "attention_bias", False)),
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        qk_layernorm=c.model_type.startswith("qwen3"),
        **moe,
    )


def build_gpt(hf_config, *, tp: int, pp: int, seed: int = 0) -> torch.nn.Module:  # type: ignore[no-untyped-def]
    """A GPTModel with `hf_config`'s architecture, TP x PP over the default (gloo) group."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    cpu_shims()
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        model_parallel_cuda_manual_seed(seed)
    c = hf_config
    experts = getattr(c, "num_experts", None) or 0
    config = _transformer_config(c, tp=tp, pp=pp)
    spec = get_gpt_layer_local_spec(
        num_experts=experts or None, qk_layernorm=config.qk_layernorm, normalization="RMSNorm"
    )
    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=c.vocab_size,
        max_sequence_length=c.max_position_embeddings,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=bool(c.tie_word_embeddings),
        position_embedding_type="rope",
        rotary_base=int(getattr(c, "rope_theta", None) or c.rope_parameters["rope_theta"]),
    )


def forward(model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor | None:
    """One stage's forward on [1, s] ids: per-token loss (last stage, with labels), logits, or activations.
    Later stages receive their input from the previous stage first."""
    from megatron.core import parallel_state as ps

    s = ids.shape[1]
    mask = torch.triu(torch.ones(1, 1, s, s), diagonal=1).bool()
    if not ps.is_pipeline_first_stage():
        x = torch.empty(s, 1, model.config.hidden_size)
        dist.recv(x, ps.get_pipeline_model_parallel_prev_rank())
        unwrap(model).set_input_tensor(x.requires_grad_())
    pos = torch.arange(s).unsqueeze(0)
    return model(ids, pos, attention_mask=mask, labels=labels)


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, ids: torch.Tensor) -> float:
    """A next-token step through every stage (one microbatch); the loss, on every rank."""
    from megatron.core import parallel_state as ps

    inputs, labels = ids[:, :-1], ids[:, 1:]
    model.train()
    out = forward(model, inputs, labels if ps.is_pipeline_last_stage() else None)
    x = unwrap(model).decoder.input_tensor
    if ps.is_pipeline_last_stage():
        loss = out.float().mean()
        loss.backward()
    else:
        dist.send(out.detach(), ps.get_pipeline_model_parallel_next_rank())
        grad = torch.empty_like(out)
        dist.recv(grad, ps.get_pipeline_model_parallel_next_rank())
        out.backward(grad)
        loss = torch.zeros(())
    if x is not None and not ps.is_pipeline_first_stage():
        dist.send(x.grad, ps.get_pipeline_model_parallel_prev_rank())
    loss = loss.detach()
    dist.all_reduce(loss, group=ps.get_pipeline_model_parallel_group())  # only the last stage's is non-zero
    opt.step()
    opt.zero_grad(set_to_none=True)
    model.eval()
    return float(loss)


def full_weights(source: MegatronSource) -> dict[str, torch.Tensor]:
    """Every rank must call this: the trainer's live weights under checkpoint names, on the leader ({}
    elsewhere). A plain path (list all-gather, broadcast from the owning stage), apart from the source's."""
    from megatron.core import parallel_state as ps

    source.sync()
    layout, out = source.layout, {}
    pp_group, tp = ps.get_pipeline_model_parallel_group(), ps.get_tensor_model_parallel_world_size()
    with torch.no_grad():
        for key, slot in layout.slots.items():
            owner = source.owner(key)
            if owner == source.stage:
                local = source.local(key).detach().contiguous()
                if slot.partition_dim is not None and tp > 1:
                    parts = [torch.empty_like(local) for _ in range(tp)]
                    dist.all_gather(parts, local, group=ps.get_tensor_model_parallel_group())
                    local = torch.cat(parts, dim=slot.partition_dim)
                full = local.clone()
            else:
                full = torch.empty(slot.shape, dtype=source.held_dtype(key))
            dist.broadcast(full, src=source.stage_ranks[owner], group=pp_group)
            if source.rank == 0:
                out.update(zip(slot.hf_names, (t.clone() for t in layout.to_hf(key, full))))
    out.update({alias: out[name] for alias, name in layout.aliases().items() if out})
    return out


class MegatronTrainer:
    """The demo's trainer: a GPTModel over TP x PP ranks, AdamW, refitted through MegatronSource."""

    def __init__(self, hf_model: torch.nn.Module, ids: torch.Tensor, *, tp: int, pp: int) -> None:
        self.model = build_gpt(hf_model.config, tp=tp, pp=pp)
        self.hf_model, self.ids = hf_model, ids
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=3e-3)
        self.source = MegatronSource(self.model, wire_dtype=torch.bfloat16)
        self.num_params = sum(p.numel() for p in hf_model.parameters())

    def step(self) -> float:
        return train_step(self.model, self.opt, self.ids)

    def refit(self, engine, version: int) -> RefitStats | None:  # type: ignore[no-untyped-def]
        return megatron_refit(self.source, engine, version)

    def full_weights(self) -> dict[str, torch.Tensor]:
        return full_weights(self.source)
