"""The floors: one flat copy of the model's bytes, a raw broadcast or a TCP send across a link; the local copies and
the digest probes measured beside them."""

from __future__ import annotations

import socket
import statistics
import time
from functools import partial

import torch

from refit.checks.copy_digest import prepared_digests
from refit.checks.tensor_digest import digests, prepared
from refit.layout.copy_kernel import BatchedCopy
from refit.layout.planner import align_up
from refit.protocol.wire import Header, Kind
from refit.sources.module import ModuleSource
from refit.tools.bench.config import COLOCATED, BenchConfig
from refit.tools.bench.harness import Result, Workers, free_memory, release, session, sync, time_runs
from refit.tools.bench.link import A_ADDR, send_floor


def link_floor(workers: Workers, cfg: BenchConfig, nbytes: int) -> Result:
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


def measure_floor(
    workers: Workers, source: ModuleSource, cfg: BenchConfig, device: torch.device, nbytes: int
) -> Result:
    """Colocated: one contiguous copy of the model's bytes. Disaggregated: the raw broadcast of one buffer.
    Across a namespaced link: a raw TCP transfer of the model's bytes across it."""
    if cfg.link_rate is not None:
        return link_floor(workers, cfg, nbytes)
    if cfg.transport in COLOCATED:
        free_memory(device)
        chunk = floor_chunk(nbytes, torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None)
        src = torch.randint(0, 256, (chunk,), dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        times = time_runs(partial(copy_in_chunks, dst, src, nbytes), device, cfg)
        del src, dst
        release(device)
        return Result("floor", nbytes, times)
    size = align_up(min(nbytes, 1 << 30), 256)
    count = 4
    with session(
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
            sync(device)
            t = time.perf_counter()
            for ch in sender.channels:  # the go: a receiver that read ahead would ACK before the clock starts
                ch.send(Header(Kind.BUCKET, nbytes=size))
            for _ in range(count):
                sender.transport.send(0, size).wait(300.0)
            for ch in sender.channels:  # a one-sided transport (nixl) moves the bytes in the receivers' READs
                ch.expect(Kind.ACK, "floor")
            sync(device)
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


def copy_in_chunks(dst: torch.Tensor, src: torch.Tensor, nbytes: int) -> None:
    """`nbytes` copied through buffers of `src.numel()` bytes: the same bytes moved as one flat copy."""
    for offset in range(0, nbytes, src.numel()):
        n = min(src.numel(), nbytes - offset)
        dst[:n].copy_(src[:n])


def local_copy(
    method: str, tensors: dict[str, torch.Tensor], cfg: BenchConfig, device: torch.device, nbytes: int
) -> Result:
    """One copy of every tensor in this process: `_foreach_copy_`, or the batched copy kernel (checked bitwise)."""
    src = list(tensors.values())
    dst = [torch.empty_like(t) for t in src]
    if method == "foreach":
        times = time_runs(partial(torch._foreach_copy_, dst, src), device, cfg)
    else:
        plan = BatchedCopy(dst, src)
        times = time_runs(plan.run, device, cfg)
        bad = [n for n, d, s in zip(tensors, dst, src) if not torch.equal(d.view(torch.uint8), s.view(torch.uint8))]
        if bad:
            raise RuntimeError(f"the batched copy kernel wrote wrong bytes into {len(bad)} tensors, e.g. {bad[:3]}")
        del plan
    del dst
    release(device)
    return Result(method, nbytes, times)


def probe(method: str, tensors: dict[str, torch.Tensor], cfg: BenchConfig, device: torch.device, nbytes: int) -> Result:
    """`digest`: the fingerprint's digest kernel alone over every tensor, planned once per epoch (host work
    included): on CUDA as zero-copy's sender takes it (`prepared`), on CPU the fused kernel without its copy
    (the kernel a verified refit's copies run; `digests`' PyTorch path only where it did not build), checked
    against `digests`; `copy_digest`: the fused copy and digest into fresh tensors as an engine's load takes it
    (checked: bytes and digests). Each beside a flat copy and a flat read (a sum of the bytes as int64 words)
    of as many bytes, on the same device."""
    src = list(tensors.values())
    if method == "digest":
        run = prepared(src) or prepared_digests(src) or partial(digests, src)
        times = time_runs(run, device, cfg)
        if not torch.equal(run().cpu(), digests(src).cpu()):
            raise RuntimeError("the digest kernel alone gave other digests than `digests`")
    else:
        from refit.checks.copy_digest_cuda import copy_digest_cuda
        from refit.checks.copy_digest_cuda import prepared as prepared_copy

        dst = [torch.empty_like(t) for t in src]
        times = time_runs(prepared_copy(dst, src) or partial(copy_digest_cuda, dst, src), device, cfg)
        got = copy_digest_cuda(dst, src)
        if not torch.equal(got, digests(dst)) or not all(torch.equal(d, s) for d, s in zip(dst, src)):
            raise RuntimeError("the fused copy and digest wrote other bytes or digests than a copy and a digest")
        del dst
    flat = torch.randint(0, 256, (align_up(nbytes, 8),), dtype=torch.uint8, device=device)
    out = torch.empty_like(flat)
    floors = {
        "copy_floor": statistics.median(time_runs(partial(out.copy_, flat), device, cfg)),
        "read_floor": statistics.median(time_runs(flat.view(torch.int64).sum, device, cfg)),
    }
    del flat, out
    release(device)
    return Result(method, nbytes, times, floors=floors)
