"""The refit methods: a Sender's refit (plain, verified, zero-copy), the optimizer-stepped ones (full and delta) and
the per-tensor baselines."""

from __future__ import annotations

import statistics
import time

import torch

from refit.dtypes import dtype_name
from refit.layout.planner import align_up
from refit.layout.spec import TensorSpec
from refit.protocol.wire import Header, Kind
from refit.sources.module import ModuleSource
from refit.tools.bench.config import RECEIVER_STAGES, SENDER_STAGES, STEP_LR, WORST_LR, BenchConfig
from refit.tools.bench.harness import Result, Workers, session, sync, time_runs
from refit.tools.bench.memory import MemoryProbe


def refit_method(
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
    with session(
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
        times = time_runs(lambda: stats.append(sender.refit(next(version))), device, cfg)
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


def stepped(
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
    with session(workers, source, cfg, device, mode="refit", bucket_bytes=bucket_bytes, num_slots=2,
                  verify="fingerprint", delta=delta, warmup=cfg.warmup + 1) as sender:  # fmt: skip
        for version in range(1, cfg.warmup + cfg.repeats + 2):  # the first refit is full whatever `delta` says
            if version > 1:
                for t in trained:
                    t.grad = torch.randn(t.shape, generator=g, device=device)
                opt.step()
            sync(device)
            start = time.perf_counter()
            stats.append(sender.refit(version))
            sync(device)
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


def per_tensor(
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
    with session(
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

        times = time_runs(one_refit, device, cfg)
    workers.replies()
    return Result("per_tensor_meta" if meta else "per_tensor", sum(s.nbytes for s in spec_list), times)
