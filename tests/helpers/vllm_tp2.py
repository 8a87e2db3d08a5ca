"""Run in its own process: vLLM with tensor_parallel_size=2 (two CPU workers, each a receiver), from
dummy weights, refitted over the transport named in argv; prints its greedy output as one JSON line."""

from __future__ import annotations

import json
import sys


def main() -> int:
    model_dir, prompts, transport = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
    from transformers import AutoModelForCausalLM
    from vllm import LLM, SamplingParams

    from refit import ModuleSource, Sender, Settings
    from refit.integrations.vllm import VllmRefit

    llm = LLM(model=model_dir, load_format="dummy", enforce_eager=True, dtype="float32", max_model_len=256,
              kv_cache_memory_bytes=64 << 20, tensor_parallel_size=2, distributed_executor_backend="mp",
              weight_transfer_config={"backend": "refit"})  # fmt: skip
    trainer = AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32")
    sender = Sender(
        ModuleSource(trainer), transport=transport, num_receivers=2, settings=Settings(bucket_bytes=1 << 20)
    )
    driver = VllmRefit(llm, sender)
    stats = driver.refit(1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=12))
    driver.close()
    print("@@tp2 " + json.dumps({"out": [list(o.outputs[0].token_ids) for o in outs], "buckets": stats.num_buckets}),
          flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
