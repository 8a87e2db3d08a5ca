"""One rank of a 2-rank FSDP2 trainer (gloo, CPU) refitting M:N engine workers (refit.topology.mesh).

One JSON argument: "kind" ("mlp" or "moe", tests/helpers/mesh_model.py), "workers", "transport",
"steps", "verify", "dtype_change_at" (the step whose refit sends one bias as fp32), "replace_at" (the
step before whose refit a parameter is replaced by a new DTensor), "elastic" (MeshRefit(elastic=True); each
'@@rank0' line then has "errors": every rank's error or null) and "gated" (each refit waits for a line on
rank 0's stdin, so a test can act between refits), "await_s" (from the second refit on, how long an elastic
refit waits for a missing worker: never a process start, which the first refit waits for), "delta"
(MeshRefit(delta=True), over a link costed slow so that every bucket may go as a delta) and "lr" (the SGD step's). Rank 0 prints the
rendezvous, then
per refit one '@@rank0' JSON line: the stats (or the error), per worker the fingerprints of its slices
of the live full tensors (as the engine must hold them: cast to the wire dtype, read in fp32), and how
many all-gathers each rank ran inside refit().
"""

from __future__ import annotations

import json
import sys
from collections import Counter

import torch
import torch.distributed as dist
from exits import leave
from mesh_model import build, local_part, statement
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from refit import RefitError, Settings
from refit.checks.fingerprints import fingerprint
from refit.sources.fsdp import FsdpSource, full_tensor
from refit.stages.delta import Costs
from refit.topology.mesh import MeshRefit

CALLS: Counter = Counter()


def _count_gathers() -> None:
    """Count every all-gather (the refit must run none but the plan's small JSON agreement)."""
    for name in ("all_gather", "all_gather_into_tensor", "all_gather_object", "_all_gather_base"):
        real = getattr(dist, name)

        def counted(*a, _real=real, _name=name, **k):  # type: ignore[no-untyped-def]
            CALLS[_name] += 1
            return _real(*a, **k)

        setattr(dist, name, counted)


def _model(kind: str) -> torch.nn.Module:
    model = build(kind)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for m in model.modules():
        if isinstance(m, (torch.nn.Linear, torch.nn.Embedding)):
            fully_shard(m, mesh=mesh)
    if kind == "mlp":
        fully_shard(model, mesh=mesh)  # a container without forward (the MoE's ModuleDict) is not wrapped
    return model


def _step(model: torch.nn.Module, kind: str, opt: torch.optim.Optimizer) -> None:
    if kind == "mlp":
        loss = model(torch.arange(32)).square().mean()
    else:
        x = model["embed"](torch.arange(8))
        y = sum(e(x) for e in model["experts"]) + model["router"](x).sum()
        loss = model["head"](y).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()


def _replace(module: torch.nn.Module, name: str) -> None:
    old = getattr(module, name)
    with torch.no_grad():
        new = DTensor.from_local(old.to_local() * 2 + 1, old.device_mesh, old.placements, shape=old.shape,
                                 stride=old.stride())  # fmt: skip
    setattr(module, name, torch.nn.Parameter(new))


def _expected(model: torch.nn.Module, source: FsdpSource, kind: str, workers: int) -> list[dict[str, str]]:
    with torch.no_grad():
        full = {n: full_tensor(t) for n, t in model.state_dict(keep_vars=True).items()}
    wire = {s.name: s.dtype for s in source.specs()}
    out = []
    for w in range(workers):
        held = statement(kind, w, workers)
        out.append({n: fingerprint(local_part(full[n], h).to(wire[n]).float(), torch.float32) for n, h in held.items()})
    return out


def main() -> int:
    args = json.loads(sys.argv[1])
    dist.init_process_group("gloo")
    rank, kind, workers = dist.get_rank(), args["kind"], args["workers"]
    model = _model(kind)
    source = FsdpSource(model, wire_dtype=torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=args.get("lr", 0.1))
    settings = Settings(bucket_bytes=args.get("bucket_bytes", 8192), timeout_s=120.0)
    mesh = MeshRefit(source, num_workers=workers, transport=args["transport"], settings=settings,
                     verify=args.get("verify"), elastic=args.get("elastic", False),
                     delta=args.get("delta", False),
                     delta_costs=Costs.known(link=1.0, per_op=0.0, per_byte=0.0) if args.get("delta") else None)  # fmt: skip
    info = mesh.rendezvous()
    if rank == 0:
        print("@@rank0 " + json.dumps(info), flush=True)
    _count_gathers()
    bias = "2.bias" if kind == "mlp" else "router.bias"
    for version in range(1, args["steps"] + 1):
        if version > 1:
            _step(model, kind, opt)
        if version == args.get("replace_at"):
            _replace(model[1] if kind == "mlp" else model["experts"][0][0], "weight")
        if version == args.get("dtype_change_at"):
            source.set_wire_dtype(bias, torch.float32)
        out: dict = {"version": version}
        if version == 2 and "await_s" in args:
            mesh.settings.connect_timeout_s = args["await_s"]
        if args.get("gated"):
            if rank == 0:
                sys.stdin.readline()
            dist.barrier()
        CALLS.clear()
        try:
            out["stats"] = mesh.refit(version).to_json()
        except (RefitError, ValueError) as e:
            out["error"] = f"{type(e).__name__}: {e}"
        out["gathers"] = dict(CALLS)
        if args.get("elastic"):
            errors: list = [None] * dist.get_world_size()
            dist.all_gather_object(errors, out.get("error"))
            out["errors"] = errors
        out["planned"] = mesh.plan.worker_bytes() if mesh.plan is not None else []
        expected = _expected(model, source, kind, workers)
        if rank == 0:
            out["expected"] = expected
            print("@@rank0 " + json.dumps(out), flush=True)
    mesh.close()
    return 0


if __name__ == "__main__":
    leave(main())
