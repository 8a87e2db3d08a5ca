"""The bench's receiver process: runs each job (floor, refit, baselines) it reads from stdin as JSON.

Started as `python -m refit.tools.bench.worker`; its first stdin line is {"specs", "device"}, each further
line a job; it answers one '@@bench' JSON line per job.
"""

from __future__ import annotations

import json
import statistics
import sys

import torch

from refit.dtypes import dtype_from_name
from refit.engines.module import ModuleEngine
from refit.layout.planner import align_up
from refit.protocol.wire import Header, Kind, parse_json
from refit.settings import Settings
from refit.tools.bench.link import recv_floor
from refit.tools.bench.memory import MemoryProbe
from refit.topology.receiver import Receiver

MARK = "@@bench "


def _floor(r: Receiver, job: dict) -> None:
    """`count` receives, an ACK after every `per` (one timed repeat): one-sided transports move bytes here."""
    assert r.transport is not None and r.channel is not None
    for i in range(job["count"]):
        if i % job["per"] == 0:  # each timed repeat starts at the sender's go
            r.channel.expect(Kind.BUCKET, "the floor's go")
        r.transport.recv(0, job["nbytes"]).wait(r.settings.timeout_s)
        if (i + 1) % job["per"] == 0:
            r.transport.flush()
            r.channel.send(Header(Kind.ACK))


def _per_tensor(r: Receiver, engine: ModuleEngine, job: dict, specs: list[list]) -> None:
    """The baselines: one tensor at a time, with (meta) or without JSON metadata per tensor."""
    assert r.transport is not None and r.channel is not None
    buf, meta = r.transport.buffers[0], job["meta"]
    for _ in range(job["refits"]):
        for name, shape, dtype in sorted(specs):  # the sender's (manifest) order
            if meta:
                info = parse_json(r.channel.expect(Kind.MANIFEST, "per-tensor metadata")[1], "metadata")
                name, shape, dt = info["name"], info["shape"], dtype_from_name(info["dtype"])
                tmp = torch.empty(shape, dtype=dt, device=buf.device)  # allocated per tensor, as before the seed
            else:
                r.channel.expect(Kind.BUCKET, "per-tensor header")
                dt = dtype_from_name(dtype)
            n = torch.Size(shape).numel() * dt.itemsize
            pending = r.transport.recv(0, align_up(n, 256))
            pending.wait(r.settings.timeout_s)
            view = buf[:n].view(dt).view(shape)
            target = engine.tensor(name)
            if meta:
                tmp.copy_(view)
                target.copy_(tmp)
            else:
                target.copy_(view)
            r.transport.release(0)
            if pending.ready:
                r.channel.send(Header(Kind.ACK))
        r.transport.flush()
        r.channel.send(Header(Kind.DONE))


def _mesh_job(job: dict, specs: list[list], device: torch.device, settings: Settings) -> dict:
    """M:N: this worker's tensor-parallel slices only (refit.tools.mesh_figures' layout), fed by every rank."""
    from refit.layout.spec import TensorSpec
    from refit.tools.mesh_figures import statements
    from refit.topology.mesh import MeshReceiver

    full = [TensorSpec(n, tuple(s), dtype_from_name(d)) for n, s, d in specs]
    _, workers = statements(full, ranks=job["workers"], tp=job["workers"], ep=1)
    mine = workers[job["worker"]]
    local = {}
    for sp in full:
        part = mine[sp.name]
        shape = sp.shape if part is None else tuple(part.length if d == part.dim else n for d, n in enumerate(sp.shape))
        local[sp.name] = torch.zeros(shape, dtype=sp.dtype, device=device)
    engine = ModuleEngine(local, shards={n: h for n, h in mine.items() if h is not None})
    probe = MemoryProbe(device)
    with MeshReceiver(engine, job["rendezvous"], worker=job["worker"], settings=settings, device=device) as rx:
        while rx.receive() is not None:
            pass
    return {"mode": "mesh", "peak_extra_bytes": probe.peak_extra(), "stages": {}}


def held(r: Receiver) -> list[torch.Tensor]:
    """The receiver's refit tensors now: its bucket buffers and the receive path's staging tensor."""
    tensors = list(r.transport.buffers) if r.transport is not None else []
    return tensors + ([r.path.unpacker.staging] if r.path is not None else [])


def run_job(job: dict, engine: ModuleEngine, specs: list[list], device: torch.device) -> dict:
    settings = Settings(bucket_bytes=job.get("bucket_bytes"), timeout_s=job.get("timeout_s", 300.0))
    if job["mode"] == "mesh":
        return _mesh_job(job, specs, device, settings)
    if job["mode"] == "tcp_floor":  # the link's floor: plain TCP, no refit
        recv_floor(job["host"], job["port"], job["nbytes"], job["count"], job["timeout_s"])
        return {"mode": "tcp_floor", "peak_extra_bytes": None, "stages": {}}
    probe = MemoryProbe(device)  # before the Receiver, its buffers and its staging tensor exist
    stages: dict[str, float] = {}
    measured = None
    with Receiver(engine, job["rendezvous"], settings=settings, device=device) as r:
        if job["mode"] == "refit":
            stats = []
            while (s := r.receive()) is not None:
                stats.append(s)
            measured = probe.measured(held(r))  # the sender closed, this side not yet: its buffers are still held
            timed = stats[job.get("warmup", 0) :] or stats
            keys = sorted({k for s in timed for k in s.seconds})
            stages = {k: statistics.median(s.seconds.get(k, 0.0) for s in timed) for k in keys}
        else:
            r.connect()
            _floor(r, job) if job["mode"] == "floor" else _per_tensor(r, engine, job, specs)
            r.channel.expect(Kind.CLOSE, "end of bench job")  # type: ignore[union-attr]
    return {"mode": job["mode"], "peak_extra_bytes": measured, "stages": stages}


def main() -> int:
    args = json.loads(sys.stdin.readline())
    device = torch.device(args["device"])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    specs = args["specs"]
    tensors = {n: torch.zeros(s, dtype=dtype_from_name(d), device=device) for n, s, d in specs}
    engine = ModuleEngine(tensors)
    print(MARK + json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        print(MARK + json.dumps(run_job(json.loads(line), engine, specs, device)), flush=True)
    return 0


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    raise SystemExit(main())
