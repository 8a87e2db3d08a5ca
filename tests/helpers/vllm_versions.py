"""Run in its own process: an offline vLLM (default multiprocess mode, dummy weights, backend 'refit') refitted
as versions 1 and 2 by VllmRefit, a refused manifest in between; after each step the version as vLLM's own API
reads it (`LLM.get_weight_version`, each request's `weight_versions` spans), the worker's WeightsVersion, and
whether the worker's tensors equal the trainer's live ones. Prints one JSON line."""

from __future__ import annotations

import json
import sys

import torch


def main() -> int:
    model_dir, prompt = sys.argv[1], json.loads(sys.argv[2])
    from transformers import AutoModelForCausalLM
    from vllm import LLM, SamplingParams

    from refit import HandshakeError, ModuleSource, Sender, Settings
    from refit.integrations.vllm import VllmRefit, expected_fingerprints

    llm = LLM(model=model_dir, load_format="dummy", enforce_eager=True, dtype="float32", kv_cache_memory_bytes=64 << 20,
              max_model_len=256, weight_transfer_config={"backend": "refit"},
              worker_extension_cls="refit.integrations.vllm.RefitWorkerExtension")  # fmt: skip
    trainer = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    driver = VllmRefit(llm, Sender(ModuleSource(trainer), transport="shm", settings=Settings(bucket_bytes=1 << 20)))

    def seen() -> dict:
        out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
        live = {n: p.detach() for n, p in trainer.named_parameters()}
        layout = llm.collective_rpc("refit_layout")[0]
        return {
            "llm": llm.get_weight_version(),
            "spans": [[s.version, s.start, s.end] for s in out[0].outputs[0].weight_versions or []],
            "worker": llm.collective_rpc("refit_weights_version")[0],
            "bitwise": llm.collective_rpc("refit_fingerprints")[0] == expected_fingerprints(live, layout),
        }

    result = {"start": llm.get_weight_version()}
    driver.refit(1)
    result["1"] = seen()
    with torch.no_grad():
        for p in trainer.parameters():
            p.mul_(0.5)
    driver.refit(2)
    result["2"] = seen()
    broken = {**dict(trainer.state_dict()), "model.norm.weight": torch.zeros(3)}
    driver.sender.source = ModuleSource(broken)
    try:
        driver.refit(3)
        result["refused"] = "not refused"
    except HandshakeError as e:
        result["refused"] = str(e)
    driver.sender.source = ModuleSource(trainer)
    result["after_refusal"] = seen()
    driver.close()
    print("@@versions " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
