"""Run in its own process: an offline vLLM (default multiprocess mode, dummy weights, backend 'refit') refitted
as versions 1 and 2 by VllmRefit, a refused manifest in between; after each step the version as vLLM's own API
reads it (`LLM.get_weight_version`, each request's `weight_versions` spans), the worker's WeightsVersion, and
whether the worker's tensors equal the trainer's live ones, and the worker's (version, root) beside the root of the
trainer's tensors. Prints one JSON line."""

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

    def proven(stats: object) -> list:
        """(the worker's root reading, the root of the trainer's tensors with the names it left unverified unread)."""
        from refit.checks.root import held_leaves, root

        m = driver.sender.manifest
        live, skip = dict(trainer.state_dict()), set(stats.unverified_names)
        held = [None if n in skip else live[n] for n in m.names]
        want = root(held_leaves(m.names, held, [m.entry(n).spec.dtype for n in m.names]))
        return [llm.collective_rpc("refit_root")[0], {"version": stats.version, "root": want}]

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
    result["root1"] = proven(driver.refit(1))
    result["1"] = seen()
    with torch.no_grad():
        for p in trainer.parameters():
            p.mul_(0.5)
    result["root2"] = proven(driver.refit(2))
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
