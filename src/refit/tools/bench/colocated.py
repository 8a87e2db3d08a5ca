"""Per-rank colocated bench: N trainer ranks holding dim-0 shards (as FSDP2 does) feed N engine workers.

Measured in one run, on N devices (GPUs with NCCL and cuda-ipc, or CPU processes with gloo and shm):
- floor: one all-gather of the whole model (a flat buffer) plus one local copy of the model's bytes;
- per_rank: `RankedRefit`, every rank gathering each bucket once, straight into the bucket buffer the
  worker on its own device reads; besides the all-gather no byte crosses devices;
- per_rank_schedule: the same, gathering along FsdpSource's own schedule and packing (one more copy);
- rank0_led: the path before it: rank 0 gathers and sends, every worker reads rank 0's buffers;
- m_to_n: `MeshRefit`, every rank sending each worker only the part of its own shard that the worker
  keeps (the workers are tensor-parallel over the N devices, refit.tools.mesh_figures' layout); no
  rank gathers, each worker receives about 1/N of the model.

`run_colocated` starts the ranks (`python -m refit.tools.bench.colocated`) and the workers
(`python -m refit.tools.bench.worker`) and returns a JSON-able report.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

import refit
from refit.dtypes import dtype_from_name, dtype_name
from refit.settings import given
from refit.tools.bench.presets import PRESETS, from_config, specs
from refit.tools.bench.worker import MARK
from refit.tools.children import module_command

RANK_MARK = "@@colocated "
METHODS = ("floor", "per_rank", "per_rank_schedule", "rank0_led", "m_to_n")


@dataclass(kw_only=True, slots=True)
class ColocatedConfig:
    preset: str = "tiny"
    config: str | None = None
    dtype: str = "bfloat16"
    """Dtype of the trainer's shards and of the wire."""
    ranks: int = 2
    repeats: int = 5
    warmup: int = 1
    bucket_bytes: int = 1 << 30
    timeout_s: float = 600.0
    """Limit on each wait inside a refit (REFIT_TIMEOUT when set)."""
    methods: tuple[str, ...] = METHODS
    num_slots: int = 2
    """Bucket buffers per per-rank Sender (1: the worker's copy never overlaps the next gather)."""
    device: str = ""
    """'cuda' or 'cpu'; empty: cuda when there are `ranks` GPUs."""

    def __post_init__(self) -> None:
        if not self.config and self.preset not in PRESETS:
            raise ValueError(f"unknown preset {self.preset!r}; choose one of {', '.join(PRESETS)}, or pass --config")
        if self.ranks < 1 or self.repeats < 1 or self.warmup < 0:
            raise ValueError(f"ranks ({self.ranks}) and repeats ({self.repeats}) must be >= 1, warmup >= 0")
        unknown = sorted(set(self.methods) - set(METHODS))
        if unknown:
            raise ValueError(f"unknown methods {', '.join(unknown)}; choose from {', '.join(METHODS)}")
        if not self.device:
            self.device = "cuda" if torch.cuda.is_available() and torch.cuda.device_count() >= self.ranks else "cpu"
        if self.device == "cuda" and torch.cuda.device_count() < self.ranks:
            raise ValueError(f"{self.ranks} ranks need {self.ranks} GPUs, this machine has {torch.cuda.device_count()}")
        dtype_from_name(self.dtype)


# -- one trainer rank --------------------------------------------------------------------------------


def _shards(cfg: ColocatedConfig, device: torch.device) -> dict[str, torch.Tensor]:
    """This rank's dim-0 shard of every tensor, as DTensors with the model's global shapes."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    rank, world = dist.get_rank(), dist.get_world_size()
    shape = from_config(cfg.config) if cfg.config else PRESETS[cfg.preset]
    g = torch.Generator(device=device).manual_seed(rank)
    out = {}
    for s in specs(shape, dtype_from_name(cfg.dtype)):
        chunk = -(-s.shape[0] // world) if s.shape else 0
        rows = max(0, min(chunk, s.shape[0] - rank * chunk)) if s.shape else 0
        local = torch.randn((rows, *s.shape[1:]), generator=g, device=device).to(s.dtype)
        stride = torch.empty(s.shape, device="meta").stride()
        out[s.name] = DTensor.from_local(
            local, mesh, [Shard(0)], run_check=False, shape=torch.Size(s.shape), stride=stride
        )
    return out


def _timed(fn: Callable[[], object], cfg: ColocatedConfig, device: torch.device) -> list[float]:
    times = []
    for i in range(cfg.warmup + cfg.repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dist.barrier()
        t = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= cfg.warmup:
            times.append(time.perf_counter() - t)
    return times


def _floor(shards: dict[str, torch.Tensor], cfg: ColocatedConfig, device: torch.device) -> dict:
    """All-gather of the model's bytes as one flat buffer, and one local copy of them, timed apart."""
    world = dist.get_world_size()
    nbytes = sum(t.numel() * t.element_size() for t in shards.values())
    per_rank = -(-nbytes // world)
    bufs = {
        "shard": torch.empty(per_rank, dtype=torch.uint8, device=device),
        "full": torch.empty(per_rank * world, dtype=torch.uint8, device=device),
    }
    gather = _timed(lambda: dist.all_gather_into_tensor(bufs["full"], bufs["shard"]), cfg, device)
    bufs["copy"] = torch.empty_like(bufs["full"])
    copy = _timed(lambda: bufs["copy"].copy_(bufs["full"]), cfg, device)
    bufs.clear()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {
        "times": [a + c for a, c in zip(gather, copy)],
        "all_gather_s": statistics.median(gather),
        "copy_s": statistics.median(copy),
    }


def _say(obj: dict) -> None:
    if dist.get_rank() == 0:
        print(RANK_MARK + json.dumps(obj), flush=True)


def _method(method: str, shards: dict[str, torch.Tensor], cfg: ColocatedConfig, device: torch.device) -> dict:
    """One refit method, timed on every rank (each refit ends when every worker committed)."""
    from refit.integrations.fsdp import sharded_refit
    from refit.settings import Settings
    from refit.sources.fsdp import FsdpSource
    from refit.topology.ranked import RankedRefit
    from refit.topology.sender import Sender

    transport = "cuda-ipc" if device.type == "cuda" else "shm"
    settings = Settings(bucket_bytes=cfg.bucket_bytes, timeout_s=cfg.timeout_s)
    source = FsdpSource(shards)
    rank, world = dist.get_rank(), dist.get_world_size()
    version = iter(range(1, 1 << 30))
    if method == "m_to_n":
        return _mesh(source, settings, transport, cfg, device)
    if method.startswith("per_rank"):
        driver = RankedRefit(
            source, transport=transport, settings=settings, device=device, num_slots=cfg.num_slots, verify=None
        )
        driver.gather_into_buckets = method == "per_rank"
        _say({"event": "rendezvous", "method": method, "infos": driver.rendezvous()})
        seen: list = []
        times = _timed(lambda: seen.append(driver.refit(next(version))), cfg, device)
        stages = _stages(seen[cfg.warmup :])
    else:
        sender = (
            Sender(source, transport=transport, settings=settings, device=device, num_receivers=world, verify=None)
            if rank == 0
            else None
        )
        if sender is not None:
            _say({"event": "rendezvous", "method": method, "infos": [sender.rendezvous()] * world})
        times = _timed(lambda: sharded_refit(source, sender, next(version)), cfg, device)
        stages = {}
    if sender is not None:
        sender.close()
    return {
        "times": times,
        "peak_gathered_bytes": source.peak_gathered_bytes,
        "in_place_bytes": source.in_place_bytes,
        "gathers_per_tensor": max(source.gather_counts.values(), default=0) / (cfg.warmup + cfg.repeats),
        "stages_s": stages,
    }


def _mesh(source, settings, transport: str, cfg: ColocatedConfig, device: torch.device) -> dict:  # type: ignore[no-untyped-def]
    """M:N: each rank's own shard, sliced for every worker; nothing gathered."""
    from refit.topology.mesh import MeshRefit

    world = dist.get_world_size()
    mesh = MeshRefit(source, num_workers=world, transport=transport, settings=settings, device=device, verify=None)
    _say({"event": "rendezvous", "method": "m_to_n", "infos": [mesh.rendezvous()] * world, "mesh": True})
    version = iter(range(1, 1 << 30))
    seen: list = []
    times = _timed(lambda: seen.append(mesh.refit(next(version))), cfg, device)
    assert mesh.plan is not None
    worker_bytes = mesh.plan.worker_bytes()
    mesh.close()
    return {"times": times, "peak_gathered_bytes": 0, "in_place_bytes": 0, "gathers_per_tensor": 0,
            "stages_s": {}, "worker_bytes": worker_bytes}  # fmt: skip


def _stages(stats: list) -> dict[str, float]:
    """Rank 0's median seconds per sender stage (gather and pack together are 'pack')."""
    names = sorted({k for s in stats for k in s.seconds})
    return {k: statistics.median(s.seconds.get(k, 0.0) for s in stats) for k in names}


def rank_main(cfg: ColocatedConfig) -> int:
    cuda = cfg.device == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cpu")
    if cuda:
        device = torch.device("cuda", dist.get_rank())
        torch.cuda.set_device(device)
    try:
        shards = _shards(cfg, device)
        for method in cfg.methods:
            result = _floor(shards, cfg, device) if method == "floor" else _method(method, shards, cfg, device)
            _say({"event": "result", "method": method, **result})
    finally:
        dist.barrier()
        dist.destroy_process_group()
    return 0


# -- the launcher --------------------------------------------------------------------------------------


def _read(proc: subprocess.Popen, mark: str) -> dict:
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith(mark):
            return json.loads(line[len(mark) :])
    raise RuntimeError(f"bench process exited with {proc.wait()} before reporting")


def _env(**extra: str) -> dict[str, str]:
    env = {**os.environ, **extra}
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [os.path.dirname(os.path.dirname(refit.__file__)), env.get("PYTHONPATH")])
    )
    return env


def run_colocated(cfg: ColocatedConfig) -> dict:
    """Run every method in `cfg.methods`; returns a JSON-able report (medians, ratios to the floor).
    Tried twice: the trainer's store port is picked free, but another process can take it first."""
    try:
        return _run(cfg)
    except _PortTaken:
        return _run(cfg)


class _PortTaken(RuntimeError):
    pass


def _run(cfg: ColocatedConfig) -> dict:
    shape = from_config(cfg.config) if cfg.config else PRESETS[cfg.preset]
    spec_list = specs(shape, dtype_from_name(cfg.dtype))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ranks = [
        subprocess.Popen(
            module_command("refit.tools.bench.colocated", json.dumps(asdict(cfg))),
            text=True,
            stdout=subprocess.PIPE if r == 0 else subprocess.DEVNULL,
            env=_env(RANK=str(r), WORLD_SIZE=str(cfg.ranks), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)),
        )
        for r in range(cfg.ranks)
    ]
    payload = [[s.name, list(s.shape), dtype_name(s.dtype)] for s in spec_list]
    workers = [
        subprocess.Popen(
            module_command("refit.tools.bench.worker"),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=_env(),
        )
        for _ in range(cfg.ranks)
    ]
    results = {}
    try:
        for i, w in enumerate(workers):
            _write(w, {"specs": payload, "device": f"cuda:{i}" if cfg.device == "cuda" else "cpu"})
            _read(w, MARK)
        while len(results) < len(cfg.methods):
            try:
                msg = _read(ranks[0], RANK_MARK)
            except RuntimeError:
                if not results and ranks[0].wait() != 0:
                    raise _PortTaken("trainer rank 0 failed before its first result") from None
                raise
            if msg["event"] == "rendezvous":
                for i, (w, info) in enumerate(zip(workers, msg["infos"])):
                    mode = "mesh" if msg.get("mesh") else "refit"
                    job = {"mode": mode, "rendezvous": info, "worker": i, "workers": len(workers)}
                    _write(w, {**job, "bucket_bytes": cfg.bucket_bytes, "timeout_s": cfg.timeout_s})
            else:
                if msg["method"] != "floor":
                    for w in workers:
                        _read(w, MARK)
                results[msg["method"]] = msg
    finally:
        for w in workers:
            if w.stdin is not None:
                w.stdin.close()
        for p in ranks[1:] if not results else []:
            p.kill()  # rank 0 never started: the others would wait for it
        codes = [p.wait(timeout=600) for p in [*ranks, *workers]]
    if any(codes):
        raise RuntimeError(f"bench processes exited with {codes}")
    return _report(cfg, sum(s.nbytes for s in spec_list), len(spec_list), results)


def _write(proc: subprocess.Popen, obj: dict) -> None:
    assert proc.stdin is not None
    proc.stdin.write(json.dumps(obj) + "\n")
    proc.stdin.flush()


def _report(cfg: ColocatedConfig, nbytes: int, num_tensors: int, results: dict) -> dict:
    floor = statistics.median(results["floor"]["times"]) if "floor" in results else None
    out = {}
    for method, r in results.items():
        med = statistics.median(r["times"])
        out[method] = {
            **{k: v for k, v in r.items() if k not in ("event", "method")},
            "median_s": med,
            "gbps": nbytes / med / 1e9,
            "ratio_to_floor": med / floor if floor else None,
        }
    if "m_to_n" in out and "floor" in results:  # its own floor: one local copy of what a worker receives
        share = max(out["m_to_n"]["worker_bytes"]) / nbytes
        out["m_to_n"]["copy_floor_s"] = results["floor"]["copy_s"] * share
        out["m_to_n"]["ratio_to_copy_floor"] = out["m_to_n"]["median_s"] / out["m_to_n"]["copy_floor_s"]
        for base in ("per_rank", "rank0_led"):
            if base in out:
                out["m_to_n"][f"speedup_over_{base}"] = out[base]["median_s"] / out["m_to_n"]["median_s"]
    if "per_rank" in out and "rank0_led" in out:
        out["per_rank"]["speedup_over_rank0_led"] = out["rank0_led"]["median_s"] / out["per_rank"]["median_s"]
    device = torch.cuda.get_device_name(0) if cfg.device == "cuda" else "cpu"
    return {
        "mode": "colocated",
        "config": {**asdict(cfg), "methods": list(cfg.methods)},
        "nbytes": nbytes,
        "tensors": num_tensors,
        "device": device,
        "torch": torch.__version__,
        "results": out,
    }


def show(report: dict, console) -> None:  # type: ignore[no-untyped-def]
    """A rich table of one colocated report."""
    from rich.table import Table

    c = report["config"]
    title = (
        f"per-rank colocated: {c['config'] or c['preset']}, {report['nbytes'] / 1e9:.3f} GB, {c['ranks']} ranks on "
        f"{report['device']}, buckets of {c['bucket_bytes'] >> 20} MiB"
    )
    table = Table(title=title)
    for col in ("method", "ms", "x floor", "GB/s", "note"):
        table.add_column(col, justify="left" if col in ("method", "note") else "right")
    labels = {
        "floor": "floor: all-gather + one local copy",
        "per_rank": "per-rank refit (RankedRefit)",
        "per_rank_schedule": "per-rank, gather schedule + pack",
        "rank0_led": "rank-0-led refit (sharded_refit)",
        "m_to_n": "M:N refit (MeshRefit), TP workers",
    }
    for method, r in report["results"].items():
        note = (
            f"all-gather {r['all_gather_s'] * 1e3:.1f} ms + copy {r['copy_s'] * 1e3:.1f} ms"
            if method == "floor"
            else f"each worker receives {max(r['worker_bytes']) / report['nbytes']:.2f} of the model, no gather; "
            f"{r.get('ratio_to_copy_floor', 0):.2f}x a local copy of those bytes; "
            f"{r.get('speedup_over_per_rank', 0):.1f}x faster than per-rank"
            if method == "m_to_n"
            else f"{r['gathers_per_tensor']:.0f} gather(s)/tensor/refit"
            + (f"; {r['speedup_over_rank0_led']:.2f}x faster than rank-0-led" if "speedup_over_rank0_led" in r else "")
        )
        ratio = r["ratio_to_floor"]
        table.add_row(
            labels[method], f"{r['median_s'] * 1e3:.1f}", f"{ratio:.2f}" if ratio else "", f"{r['gbps']:.1f}", note
        )
    console.print(table)


def cli(args, console) -> int:  # type: ignore[no-untyped-def]
    """`refit bench --ranks N`: one colocated report per preset (--methods picks among floor,per_rank,rank0_led)."""
    methods = tuple(m for m in (args.methods or ",".join(METHODS)).split(",") if m in METHODS) or METHODS
    reports = []
    for preset in ["tiny"] if args.quick else args.preset.split(","):
        cfg = ColocatedConfig(
            preset=preset,
            config=args.config,
            dtype=args.dtype,
            ranks=args.ranks,
            methods=methods,
            repeats=3 if args.quick else args.repeats,
            warmup=args.warmup,
            bucket_bytes=args.bucket_bytes,
            timeout_s=args.settings.timeout_s if given("REFIT_TIMEOUT") else 600.0,
        )
        reports.append(run_colocated(cfg))
        show(reports[-1], console)
        if args.json:  # after every preset, so a later failure keeps the earlier figures
            with open(args.json, "w") as f:
                json.dump(reports, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(
        rank_main(ColocatedConfig(**{**json.loads(sys.argv[1]), "methods": tuple(json.loads(sys.argv[1])["methods"])}))
    )
