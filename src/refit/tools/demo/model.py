"""A small Llama-style causal LM and a byte-level BPE tokenizer, both built locally (no hub)."""

from __future__ import annotations

import os

import torch

TEXT = (
    "Reinforcement learning from feedback alternates two phases. The trainer updates the policy, "
    "and the inference engine generates the next rollouts with the new weights. Moving the weights "
    "from the trainer to the engine is called a refit, and it happens after every step. A refit must "
    "be fast, because the GPUs wait for it, and it must be exact, because a silently wrong weight "
    "poisons every rollout that follows. The names, shapes, dtypes and the bucket layout are prepared "
    "once; each refit moves only the bytes of the weights and a small header per bucket. "
)
PROMPTS = ["The trainer updates", "Moving the weights", "A refit must be"]
VOCAB_SIZE = 1024


def build_tokenizer():
    """A byte-level BPE tokenizer trained on TEXT, as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - 2,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([TEXT] * 4, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="</s>")  # noqa: S106


def model_config(*, layers: int = 8, hidden: int = 512, ffn: int = 1536, dtype: str = "float32", arch: str = "llama"):
    """A Llama config of about 25M parameters at the defaults; `arch="qwen2"`: the same sizes as Qwen2
    (biased q/k/v projections, lm_head tied to the embedding); "qwen3_moe": Qwen3-MoE (q/k norms, 4
    experts of ffn/4, top 2)."""
    from transformers import LlamaConfig, Qwen2Config

    if arch == "qwen2":
        return Qwen2Config(
            vocab_size=VOCAB_SIZE,
            hidden_size=hidden,
            intermediate_size=ffn,
            num_hidden_layers=layers,
            num_attention_heads=hidden // 64,
            num_key_value_heads=max(1, hidden // 256),
            max_position_embeddings=512,
            tie_word_embeddings=True,
            bos_token_id=0,
            eos_token_id=1,
            pad_token_id=1,
            torch_dtype=dtype,
        )
    if arch == "qwen3_moe":
        from transformers import Qwen3MoeConfig

        return Qwen3MoeConfig(
            vocab_size=VOCAB_SIZE,
            hidden_size=hidden,
            intermediate_size=ffn,
            moe_intermediate_size=ffn // 4,
            num_experts=4,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            num_hidden_layers=layers,
            num_attention_heads=hidden // 64,
            num_key_value_heads=max(1, hidden // 256),
            head_dim=64,
            max_position_embeddings=512,
            tie_word_embeddings=False,
            bos_token_id=0,
            eos_token_id=1,
            pad_token_id=1,
            torch_dtype=dtype,
        )
    if arch != "llama":
        raise ValueError(f"arch must be 'llama', 'qwen2' or 'qwen3_moe', got {arch!r}")
    return LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=hidden,
        intermediate_size=ffn,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=max(1, hidden // 256),
        head_dim=64,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
        torch_dtype=dtype,
    )


def param_count(*, layers: int, hidden: int, ffn: int) -> int:
    """Parameters of the llama `model_config(layers, hidden, ffn)`, without building it (no transformers)."""
    kv = max(1, hidden // 256) * 64  # k and v: KV heads of head_dim 64
    per_layer = 2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * ffn + 2 * hidden
    return layers * per_layer + 2 * VOCAB_SIZE * hidden + hidden  # untied embedding and lm_head, final norm


def build_model(config, *, seed: int, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The causal LM for `config`, with random weights drawn from `seed`."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    return model.to(dtype).eval()


def save(model: torch.nn.Module, tokenizer, path: str) -> str:
    """Write model and tokenizer as a local checkpoint directory (for engines that load from disk)."""
    from transformers.utils import logging as hf_logging

    os.makedirs(path, exist_ok=True)
    hf_logging.disable_progress_bar()  # its "Writing model shards" bar, for a file of a few MB
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, ids: torch.Tensor) -> float:
    """One optimizer step of the causal LM on `ids`; the model is left in eval mode."""
    model.train()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    model.eval()
    return float(loss.detach())


@torch.no_grad()
def greedy(
    model: torch.nn.Module, prompts: list[list[int]], *, new_tokens: int = 12, adapter: str | None = None
) -> list[list[int]]:
    """Greedy continuation of each prompt, on one thread so both processes compute identically. `adapter`: the
    PEFT adapter to generate with (`adapter_names`), for a PEFT model."""
    named = {"adapter_names": [adapter]} if adapter else {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = []
        for ids in prompts:
            x = torch.tensor([ids])
            y = model.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=1,
                eos_token_id=None,
                **named,
            )
            out.append(y[0, len(ids) :].tolist())
        return out
    finally:
        torch.set_num_threads(threads)
