"""Run in its own process: one vLLM (default multiprocess mode, tensor parallel size from argv) refitted
through the compiled load plan and through vLLM's own load_weights path with the same weights; prints
one JSON line comparing every vLLM parameter, the greedy output, and what each worker reads back.

For each option set in argv: a load_weights session (v1, then a train step with dtype changes, which
starts a new epoch: v2), then a plan session from the same first weights doing the same. Each session
is a fresh backend on the same vLLM; each compared refit starts from weights other than the ones it
must produce, so a refit that loads nothing cannot pass.
"""

from __future__ import annotations

import json
import sys

import torch


def _generate(llm, prompts: list[list[int]]) -> list[list[int]]:
    from vllm import SamplingParams

    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=12),
                        use_tqdm=False)  # fmt: skip
    return [list(o.outputs[0].token_ids) for o in outs]


def _held_mismatches(llm, source) -> tuple[list[str], int]:
    """Names whose read-back differs from the trainer's live tensor (cast to the wire dtype), and how many were read."""
    from refit.checks.fingerprints import fingerprint

    primary = source.specs()
    tensors = dict(zip((s.name for s in primary), source.tensors([s.name for s in primary])))
    specs = {n: s for s in primary for n in s.names}
    live = {n: tensors[s.name] for n, s in specs.items()}
    bad, n = [], 0
    for worker in llm.collective_rpc("refit_held"):
        for name, (dtype, region, fp) in worker.items():
            t = live[name].detach().to(specs[name].dtype)
            if region is not None:
                t = t.narrow(region[0], region[1], region[2] - region[1])
            held = getattr(torch, dtype)
            n += 1
            if fingerprint(t.to(held), held) != fp:
                bad.append(name)
    return sorted(set(bad)), n


def _reference(trainer, source, prompts: list[list[int]]) -> list[list[int]]:
    """The trainer's own greedy output with exactly the weights it sends (cast to the wire dtypes)."""
    import copy

    from refit.tools.demo.model import greedy

    ref = copy.deepcopy(trainer)
    specs = {s.name: s for s in source.specs()}
    with torch.no_grad():
        for n, t in ref.state_dict(keep_vars=True).items():
            if n in specs:
                t.copy_(t.detach().to(specs[n].dtype))
    return greedy(ref, prompts)


def main() -> int:
    model_dir, prompts, tp, option_sets = (
        sys.argv[1],
        json.loads(sys.argv[2]),
        int(sys.argv[3]),
        json.loads(sys.argv[4]),
    )
    from transformers import AutoModelForCausalLM
    from vllm import LLM

    from refit import ModuleSource, Sender, Settings
    from refit.integrations.vllm import VllmOptions, VllmRefit

    llm = LLM(model=model_dir, load_format="dummy", enforce_eager=True, dtype="float32", max_model_len=256,
              kv_cache_memory_bytes=64 << 20, tensor_parallel_size=tp, weight_transfer_config={"backend": "refit"},
              worker_extension_cls="refit.integrations.vllm.RefitWorkerExtension",
              **({"distributed_executor_backend": "mp"} if tp > 1 else {}))  # fmt: skip
    trainer = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    source = ModuleSource(trainer, wire_dtype=torch.bfloat16)
    w1 = {k: v.clone() for k, v in trainer.state_dict().items()}
    changed = ("model.norm.weight", "model.layers.0.self_attn.q_proj.weight")

    def session(options: dict, mode: str) -> tuple[list, list, dict]:
        """Refit v1, then a train step with dtype changes (a new epoch in the same session), v2."""
        llm.collective_rpc("shutdown_weight_transfer_engine")
        trainer.load_state_dict(w1)
        for name in changed:
            source.set_wire_dtype(name, None)
        sender = Sender(source, transport="shm", num_receivers=tp, settings=Settings(bucket_bytes=1 << 20),
                        verify="fingerprint" if mode == "plan" else None)  # fmt: skip
        driver = VllmRefit(llm, sender, options=VllmOptions(mode=mode, **options))
        params, outs, refs, stats = [], [], [], {}
        for v in (1, 2):
            if v == 2:
                torch.manual_seed(1)
                with torch.no_grad():
                    for p in trainer.parameters():
                        p.add_(torch.randn_like(p) * 0.02)
                for name in changed:
                    source.set_wire_dtype(name, torch.float32)
            s = driver.refit(v)
            stats = {"handshake": s.handshake, "epoch": s.epoch, "seconds": s.seconds, "unverified": s.unverified}
            params.append(llm.collective_rpc("refit_parameters"))
            outs.append(_generate(llm, prompts))
            refs.append(_reference(trainer, source, prompts))
        held = _held_mismatches(llm, source) if mode == "plan" else ([], 0)
        driver.close()
        return params, outs, {"stats": stats, "held": held, "refs": refs}

    def diff(a: list[dict], b: list[dict]) -> list[str]:
        return sorted({k for wa, wb in zip(a, b) for k in wa if "#shadow" not in k and wa[k] != wb.get(k)})

    results = []
    for options in option_sets:
        # The plan session starts from the weights load_weights left (v2), so a refit that loads nothing fails.
        lw, lw_out, _ = session(options, "load_weights")
        plan, plan_out, info = session(options, "plan")
        results.append({"options": options, "diff": [diff(plan[i], lw[i]) for i in range(2)], "lw": lw_out, "plan": plan_out,
                        "ref": info["refs"], "changed": lw[0] != lw[1], "held_bad": info["held"][0], "held": info["held"][1],
                        "stats": info["stats"], "params": len(plan[0][0])})  # fmt: skip
    print("@@compare " + json.dumps(results), flush=True)
    llm.llm_engine.engine_core.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
