"""Command line: `refit demo`, `refit bench`, `refit plan`."""

from __future__ import annotations

import argparse
import os
import sys

from rich.console import Console


def _demo(args: argparse.Namespace, console: Console) -> int:
    from refit.demo.run import DemoConfig, run

    ok = True
    for transport in args.transport.split(","):
        cfg = DemoConfig(transport=transport.strip(), engine=args.engine, trainer=args.trainer, ranks=args.ranks,
                         steps=args.steps, dtype_change_at=args.dtype_change_at,
                         bucket_bytes=args.bucket_bytes, layers=args.layers, hidden=args.hidden)  # fmt: skip
        if cfg.trainer == "fsdp":
            from refit.demo.sharded import launch

            sys.stdout.flush()
            ok &= launch(cfg)
        else:
            ok &= run(cfg, console)
    return 0 if ok else 1


def _bench(args: argparse.Namespace, console: Console) -> int:
    from refit.bench.report import plot, show, write_json
    from refit.bench.runner import METHODS, BenchConfig, run_bench

    presets = ["tiny", "moe-small"] if args.quick else args.preset.split(",")
    receivers = [int(r) for r in args.receivers.split(",")]
    reports = []
    for preset in presets:
        for n in receivers:
            cfg = BenchConfig(preset=preset, config=args.config, dtype=args.dtype, transport=args.transport or "",
                              receivers=n, repeats=3 if args.quick else args.repeats, warmup=args.warmup,
                              bucket_bytes=args.bucket_bytes, methods=tuple(args.methods.split(",")) if args.methods else METHODS)  # fmt: skip
            reports.append(run_bench(cfg))
            show(reports[-1:], console)
    if args.json:
        write_json(reports, args.json)
    if args.plot:
        plot(reports, args.plot)
    return 0


def _plan(args: argparse.Namespace, console: Console) -> int:
    from refit.bench.presets import PRESETS, from_config, specs
    from refit.budget import NUM_SLOTS, bucket_capacity, free_bytes
    from refit.planner import forecast, plan
    from refit.settings import Settings
    from refit.spec import dtype_from_name

    import torch

    shape = from_config(args.config) if args.config else PRESETS[args.preset]
    spec_list = specs(shape, dtype_from_name(args.dtype))
    settings = Settings(ratio=args.ratio) if args.ratio else Settings()
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    cap = bucket_capacity(bucket_bytes=args.bucket_bytes or settings.bucket_bytes, ratio=settings.ratio,
                          free=free_bytes(device))  # fmt: skip
    m = plan(spec_list, capacity=cap)
    f = forecast(m, num_slots=NUM_SLOTS)
    dtypes: dict[str, int] = {}
    for s in spec_list:
        dtypes[str(s.dtype).removeprefix("torch.")] = dtypes.get(str(s.dtype).removeprefix("torch."), 0) + 1
    console.print(f"model: {args.config or args.preset}: {len(spec_list)} tensors, {m.nbytes / 1e9:.3f} GB; dtypes {dtypes}")
    console.print(f"buckets: {m.num_buckets} of capacity {cap / 2**20:.1f} MiB (free {device.type} memory "
                  f"{free_bytes(device) / 2**30:.1f} GiB, ratio {settings.ratio}); largest tensor "
                  f"{max(s.nbytes for s in spec_list) / 2**20:.1f} MiB, spanning buckets: {m.max_split_nbytes > 0}")  # fmt: skip
    console.print(f"predicted peak extra memory: sender {f.sender_bytes / 2**20:.1f} MiB, "
                  f"each receiver {f.receiver_bytes / 2**20:.1f} MiB")  # fmt: skip
    console.print(f"manifest digest {m.digest.hex()}, JSON {len(m.to_json())} bytes (sent once per epoch); "
                  f"per refit {64 * (3 + 2 * m.num_buckets)} control bytes per receiver")  # fmt: skip
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="refit", description="Move trained weights into a running inference engine.")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train a small LM and refit it into an engine process, verifying every refit")
    demo.add_argument("--transport", default="shm,gloo", help="comma-separated: shm, gloo (default: both)")
    demo.add_argument("--engine", default="module", choices=["module", "vllm"],
                      help="module: a transformers model in an engine process; vllm: vLLM from dummy weights")
    demo.add_argument("--trainer", default="plain", choices=["plain", "fsdp"],
                      help="plain: one trainer process; fsdp: the model sharded with FSDP2 over --ranks processes")
    demo.add_argument("--ranks", type=int, default=2, help="trainer ranks for --trainer fsdp")
    demo.add_argument("--steps", type=int, default=4, help="optimizer steps, each followed by a refit")
    demo.add_argument("--dtype-change-at", type=int, default=2, help="step after which one tensor goes fp32 (-1: never)")
    demo.add_argument("--bucket-bytes", type=int, default=8 << 20, help="bucket capacity in bytes")
    demo.add_argument("--layers", type=int, default=8)
    demo.add_argument("--hidden", type=int, default=512)
    demo.set_defaults(func=_demo)

    bench = sub.add_parser("bench", help="measure the floor, refit and baselines on one link, side by side")
    bench.add_argument("--preset", default="qwen2-0.5b", help="comma-separated: tiny, qwen2-0.5b, qwen2-7b, moe, moe-small")
    bench.add_argument("--config", help="a transformers config.json to take the shapes from")
    bench.add_argument("--dtype", default="bfloat16")
    bench.add_argument("--transport", help="shm, gloo, cuda-ipc, nccl (default: cuda-ipc with CUDA, else shm)")
    bench.add_argument("--receivers", default="1", help="comma-separated receiver counts, e.g. 1,2,4")
    bench.add_argument("--repeats", type=int, default=5)
    bench.add_argument("--warmup", type=int, default=1)
    bench.add_argument("--bucket-bytes", type=int, default=1 << 30)
    bench.add_argument("--methods", help="comma-separated subset of floor,refit,serial,per_tensor,per_tensor_meta")
    bench.add_argument("--quick", action="store_true", help="tiny and moe-small presets, 3 repeats (under a minute)")
    bench.add_argument("--json", help="write the results to this JSON file")
    bench.add_argument("--plot", help="write a PNG of time vs size and vs receivers")
    bench.set_defaults(func=_bench)

    planp = sub.add_parser("plan", help="show the manifest and predicted memory for a model before a run")
    planp.add_argument("--preset", default="qwen2-7b")
    planp.add_argument("--config")
    planp.add_argument("--dtype", default="bfloat16")
    planp.add_argument("--ratio", type=float, help="fraction of free memory for the buffers (default 0.2)")
    planp.add_argument("--bucket-bytes", type=int)
    planp.set_defaults(func=_plan)
    return parser


def _quiet_threads() -> None:
    """Trainer and engine processes share the cores; spinning OpenMP workers would steal them from the peer.
    Must run before torch is imported (OpenMP reads these once); explicit settings win."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.environ.setdefault("KMP_BLOCKTIME", "0")


def main(argv: list[str] | None = None) -> int:
    _quiet_threads()
    args = build_parser().parse_args(argv)
    console = Console(width=None if sys.stdout.isatty() else 120)
    try:
        return args.func(args, console)
    except ValueError as e:
        console.print(f"[red]error:[/] {e}")
        return 2


if __name__ == "__main__":
    sys.exit(main())
