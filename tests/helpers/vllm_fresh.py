"""Run in its own process: vLLM in its default multiprocess mode, (1) loaded from disk, then (2) from
dummy weights refitted over shm by a trainer in this process. Prints one JSON line with both outputs.
"""

from __future__ import annotations

import json
import sys

import torch


def main() -> int:
    model_dir, prompts = sys.argv[1], json.loads(sys.argv[2])
    from transformers import AutoModelForCausalLM
    from vllm import LLM, SamplingParams

    from refit import ModuleSource, Sender, Settings
    from refit.integrations.vllm import VllmRefit

    sp = SamplingParams(temperature=0, max_tokens=12)
    common = {"enforce_eager": True, "dtype": "float32", "kv_cache_memory_bytes": 64 << 20, "max_model_len": 256}
    llm = LLM(model=model_dir, **common)
    fresh = [list(o.outputs[0].token_ids) for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sp)]
    llm.llm_engine.engine_core.shutdown()
    del llm
    llm = LLM(model=model_dir, load_format="dummy", weight_transfer_config={"backend": "refit"}, **common)
    trainer = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    driver = VllmRefit(llm, Sender(ModuleSource(trainer), transport="shm", settings=Settings(bucket_bytes=1 << 20)))
    stats = driver.refit(1)
    refitted = [list(o.outputs[0].token_ids) for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sp)]
    driver.close()
    print("@@fresh " + json.dumps({"fresh": fresh, "refitted": refitted, "buckets": stats.num_buckets}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
