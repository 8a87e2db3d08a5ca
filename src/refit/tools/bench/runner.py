"""The bench's sender side: one run measures the floor, refit and the baselines on the same link."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import socket
import statistics
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from functools import partial

import torch

import refit
from refit import transports
from refit.checks.copy_digest import kernel_built, prepared_digests
from refit.checks.tensor_digest import digests, prepared
from refit.dtypes import dtype_from_name, dtype_name
from refit.errors import RefitError
from refit.layout.copy_kernel import BatchedCopy, available
from refit.layout.planner import align_up
from refit.layout.spec import TensorSpec
from refit.protocol.wire import Header, Kind
from refit.settings import Settings
from refit.sources.module import ModuleSource
from refit.tools.bench.link import A_ADDR, B_ADDR, NET_ONLY, Link, rate_bits, send_floor
from refit.tools.bench.memory import MemoryProbe
from refit.tools.bench.presets import PRESETS, Shape, from_config, specs
from refit.tools.bench.quantize import FP8_ENGINE, FP8_METHODS, measured, sides
from refit.tools.bench.report import VERIFIED
from refit.tools.bench.worker import MARK
from refit.tools.children import module_command
from refit.topology.options import ZERO_COPY_TRANSPORTS
from refit.topology.sender import Sender

METHODS = (
    "floor",
    "foreach",
    "kernel",
    "refit",
    "checksum",
    "fingerprint",
    "zero_copy",
    "zero_copy_fingerprint",
    "digest",
    "copy_digest",
    "serial",
    "per_tensor",
    "per_tensor_meta",
    "step_full",
    "step_delta",
    "step_delta_worst",
    "quantize",
)
SENDER_STAGES = ("handshake", "pack", "send", "wait", "commit")
"""Sender stages in the report; `handshake` includes the per-refit signature check."""
RECEIVER_STAGES = ("recv", "load", "commit")
"""The first receiver's stages in the report, as `recv.<stage>`."""
LOCAL = {"foreach", "kernel"}
"""Copies of the tensors inside the sender's process: measured for colocated transports only."""
PROBES = {"digest", "copy_digest"}
"""The fingerprint's kernels alone, in the sender's process, each against a flat copy and a flat read of the
model's bytes on the same device (copy_digest: with the fused CUDA kernel only). Not stages of a verified
refit: it takes its digests inside the copies it makes anyway."""
COLOCATED = {"shm", "cuda-ipc"}
STEPPED = {"step_full", "step_delta", "step_delta_worst"}
"""Refits after a real optimizer step each (fp32 master weights, AdamW at STEP_LR, sent in the wire dtype):
full, and delta (only the chunks changed since the last commit); delta's worst case at WORST_LR."""
STEP_LR = 1e-6
"""RL post-training's learning rates are 1e-6 to 1e-5: each step changes a small fraction of bf16 values."""
WORST_LR = 1e-2
"""AdamW moves each value by about its learning rate: at 1e-2, far over a bf16 step of any weight drawn at std
0.02, so every trained value changes every step (delta's worst case: it must cost no more than a full refit)."""
LINKED = ("gloo", "nixl")
"""Transports the bench runs across a namespaced link. Not nixl yet: this process enters the trainer's
namespace per thread (setns) and keeps the host's /sys, where UCX lists network devices, so UCX's TCP
transport finds no veth; the sender needs its own process under `ip netns exec` for that."""
LINK_METHODS = ("floor", "refit", "fingerprint", "step_full", "step_delta")
"""The default methods across a namespaced link (--link-rate): the floor, and refits full and delta."""


def default_transport(name: str = "") -> str:
    """`name`, or the bench's default: cuda-ipc with CUDA, shm without."""
    return name or ("cuda-ipc" if torch.cuda.is_available() else "shm")


EITHER_MEMORY = {"nixl"}
"""Transports that move host or device memory: the bench gives them the GPU where there is one."""


def bench_device(transport: str) -> torch.device:
    """Where the sender's tensors and buffers live: cuda:0 for a CUDA transport, and for one in
    EITHER_MEMORY where CUDA is available (nixl then reads VRAM, two processes on one GPU); else the CPU."""
    on_gpu = transports.get(transport).device_type == "cuda" or (
        transport in EITHER_MEMORY and torch.cuda.is_available()
    )
    return torch.device("cuda:0" if on_gpu else "cpu")


def applicable(transport: str, device: torch.device | None = None) -> tuple[str, ...]:
    """The methods that measure something over `transport` with the sender's tensors on `device` (default:
    `bench_device`), in METHODS order."""
    if device is None:
        device = bench_device(transport)

    def applies(m: str) -> bool:
        if m in LOCAL:
            return transport in COLOCATED and (m == "foreach" or available(device))
        if m == "copy_digest":
            return available(device) and device.type == "cuda"
        if m.startswith("zero_copy"):
            return transport in ZERO_COPY_TRANSPORTS
        return True

    return tuple(m for m in METHODS if applies(m))


@dataclass(kw_only=True, slots=True)
class BenchConfig:
    preset: str = "tiny"
    """A name from PRESETS, ignored when `config` is set."""
    config: str | None = None
    """Path of a transformers config.json to derive the shapes from."""
    dtype: str = "bfloat16"
    transport: str = ""
    """Any registered transport; empty: cuda-ipc with CUDA, shm without."""
    receivers: int = 1
    repeats: int = 5
    """Timed refits per method, after `warmup` untimed ones."""
    warmup: int = 1
    bucket_bytes: int = 1 << 30
    timeout_s: float = 300.0
    """Limit on each wait inside a refit, on both sides (the CLI: REFIT_TIMEOUT when set)."""
    methods: tuple[str, ...] = tuple(m for m in METHODS if m != "quantize")
    """Default: every method but `quantize`, which needs an FP8 engine (`engine_dtype="fp8"`)."""
    layers: int | None = None
    """Keep only the model's first `layers` layers (None: all)."""
    link_rate: str | None = None
    """Put the receivers in their own network namespace, joined to the sender's by a veth pair limited to this
    tc rate ("1gbit", "10gbit"; "none": the veth's own speed), and measure the floor as a raw TCP transfer
    across it (refit.tools.bench.link; needs root). None: no link, everything in this namespace."""
    engine_dtype: str | None = None
    """What the engine holds (refit.tools.bench.quantize.sides): None, the shape as it is on both sides;
    `float`, no FP8 anywhere; `fp8`, every linear weight in FP8 blocks, quantized by the trainer each refit."""

    def __post_init__(self) -> None:
        if not self.config and self.preset not in PRESETS:
            raise ValueError(f"unknown preset {self.preset!r}; choose one of {', '.join(PRESETS)}, or pass --config")
        if self.receivers < 1 or self.repeats < 1 or self.warmup < 0:
            raise ValueError("receivers and repeats must be >= 1 and warmup >= 0")
        unknown = set(self.methods) - set(METHODS)
        if unknown:
            raise ValueError(f"unknown methods {', '.join(sorted(unknown))}; choose from {', '.join(METHODS)}")
        self.transport = default_transport(self.transport)
        transports.get(self.transport)
        dtype_from_name(self.dtype)
        if self.layers is not None:
            self.shape  # noqa: B018 - validates layers against the model
        self._check_engine_dtype()
        if self.link_rate is not None:
            rate_bits(self.link_rate)
            if self.transport not in LINKED:
                raise ValueError(f"--link-rate runs {', '.join(LINKED)} for now, not {self.transport}")

    @property
    def shape(self) -> Shape:
        shape = from_config(self.config) if self.config else PRESETS[self.preset]
        return shape if self.layers is None else shape.truncated(self.layers)

    def specs(self) -> tuple[list[TensorSpec], list[TensorSpec]]:
        """(what the trainer holds, what the engine holds)."""
        trainer, engine = sides(self.shape, self.engine_dtype)
        dtype = dtype_from_name(self.dtype)
        return specs(trainer, dtype), specs(engine, dtype)

    def _check_engine_dtype(self) -> None:
        sides(self.shape, self.engine_dtype)
        if self.engine_dtype == FP8_ENGINE:
            other = [m for m in self.methods if m not in FP8_METHODS]
            if other:
                raise ValueError(f"with an FP8 engine the bench runs {', '.join(FP8_METHODS)}; drop {', '.join(other)}")
        elif "quantize" in self.methods:
            raise ValueError("the quantize method measures the trainer's FP8 quantizer: pass --engine-dtype fp8")


@dataclass(slots=True)
class Result:
    method: str
    nbytes: int
    times: list[float]
    stages: dict[str, float] = field(default_factory=dict)
    memory: dict[str, int | None] = field(default_factory=dict)
    floors: dict[str, float] = field(default_factory=dict)
    """Probes only: median seconds of a flat copy and a flat read of the same bytes on the same device."""
    wire_bytes: int | None = None
    """Bytes the method put on the data plane over all its transfers, warmup included (where it knows)."""
    link_bytes: int | None = None
    """Across a namespaced link: bytes the sender's veth sent while the method ran (headers and control too)."""
    delta_refits: int | None = None
    """Stepped refits: how many of the timed ones went as a delta."""

    @property
    def median(self) -> float:
        return statistics.median(self.times)

    def summary(self, floor: float | None) -> dict:
        med = self.median
        return {
            **asdict(self),
            "median_s": med,
            "min_s": min(self.times),
            "max_s": max(self.times),
            "gbps": self.nbytes / med / 1e9,
            "ratio_to_floor": med / floor if floor else None,
            **{f"ratio_to_{k}": med / v for k, v in self.floors.items()},
        }


class Workers:
    """Receiver processes, one per engine rank, fed jobs as JSON lines."""

    def __init__(self, spec_list: list[TensorSpec], devices: list[str], link: Link | None = None) -> None:
        """With `link`: each in the link's namespace b, listening on its address there."""
        env = {**os.environ, "PYTHONPATH": _pythonpath()}
        command = module_command("refit.tools.bench.worker")
        if link is not None:
            env["REFIT_HOST"], command = B_ADDR, link.command("b", command)
        payload = [[s.name, list(s.shape), dtype_name(s.dtype)] for s in spec_list]
        self.procs = [
            subprocess.Popen(
                command,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                env=env,
            )
            for _ in devices
        ]
        for p, d in zip(self.procs, devices):
            assert p.stdin is not None
            p.stdin.write(json.dumps({"specs": payload, "device": d}) + "\n")
            p.stdin.flush()
        for p in self.procs:
            self._read(p)

    def _read(self, p: subprocess.Popen) -> dict:
        assert p.stdout is not None
        for line in p.stdout:
            if line.startswith(MARK):
                return json.loads(line[len(MARK) :])
        raise RuntimeError(f"bench worker exited with {p.wait()}")

    def submit(self, job: dict, *, first_only: bool = False) -> None:
        for p in self.procs[:1] if first_only else self.procs:
            assert p.stdin is not None
            p.stdin.write(json.dumps(job) + "\n")
            p.stdin.flush()

    def replies(self, *, first_only: bool = False) -> list[dict]:
        return [self._read(p) for p in (self.procs[:1] if first_only else self.procs)]

    def close(self) -> None:
        for p in self.procs:
            assert p.stdin is not None
            p.stdin.close()
            p.wait(timeout=120)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], object], device: torch.device, cfg: BenchConfig) -> list[float]:
    times = []
    for i in range(cfg.warmup + cfg.repeats):
        _sync(device)
        t = time.perf_counter()
        fn()
        _sync(device)
        if i >= cfg.warmup:
            times.append(time.perf_counter() - t)
    return times


def session_settings(cfg: BenchConfig, bucket_bytes: int) -> Settings:
    """The Settings of the bench's Senders: its bucket and timeout, across a link its namespace's address; the
    rest from the environment."""
    if cfg.link_rate is not None:
        return Settings(bucket_bytes=bucket_bytes, timeout_s=cfg.timeout_s, host=A_ADDR)
    return Settings(bucket_bytes=bucket_bytes, timeout_s=cfg.timeout_s)


@contextlib.contextmanager
def _session(
    workers: Workers,
    source: ModuleSource,
    cfg: BenchConfig,
    device: torch.device,
    *,
    mode: str,
    bucket_bytes: int,
    num_slots: int,
    zero_copy: bool = False,
    verify_checksum: bool = False,
    verify: str | None = None,
    delta: bool = False,
    **job: object,
) -> Iterator[Sender]:
    settings = session_settings(cfg, bucket_bytes)
    sender = Sender(
        source,
        transport=cfg.transport,
        num_receivers=cfg.receivers,
        settings=settings,
        device=device,
        num_slots=num_slots,
        zero_copy=zero_copy,
        verify_checksum=verify_checksum,
        verify=verify,
        delta=delta,
    )
    workers.submit(
        {
            "mode": mode,
            "rendezvous": sender.rendezvous(),
            "bucket_bytes": bucket_bytes,
            "timeout_s": cfg.timeout_s,
            **job,
        }
    )
    try:
        sender.connect()
        yield sender
    finally:
        sender.close()


def _link_floor(workers: Workers, cfg: BenchConfig, nbytes: int) -> Result:
    """Across a namespaced link: a plain TCP send of the model's wire bytes from this namespace to a worker's,
    each timed until the worker has them all."""
    count = cfg.warmup + cfg.repeats
    with socket.create_server((A_ADDR, 0)) as listener:
        port = listener.getsockname()[1]
        job = {"mode": "tcp_floor", "host": A_ADDR, "port": port, "nbytes": nbytes, "count": count,
               "timeout_s": cfg.timeout_s}  # fmt: skip
        workers.submit(job, first_only=True)  # one receiver: the floor of one link
        times = send_floor(listener, nbytes, count, cfg.timeout_s)
        workers.replies(first_only=True)
    return Result("floor", nbytes, times[cfg.warmup :], wire_bytes=nbytes * count)


def _floor(workers: Workers, source: ModuleSource, cfg: BenchConfig, device: torch.device, nbytes: int) -> Result:
    """Colocated: one contiguous copy of the model's bytes. Disaggregated: the raw broadcast of one buffer.
    Across a namespaced link: a raw TCP transfer of the model's bytes across it."""
    if cfg.link_rate is not None:
        return _link_floor(workers, cfg, nbytes)
    if cfg.transport in COLOCATED:
        free_memory(device)
        chunk = floor_chunk(nbytes, torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None)
        src = torch.randint(0, 256, (chunk,), dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        times = _timed(partial(_copy_in_chunks, dst, src, nbytes), device, cfg)
        del src, dst
        _release(device)
        return Result("floor", nbytes, times)
    size = align_up(min(nbytes, 1 << 30), 256)
    count = 4
    with _session(
        workers,
        source,
        cfg,
        device,
        mode="floor",
        bucket_bytes=size,
        num_slots=1,
        nbytes=size,
        count=(cfg.warmup + cfg.repeats) * count,
        per=count,
    ) as sender:
        assert sender.transport is not None
        bw = []
        for i in range(cfg.warmup + cfg.repeats):
            _sync(device)
            t = time.perf_counter()
            for ch in sender.channels:  # the go: a receiver that read ahead would ACK before the clock starts
                ch.send(Header(Kind.BUCKET, nbytes=size))
            for _ in range(count):
                sender.transport.send(0, size).wait(300.0)
            for ch in sender.channels:  # a one-sided transport (nixl) moves the bytes in the receivers' READs
                ch.expect(Kind.ACK, "floor")
            _sync(device)
            if i >= cfg.warmup:
                bw.append(size * count / (time.perf_counter() - t))
    workers.replies()
    return Result("floor", nbytes, [nbytes / b for b in bw])


def floor_chunk(nbytes: int, free: int | None) -> int:
    """The colocated floor copies the model's bytes in chunks of this size: its two buffers (source and
    destination) take at most half of what is `free` beside the receivers' memory (None: no limit, one chunk)."""
    if free is None:
        return nbytes
    return min(nbytes, max(1 << 20, free // 4 // 256 * 256))


def _copy_in_chunks(dst: torch.Tensor, src: torch.Tensor, nbytes: int) -> None:
    """`nbytes` copied through buffers of `src.numel()` bytes: the same bytes moved as one flat copy."""
    for offset in range(0, nbytes, src.numel()):
        n = min(src.numel(), nbytes - offset)
        dst[:n].copy_(src[:n])


def _local_copy(
    method: str, tensors: dict[str, torch.Tensor], cfg: BenchConfig, device: torch.device, nbytes: int
) -> Result:
    """One copy of every tensor in this process: `_foreach_copy_`, or the batched copy kernel (checked bitwise)."""
    src = list(tensors.values())
    dst = [torch.empty_like(t) for t in src]
    if method == "foreach":
        times = _timed(partial(torch._foreach_copy_, dst, src), device, cfg)
    else:
        plan = BatchedCopy(dst, src)
        times = _timed(plan.run, device, cfg)
        bad = [n for n, d, s in zip(tensors, dst, src) if not torch.equal(d.view(torch.uint8), s.view(torch.uint8))]
        if bad:
            raise RuntimeError(f"the batched copy kernel wrote wrong bytes into {len(bad)} tensors, e.g. {bad[:3]}")
        del plan
    del dst
    _release(device)
    return Result(method, nbytes, times)


def _probe(
    method: str, tensors: dict[str, torch.Tensor], cfg: BenchConfig, device: torch.device, nbytes: int
) -> Result:
    """`digest`: the fingerprint's digest kernel alone over every tensor, planned once per epoch (host work
    included): on CUDA as zero-copy's sender takes it (`prepared`), on CPU the fused kernel without its copy
    (the kernel a verified refit's copies run; `digests`' PyTorch path only where it did not build), checked
    against `digests`; `copy_digest`: the fused copy and digest into fresh tensors as an engine's load takes it
    (checked: bytes and digests). Each beside a flat copy and a flat read (a sum of the bytes as int64 words)
    of as many bytes, on the same device."""
    src = list(tensors.values())
    if method == "digest":
        run = prepared(src) or prepared_digests(src) or partial(digests, src)
        times = _timed(run, device, cfg)
        if not torch.equal(run().cpu(), digests(src).cpu()):
            raise RuntimeError("the digest kernel alone gave other digests than `digests`")
    else:
        from refit.checks.copy_digest_cuda import copy_digest_cuda
        from refit.checks.copy_digest_cuda import prepared as prepared_copy

        dst = [torch.empty_like(t) for t in src]
        times = _timed(prepared_copy(dst, src) or partial(copy_digest_cuda, dst, src), device, cfg)
        got = copy_digest_cuda(dst, src)
        if not torch.equal(got, digests(dst)) or not all(torch.equal(d, s) for d, s in zip(dst, src)):
            raise RuntimeError("the fused copy and digest wrote other bytes or digests than a copy and a digest")
        del dst
    flat = torch.randint(0, 256, (align_up(nbytes, 8),), dtype=torch.uint8, device=device)
    out = torch.empty_like(flat)
    floors = {
        "copy_floor": statistics.median(_timed(partial(out.copy_, flat), device, cfg)),
        "read_floor": statistics.median(_timed(flat.view(torch.int64).sum, device, cfg)),
    }
    del flat, out
    _release(device)
    return Result(method, nbytes, times, floors=floors)


def free_memory(device: torch.device) -> None:
    """What a preset allocated, handed back once its references are dropped: cycles collected, and on CUDA the
    allocator's cached blocks returned, so that the next preset (and the receiver processes) can have them."""
    gc.collect()
    _release(device)


def _release(device: torch.device) -> None:
    """Hand cached blocks back, so the receiver processes on this device can have them."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _refit(
    workers: Workers,
    source: ModuleSource,
    cfg: BenchConfig,
    device: torch.device,
    *,
    num_slots: int,
    name: str,
    zero_copy: bool = False,
    verify_checksum: bool = False,
    verify: str | None,
) -> Result:
    """The full Sender/Receiver path; `num_slots=1` is the serial-buckets baseline. `verify` is always given:
    figures must not move with the library's default."""
    version = iter(range(1, 1 << 30))
    stats = []
    bucket_bytes = min(cfg.bucket_bytes, align_up(sum(s.nbytes for s in source.specs()), 256))
    probe = MemoryProbe(device)  # before the Sender, its buffers and its group exist
    with _session(
        workers,
        source,
        cfg,
        device,
        mode="refit",
        bucket_bytes=bucket_bytes,
        num_slots=num_slots,
        zero_copy=zero_copy,
        verify_checksum=verify_checksum,
        verify=verify,
        warmup=cfg.warmup,
    ) as sender:
        times = _timed(lambda: stats.append(sender.refit(next(version))), device, cfg)
        buffers = list(sender.transport.buffers) if sender.transport is not None else []
        sender_peak = probe.measured(buffers + sender.source.held_tensors())
        predicted = sender.predicted_memory()
        nbytes = sender.manifest.nbytes if sender.manifest else 0
    timed = stats[cfg.warmup :]
    stages = {k: statistics.median(s.seconds.get(k, 0.0) for s in timed) for k in SENDER_STAGES}
    replies = workers.replies()
    peaks = [r["peak_extra_bytes"] for r in replies]
    received = replies[0].get("stages", {})
    stages |= {f"recv.{k}": received[k] for k in RECEIVER_STAGES if k in received}
    memory = {
        "predicted_sender": predicted["sender"],
        "predicted_receiver": predicted["receiver"],
        "measured_sender": sender_peak,
        "measured_receiver": None if None in peaks else max(peaks),
    }
    return Result(name, nbytes, times, stages, memory, wire_bytes=sum(s.wire_bytes for s in stats))


def _stepped(
    workers: Workers, spec_list: list[TensorSpec], cfg: BenchConfig, device: torch.device, *, method: str
) -> Result:
    """Refits with the fingerprint on, each after one AdamW step (lr STEP_LR, WORST_LR for step_delta_worst;
    seeded gradients, untimed) on fp32 master weights drawn like a fresh LM's (std 0.02) and sent in each
    tensor's wire dtype; step_delta*: as deltas against the last commit, where the Sender finds they pay."""
    delta = method != "step_full"
    g = torch.Generator(device=device).manual_seed(1)
    masters = {
        s.name: (torch.randn(s.shape, generator=g, device=device) * 0.02).to(
            torch.float32 if s.dtype.is_floating_point and s.dtype.itemsize >= 2 else s.dtype
        )
        for s in spec_list
    }
    trained = [t for t in masters.values() if t.dtype == torch.float32]
    opt = torch.optim.AdamW(trained, lr=WORST_LR if method == "step_delta_worst" else STEP_LR)
    source = ModuleSource(masters, overrides={s.name: s.dtype for s in spec_list})
    bucket_bytes = min(cfg.bucket_bytes, align_up(sum(s.nbytes for s in spec_list), 256))
    stats, times = [], []
    with _session(workers, source, cfg, device, mode="refit", bucket_bytes=bucket_bytes, num_slots=2,
                  verify="fingerprint", delta=delta, warmup=cfg.warmup + 1) as sender:  # fmt: skip
        for version in range(1, cfg.warmup + cfg.repeats + 2):  # the first refit is full whatever `delta` says
            if version > 1:
                for t in trained:
                    t.grad = torch.randn(t.shape, generator=g, device=device)
                opt.step()
            _sync(device)
            start = time.perf_counter()
            stats.append(sender.refit(version))
            _sync(device)
            times.append(time.perf_counter() - start)
    replies = workers.replies()
    received = replies[0].get("stages", {})
    timed = stats[cfg.warmup + 1 :]
    stages = {k: statistics.median(s.seconds.get(k, 0.0) for s in timed) for k in SENDER_STAGES}
    stages |= {f"recv.{k}": received[k] for k in RECEIVER_STAGES if k in received}
    return Result(
        method,
        sum(s.nbytes for s in spec_list),
        times[cfg.warmup + 1 :],
        stages,
        wire_bytes=sum(s.wire_bytes for s in stats),
        delta_refits=sum(s.delta for s in timed),
    )


def _per_tensor(
    workers: Workers,
    source: ModuleSource,
    spec_list: list[TensorSpec],
    cfg: BenchConfig,
    device: torch.device,
    *,
    meta: bool,
) -> Result:
    """Baselines: one tensor per transfer; with `meta`, JSON metadata per tensor on every refit."""
    cap = align_up(max(s.nbytes for s in spec_list), 256)
    ordered = sorted(spec_list, key=lambda s: s.name)
    srcs = source.tensors([s.name for s in ordered])
    with _session(
        workers,
        source,
        cfg,
        device,
        mode="per_tensor",
        bucket_bytes=cap,
        num_slots=1,
        meta=meta,
        refits=cfg.warmup + cfg.repeats,
    ) as sender:
        tr = sender.transport
        assert tr is not None

        def one_refit() -> None:
            buf = tr.buffers[0]
            for spec, t in zip(ordered, srcs):
                tr.before_pack(0)
                buf[: spec.nbytes].view(spec.dtype).copy_(t.reshape(-1))
                tr.before_send(0)
                for ch in sender.channels:
                    if meta:
                        ch.send(
                            Header(Kind.MANIFEST),
                            {"name": spec.name, "shape": list(spec.shape), "dtype": dtype_name(spec.dtype)},
                        )
                    else:
                        ch.send(Header(Kind.BUCKET, nbytes=spec.nbytes))
                pending = tr.send(0, align_up(spec.nbytes, 256))
                pending.wait(300.0)
                if pending.ready:
                    for ch in sender.channels:
                        ch.expect(Kind.ACK, "per-tensor baseline")
            for ch in sender.channels:
                ch.expect(Kind.DONE, "per-tensor baseline")

        times = _timed(one_refit, device, cfg)
    workers.replies()
    return Result("per_tensor_meta" if meta else "per_tensor", sum(s.nbytes for s in spec_list), times)


def measure(cfg: BenchConfig, link: Link | None, on_method: Callable[[str], None] | None) -> dict[str, Result]:
    """Every method's Result, with receivers in `link`'s namespace b when given (this process in a)."""
    spec_list, engine_specs = cfg.specs()
    device, worker_devices = _devices(cfg)
    g = torch.Generator(device=device).manual_seed(0)
    tensors = {s.name: torch.randn(s.shape, generator=g, device=device).to(s.dtype) for s in spec_list}
    source = ModuleSource(tensors)
    nbytes = sum(s.nbytes for s in engine_specs)  # the wire's bytes: what the engine holds
    results: dict[str, Result] = {}
    workers = Workers(engine_specs, worker_devices, link)
    try:
        _methods(cfg, link, on_method, (workers, source, tensors, spec_list, engine_specs), device, results, nbytes)
    finally:
        workers.close()
        del tensors, source  # this preset's weights, gone before the next preset allocates its own
        free_memory(device)
    return results


def _methods(  # type: ignore[no-untyped-def]
    cfg: BenchConfig, link: Link | None, on_method, held: tuple, device: torch.device, results: dict, nbytes: int
) -> None:
    """`measure`'s loop over the methods, into `results`. `held`: workers, source, tensors, specs, engine specs."""
    workers, source, tensors, spec_list, engine_specs = held
    for m in cfg.methods:
        if on_method:
            on_method(m)
        before = link.bytes_a_to_b() if link else 0
        if m == "quantize":
            times, moved, floors = measured(tensors, engine_specs, lambda fn: _timed(fn, device, cfg))
            _release(device)
            result = Result(m, moved, times, floors=floors)
        else:
            result = _method(m, workers, source, tensors, spec_list, cfg, device, nbytes)
        if result is not None:
            result.link_bytes = link.bytes_a_to_b() - before if link else None
            results[m] = result


def measured_inside(cfg: BenchConfig, link: Link, on_method: Callable[[str], None] | None) -> dict[str, Result]:
    """`measure` run by a child process inside the link's namespace a (as `ip netns exec` starts it: its own
    view of the network devices in /sys, which a thread that only switched namespaces lacks)."""
    job = json.dumps({"config": {**asdict(cfg), "methods": list(cfg.methods)}, "tag": link.tag, "rate": link.rate})
    env = {**os.environ, **{k: v for k, v in NET_ONLY.items() if k not in os.environ}, "PYTHONPATH": _pythonpath()}
    argv = link.command("a", [*module_command("refit.tools.bench.inside"), job])
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None
    results: dict[str, Result] = {}
    for line in proc.stdout:
        if line.startswith(INSIDE_MARK):
            event = json.loads(line[len(INSIDE_MARK) :])
            if "method" in event and on_method:
                on_method(event["method"])
            for name, r in event.get("results", {}).items():
                results[name] = Result(**r)
            if "error" in event:
                raise ValueError(event["error"])
    if proc.wait() != 0:
        how = f"was killed by signal {-proc.returncode}" if proc.returncode < 0 else f"exited with {proc.returncode}"
        hint = " (9: out of memory?)" if proc.returncode == -9 else ""
        raise RefitError(f"the bench's measuring process inside the link's namespace {how}{hint}; see its output above")
    return results


INSIDE_MARK = "@@inside "


def _pythonpath() -> str:
    return os.pathsep.join(
        filter(None, [os.path.dirname(os.path.dirname(refit.__file__)), os.environ.get("PYTHONPATH")])
    )


def _method(
    m: str,
    workers: Workers,
    source: ModuleSource,
    tensors: dict[str, torch.Tensor],
    spec_list: list[TensorSpec],
    cfg: BenchConfig,
    device: torch.device,
    nbytes: int,
) -> Result | None:
    """One method's figures, or None where it does not apply to this transport or device."""
    refit_ = partial(_refit, workers, source, cfg, device, num_slots=2, name=m)
    if m not in applicable(cfg.transport, device):
        return None
    if m == "floor":
        return _floor(workers, source, cfg, device, nbytes)
    if m in LOCAL:
        return _local_copy(m, tensors, cfg, device, nbytes)
    if m in PROBES:
        return _probe(m, tensors, cfg, device, nbytes)
    if m in ("refit", "serial"):
        return refit_(num_slots=2 if m == "refit" else 1, verify=None)
    if m == "checksum":
        return refit_(verify_checksum=True, verify=None)
    if m == "fingerprint":  # the end-to-end check of what the engine holds
        return refit_(verify="fingerprint")
    if m.startswith("zero_copy"):
        verify = "fingerprint" if m == "zero_copy_fingerprint" else None
        return refit_(zero_copy=True, verify=verify)
    if m in STEPPED:
        return _stepped(workers, spec_list, cfg, device, method=m)
    return _per_tensor(workers, source, spec_list, cfg, device, meta=m == "per_tensor_meta")


def _devices(cfg: BenchConfig) -> tuple[torch.device, list[str]]:
    device = bench_device(cfg.transport)
    if device.type == "cpu":
        return device, ["cpu"] * cfg.receivers
    n = torch.cuda.device_count()
    if cfg.transport == "cuda-ipc" or cfg.transport in EITHER_MEMORY:
        return device, ["cuda:0"] * cfg.receivers
    if n < 2:
        raise ValueError("the nccl bench needs at least 2 GPUs (sender on cuda:0, receivers on the others)")
    return torch.device("cuda:0"), [f"cuda:{1 + r % (n - 1)}" for r in range(cfg.receivers)]


def run_bench(cfg: BenchConfig, on_method: Callable[[str], None] | None = None) -> dict:
    """Measure every method in `cfg.methods` on one link; returns a JSON-able report. `on_method(name)` is
    called as each method starts (the CLI's progress). With `cfg.link_rate`, across a namespaced link that
    exists only while it runs: the measuring process then runs inside the trainer's namespace
    (`refit.tools.bench.inside`), so that every library in it (UCX too) sees that namespace's devices."""
    spec_list, engine_specs = cfg.specs()
    device, _ = _devices(cfg)
    nbytes = sum(s.nbytes for s in engine_specs)
    if cfg.link_rate is None:
        results = measure(cfg, None, on_method)
    else:
        with Link(rate=cfg.link_rate) as link:
            results = measured_inside(cfg, link, on_method)
    floor = results["floor"].median if "floor" in results else None
    summaries = {k: r.summary(floor) for k, r in results.items()}
    bits = rate_bits(cfg.link_rate) if cfg.link_rate is not None else 0
    for k, r in results.items() if bits else ():  # a delta moves less than the model's bytes: no share of the rate
        summaries[k]["link_fraction"] = None if k.startswith("step_delta") else r.nbytes * 8 / r.median / bits
    for verified, plain in VERIFIED.items():
        if verified in results and plain in results:
            summaries[verified]["ratio_to_unverified"] = results[verified].median / results[plain].median
    return {
        "config": {**asdict(cfg), "methods": list(cfg.methods)},
        "tensors": len(spec_list),
        "nbytes": nbytes,
        "dtypes": sorted({dtype_name(s.dtype) for s in spec_list}),
        "engine_dtypes": sorted({dtype_name(s.dtype) for s in engine_specs}),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "cpu_kernel": device.type == "cpu" and kernel_built(),  # the notes under the table explain figures by it
        "results": summaries,
        "link": None if cfg.link_rate is None else {"rate": cfg.link_rate, "rate_bits": rate_bits(cfg.link_rate)},
    }
