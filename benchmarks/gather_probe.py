"""Where the per-rank colocated refit's time goes on N GPUs: the all-gather alone, in the shapes refit uses.

Every line is timed in one run, medians of `--repeats`, each with the same bytes (a model preset's
dim-0 shards, bucketed as refit buckets them):
- flat: one all-gather of the whole model as one flat buffer (the floor's all-gather);
- flat per bucket: one flat all-gather per bucket, the CPU waiting for each;
- per-tensor per bucket: one coalesced all-gather per bucket, every tensor gathered straight into
  its place in the bucket buffer (what RankedRefit issues), the CPU waiting for each;
- the same with a concurrent device copy of the previous bucket on a side stream (the engine
  worker's unpack, which shares the GPU's memory bandwidth).

    torchrun --nproc-per-node 2 benchmarks/gather_probe.py --preset qwen2-7b
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from refit.layout.packing import typed_view
from refit.layout.planner import plan
from refit.tools.bench.presets import PRESETS, specs


def _timed(fn: Callable[[], None], repeats: int) -> float:
    times = []
    for i in range(repeats + 1):
        torch.cuda.synchronize()
        dist.barrier()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        if i:
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen2-7b")
    ap.add_argument("--bucket-bytes", type=int, default=1 << 30)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    spec_list = [s for s in specs(PRESETS[args.preset], torch.bfloat16) if s.shape and s.shape[0] % world == 0]
    m = plan(spec_list, capacity=args.bucket_bytes)
    nbytes = sum(s.nbytes for s in spec_list)
    shards = {s.name: torch.randn((s.shape[0] // world, *s.shape[1:]), device=dev).to(s.dtype) for s in spec_list}
    bufs = [torch.empty(args.bucket_bytes, dtype=torch.uint8, device=dev) for _ in range(2)]
    dst = torch.empty(args.bucket_bytes, dtype=torch.uint8, device=dev)
    flat_in = torch.empty(-(-nbytes // world), dtype=torch.uint8, device=dev)
    flat_out = torch.empty(flat_in.numel() * world, dtype=torch.uint8, device=dev)
    per_bucket = []
    for b, segs in enumerate(m.segments):
        outs, ins = [], []
        for seg in segs:
            e = m.entries[seg.entry]
            if seg.lo != 0 or seg.hi != e.spec.nbytes:
                continue
            outs.append(typed_view(bufs[b % 2], seg.at, e.spec.nbytes, e.spec.dtype))
            ins.append(shards[e.name].view(-1))
        if outs:
            per_bucket.append((outs, ins, m.bucket_nbytes[b]))
    pg = dist.distributed_c10d._get_default_group()
    side = torch.cuda.Stream()

    def coalesced(copy: bool) -> None:
        for b, (outs, ins, n) in enumerate(per_bucket):
            pg.allgather_into_tensor_coalesced(outs, ins).wait()
            if copy:
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    dst[:n].copy_(bufs[b % 2][:n])
            torch.cuda.current_stream().synchronize()
        side.synchronize()

    def flat_buckets() -> None:
        for _, _, n in per_bucket:
            k = -(-n // world)
            dist.all_gather_into_tensor(bufs[0][: k * world], flat_in[:k])
            torch.cuda.current_stream().synchronize()

    lines = {
        "flat (whole model)": _timed(lambda: dist.all_gather_into_tensor(flat_out, flat_in), args.repeats),
        "flat per bucket": _timed(flat_buckets, args.repeats),
        "per-tensor per bucket": _timed(lambda: coalesced(False), args.repeats),
        "per-tensor per bucket + side copy": _timed(lambda: coalesced(True), args.repeats),
    }
    if rank == 0:
        print(f"{args.preset}: {nbytes / 1e9:.3f} GB, {len(spec_list)} tensors, {m.num_buckets} buckets, {world} ranks")
        for k, v in lines.items():
            print(f"  {k:38s} {v * 1e3:8.2f} ms  {nbytes / v / 1e9:7.1f} GB/s  {v / lines['flat (whole model)']:.2f}x")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
