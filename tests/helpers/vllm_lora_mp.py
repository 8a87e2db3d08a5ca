"""Run in its own process: vLLM in its default multiprocess mode (the worker in a child process) serving LoRA
versions refitted from memory by a trainer in this process. Prints one JSON line: per version, vLLM's greedy
output with the adapter and the trainer's own, the unverified count and the live versions; then the pinned ones.
"""

from __future__ import annotations

import json
import sys

from adapters import adapter_step


def main() -> int:
    model_dir, prompts = sys.argv[1], json.loads(sys.argv[2])
    import peft
    from vllm import LLM, SamplingParams

    from refit import Sender, Settings
    from refit.integrations.vllm.lora import VllmLoraOptions, VllmLoraRefit
    from refit.stages.lora import LoraSource
    from refit.tools.demo.model import build_model, greedy, model_config

    llm = LLM(model=model_dir, enforce_eager=True, dtype="float32", kv_cache_memory_bytes=64 << 20, max_model_len=256,
              enable_lora=True, max_loras=2, max_lora_rank=8,
              worker_extension_cls="refit.integrations.vllm.RefitWorkerExtension")  # fmt: skip
    config = peft.LoraConfig(r=4, lora_alpha=12, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.0)
    trainer = peft.get_peft_model(build_model(model_config(layers=2, hidden=128, ffn=256), seed=0), config).eval()
    sender = Sender(LoraSource(trainer), transport="shm", settings=Settings(timeout_s=60.0))
    driver = VllmLoraRefit(llm, sender, VllmLoraOptions.from_peft(trainer.peft_config["default"]))
    result: dict = {"versions": []}
    sp = SamplingParams(temperature=0, max_tokens=8)
    for version in (1, 2):
        adapter_step(trainer, version)
        stats = driver.refit(version)
        outs = driver.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        got = [list(o.outputs[0].token_ids) for o in outs]
        want = greedy(trainer, prompts, new_tokens=8)
        result["versions"].append({"got": got, "want": want, "unverified": stats.unverified, "live": driver.live})
    with driver.pinned():
        result["pinned"] = driver.live
    result["after"] = driver.live
    driver.close()
    print("@@lora " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
