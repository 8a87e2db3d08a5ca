"""One rank of a 2-rank trainer without FSDP: a ModuleSource over this rank's dim-0 slices of the MLP
(tests/helpers/mesh_model.py), on "device" (cpu or cuda), refitting M:N workers over "transport"
(shm, gloo or cuda-ipc). The trainer group (gloo) carries only the plan's agreement and the vote.

Step v's weights are the model's initial weights plus v, so the test knows what every worker must
hold. Rank 0 prints the rendezvous, then one '@@rank0' JSON line per refit (the stats or the error).
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from exits import leave
from mesh_model import build, chunk, local_part

from refit import MeshRefit, ModuleSource, RefitError, Settings


def main() -> int:
    args = json.loads(sys.argv[1])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(args.get("device", "cpu"))
    full = build("mlp").state_dict()
    held = {n: chunk(t.shape[0], world, rank) for n, t in full.items()}
    local = {n: local_part(t, held[n]).clone().to(device) for n, t in full.items()}
    source = ModuleSource(local, wire_dtype=torch.bfloat16, shards=held, shapes={n: t.shape for n, t in full.items()})
    settings = Settings(bucket_bytes=args.get("bucket_bytes", 8192), timeout_s=120.0)
    mesh = MeshRefit(source, num_workers=args["workers"], transport=args["transport"], settings=settings,
                     device=device, verify=args.get("verify"))  # fmt: skip
    info = mesh.rendezvous()
    if rank == 0:
        print("@@rank0 " + json.dumps(info), flush=True)
    for version in range(1, args["steps"] + 1):
        with torch.no_grad():
            for t in local.values():
                t.add_(1.0)
        out: dict = {"version": version}
        try:
            out["stats"] = mesh.refit(version).to_json()
        except RefitError as e:
            out["error"] = f"{type(e).__name__}: {e}"
        out["planned"] = mesh.plan.worker_bytes() if mesh.plan is not None else []
        if rank == 0:
            print("@@rank0 " + json.dumps(out), flush=True)
    mesh.close()
    return 0


if __name__ == "__main__":
    leave(main())
