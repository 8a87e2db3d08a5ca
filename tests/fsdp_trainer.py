"""One rank of a 2-rank FSDP2 trainer on CPU (gloo), refitting into a peer engine process.

Run with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set and one JSON argument. Rank 0 prints its
rendezvous, then one '@@rank0' JSON line per refit: the stats, the fingerprints of the full
(unsharded) parameters in their wire dtypes, the gathers' peak and the predicted figure.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from refit import Sender, Settings
from refit.fsdp import FsdpSource, _full, sharded_refit
from refit.verify import fingerprints


def build(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Embedding(300, 64), torch.nn.Linear(64, 96), torch.nn.Linear(96, 48),
                               torch.nn.Linear(48, 300))  # fmt: skip


def main() -> int:
    args = json.loads(sys.argv[1])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = build(0)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    source = FsdpSource(model, wire_dtype=torch.bfloat16)
    sender = None
    if rank == 0:
        sender = Sender(source, transport=args["transport"], settings=Settings(bucket_bytes=args["bucket_bytes"]))
        print("@@rank0 " + json.dumps(sender.rendezvous()), flush=True)
    for version in range(1, args["steps"] + 1):
        if version > 1:
            model(torch.arange(32)).square().mean().backward()
            opt.step()
            opt.zero_grad()
        if version == args["steps"]:
            source.set_wire_dtype("3.bias", torch.float32)
        stats = sharded_refit(source, sender, version)
        with torch.no_grad():
            full = {n: _full(t) for n, t in sorted(model.state_dict(keep_vars=True).items())}
        if rank == 0:
            wire = {s.name: s.dtype for s in source.specs()}
            print("@@rank0 " + json.dumps({"stats": stats.to_json(), "fingerprints": fingerprints(full.items(), wire),
                  "peak": source.peak_gathered_bytes, "predicted": source.predicted_gather_bytes(sender.manifest),
                  "model_bytes": sum(t.numel() * t.element_size() for t in full.values())}), flush=True)  # fmt: skip
    if sender is not None:
        sender.close()
    dist.barrier()  # rank 0 hosts the store: leave together
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
