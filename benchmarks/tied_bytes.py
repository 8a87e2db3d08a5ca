"""Bytes on the wire for a tied Qwen2-0.5B-shaped model (built locally, random weights) against its unique bytes.

Run: python benchmarks/tied_bytes.py   (about 1 GB of RAM, half a minute on 2 cores)
"""

from __future__ import annotations

import torch
import transformers

from refit import ModuleSource
from refit.layout.planner import plan


def main() -> None:
    config = transformers.Qwen2Config(
        hidden_size=896,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        intermediate_size=4864,
        vocab_size=151936,
        tie_word_embeddings=True,
    )
    model = transformers.Qwen2ForCausalLM._from_config(config, dtype=torch.bfloat16)
    state = model.state_dict(keep_vars=True)
    manifest = plan(ModuleSource(model, wire_dtype=torch.bfloat16).specs(), capacity=512 << 20)
    unique = sum({t.data_ptr(): t.nbytes for t in state.values()}.values())
    per_name = sum(t.nbytes for t in state.values())
    aliased = [(p.name, p.spec.aliases) for p in manifest.entries if p.spec.aliases]
    print(f"names {len(state)}, manifest entries {len(manifest.entries)}, aliases {aliased}")
    print(
        f"bytes on the wire {manifest.nbytes:,}; unique bytes {unique:,}; one entry per name {per_name:,} "
        f"(+{100 * (per_name - unique) / unique:.1f} %)"
    )


if __name__ == "__main__":
    main()
