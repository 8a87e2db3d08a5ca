"""One rank of a 2-rank trainer (FSDP2 or a plain replicated model), refitting into engine processes.

Run with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set and one JSON argument:
- "mode": "lead" (rank 0 runs the one Sender, the others follow its gathers) or "ranked" (every
  rank runs its own Sender for the worker on its own device, refit.topology.ranked);
- "model": "fsdp" or "replicated"; "device": "cpu" (gloo) or "cuda" (NCCL, "device_index" per rank);
- "transport", "bucket_bytes", "steps", "dtype_change_at" (the step whose refit sends 3.bias as fp32);
- "verify": the Sender's end-to-end check ("fingerprint"), ranked mode;
- "replace_at": the step before whose refit 1.weight is replaced by a new parameter (new storage, new
  values, the same sharding), as an optimizer wrapper or a checkpoint load with assign=True does;
- "fp8": names the engine holds in block FP8 (the report gives them quantized, as the engine holds them);
- "specs_to": a folder; with "model": "tiny" (Linear(1, 1) layers, so rank 1's local shards are empty, and
  2.weight tied to 0.weight), each rank writes its FsdpSource's specs there as specs-<rank>.json and exits.
Rank 0 prints its rendezvous (ranked: every rank's, a list), then one '@@rank0' JSON line per
refit: the stats (or the error), the fingerprints of the live full parameters in their wire dtypes,
the gathers' peak, the predicted figure and how often each tensor was gathered.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from exits import leave
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from refit import ModuleSource, RefitError, Sender, Settings
from refit.checks.fingerprints import fingerprints
from refit.integrations.fsdp import sharded_refit
from refit.layout import fp8
from refit.sources.fsdp import FsdpSource, full_tensor
from refit.topology.ranked import RankedRefit


def build(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Embedding(300, 64), torch.nn.Linear(64, 96), torch.nn.Linear(96, 48),
                               torch.nn.Linear(48, 301))  # fmt: skip


def _tiny(device: torch.device) -> torch.nn.Module:
    """Three Linear(1, 1): each weight has 1 row, so rank 1 of 2 holds empty local shards; 2.weight is 0.weight."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(1, 1) for _ in range(3))).to(device)
    model[2].weight = model[0].weight
    fully_shard(model, mesh=init_device_mesh(device.type, (dist.get_world_size(),)))
    return model


def _write_specs(args: dict, device: torch.device) -> None:
    """Every rank's specs of the tiny model, written as `specs_to`/specs-<rank>.json."""
    source = FsdpSource(_tiny(device), wire_dtype=torch.bfloat16)
    specs = [[s.name, list(s.shape), str(s.dtype), list(s.aliases)] for s in source.specs()]
    with open(f"{args['specs_to']}/specs-{dist.get_rank()}.json", "w") as f:
        json.dump(specs, f)


def _model(args: dict, device: torch.device) -> tuple[torch.nn.Module, object]:
    model = build(0).to(device)
    if args.get("model", "fsdp") == "replicated":
        return model, ModuleSource(model, wire_dtype=torch.bfloat16)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, FsdpSource(model, wire_dtype=torch.bfloat16)


def _replace(module: torch.nn.Module, name: str) -> None:
    """A new Parameter in place of `name`: its own storage and other values, sharded (or not) as the old one."""
    old = getattr(module, name)
    with torch.no_grad():
        if isinstance(old, DTensor):
            new = DTensor.from_local(
                old.to_local() * 2 + 1, old.device_mesh, old.placements, shape=old.shape, stride=old.stride()
            )
        else:
            new = old.detach() * 2 + 1
    setattr(module, name, torch.nn.Parameter(new))


def _report(model: torch.nn.Module, source, sender, out: dict, fp8_names: list[str]) -> None:
    """Every rank gathers the live full tensors; rank 0 prints them with the refit's outcome (`fp8_names`: as
    an FP8 engine holds them, quantized by the reference rule, with their scales)."""
    with torch.no_grad():
        full = {n: full_tensor(t) for n, t in sorted(model.state_dict(keep_vars=True).items())}
    if dist.get_rank() != 0:
        return
    wire = {
        n: dt
        for s in source.specs()
        for n, dt in [(s.name, s.dtype), *((a, s.dtype) for a in getattr(s, "aliases", ()))]
    }
    for n in fp8_names:
        q, scales = fp8.quantize(full[n], name=n)
        scale_name = fp8.DEFAULT_FORMAT.scale_name(n)
        full[n], full[scale_name], wire[n], wire[scale_name] = q, scales, q.dtype, scales.dtype
    out["fingerprints"] = fingerprints(full.items(), wire)
    out["model_bytes"] = sum(t.numel() * t.element_size() for t in full.values())
    if isinstance(source, FsdpSource):
        out.update(peak=source.peak_gathered_bytes, gathers=dict(source.gather_counts), in_place=source.in_place_bytes,
                   predicted=source.predicted_gather_bytes(sender.manifest) if sender.manifest and not fp8_names else 0)  # fmt: skip
    print("@@rank0 " + json.dumps(out), flush=True)


def main() -> int:
    args = json.loads(sys.argv[1])
    cuda = args.get("device", "cpu") == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    device = torch.device("cpu")
    if cuda:
        device = torch.device("cuda", args.get("device_index", [0, 1])[rank])
        torch.cuda.set_device(device)
    if "specs_to" in args:
        _write_specs(args, device)
        dist.barrier()
        dist.destroy_process_group()
        return 0
    model, source = _model(args, device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ranked = args.get("mode", "lead") == "ranked"
    settings = Settings(bucket_bytes=args["bucket_bytes"], timeout_s=args.get("timeout_s", 120.0))
    sender = driver = None
    if ranked:
        driver = RankedRefit(
            source,
            transport=args["transport"],
            settings=settings,
            device=device,
            verify=args.get("verify"),
            elastic=args.get("elastic", False),
        )
        sender = driver.sender
        infos = driver.rendezvous()
        if rank == 0:
            print("@@rank0 " + json.dumps(infos), flush=True)
    elif rank == 0:
        sender = Sender(source, transport=args["transport"], settings=settings, device=device)
        print("@@rank0 " + json.dumps(sender.rendezvous()), flush=True)
    for version in range(1, args["steps"] + 1):
        if version > 1:
            model(torch.arange(32, device=device)).square().mean().backward()
            opt.step()
            opt.zero_grad()
        if version == args.get("replace_at"):
            _replace(model[1], "weight")
        if version == args.get("dtype_change_at", args["steps"]):
            source.set_wire_dtype("3.bias", torch.float32)
        out: dict = {"version": version}
        try:
            stats = driver.refit(version) if driver is not None else sharded_refit(source, sender, version)
            out["stats"] = stats.to_json() if stats is not None else None
        except RefitError as e:
            out["error"] = f"{type(e).__name__}: {e}"
        _report(model, source, sender, out, args.get("fp8", []))
    if sender is not None:
        sender.close()
    return 0


if __name__ == "__main__":
    leave(main())
