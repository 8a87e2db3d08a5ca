"""The demo's run: real optimizer steps on a small LM, a refit after each, every refit checked and reported."""

from __future__ import annotations

import json
import sys
import tempfile
import time
from dataclasses import dataclass, field

import torch
from rich.console import Console
from rich.markup import escape

from refit.checks.canary import Canary, causal_lm
from refit.checks.fingerprints import differences, fingerprints
from refit.errors import RefitError
from refit.log import configure, get_logger
from refit.tools.console import console_on, progress, progress_console
from refit.tools.demo.config import DemoConfig as DemoConfig
from refit.tools.demo.config import model_size, session_settings
from refit.tools.demo.engines import EngineNotJoined as EngineNotJoined
from refit.tools.demo.engines import EngineProcess, VllmSide, spawn_engine, wire_dtypes
from refit.tools.demo.fp8 import ENGINE_DTYPES, as_held, quantize_linears, refresh
from refit.tools.demo.kernels import prebuild
from refit.tools.demo.lora import reference_greedy, targets, wrap
from refit.tools.demo.model import PROMPTS, TEXT, build_model, build_tokenizer, model_config
from refit.tools.demo.table import TRAINER_STAGES, delta_lines, demo_table, legends, print_wrapped
from refit.tools.demo.trainers import make_trainer
from refit.topology.mesh import MeshRefit
from refit.topology.sender import Sender
from refit.topology.stats import RefitStats

log = get_logger("demo")

KEEP_FP32 = "model.norm.weight"
"""The tensor whose wire dtype switches from bf16 to fp32 partway (the seed's e_score_correction_bias case)."""


@dataclass(slots=True)
class Row:
    engine: dict
    params_ok: bool
    generate_ok: bool
    problems: list[str] = field(default_factory=list)


def _wire(sender) -> dict[str, torch.dtype]:  # type: ignore[no-untyped-def]
    if getattr(sender, "manifest", None) is None:
        return wire_dtypes(sender.source)
    return {n: p.spec.dtype for p in sender.manifest.entries for n in p.spec.names}


def _expected_generation(
    weights: dict[str, torch.Tensor], reference: torch.nn.Module, sender: Sender, prompts: list
) -> list[list[int]]:
    """The trainer's own greedy output from the weights as sent (run while the engine generates its own)."""
    wire = _wire(sender)
    with torch.no_grad():
        for name, t in targets(reference).items():
            t.copy_(weights[name].to(wire[name]))
    refresh(reference)
    return reference_greedy(reference, prompts)


def _check(weights: dict[str, torch.Tensor], sender: Sender, expected: list[list[int]], report: dict) -> Row:
    """Compare the engine's report with what the trainer sent and with the trainer's own generation."""
    sent = report.get("expected") or fingerprints(weights.items(), _wire(sender))
    diffs = differences(sent, report["fingerprints"])
    problems = [f"{len(diffs)} parameter(s) differ from what was sent: {diffs[:5]}"] if diffs else []
    gen_ok = report["generated"] == expected
    if not gen_ok:
        problems.append(f"generation differs: engine {report['generated']} vs trainer {expected}")
    return Row(report, not diffs, gen_ok, problems)


def demo_model(cfg: DemoConfig) -> tuple[dict, torch.nn.Module, object, torch.Tensor, list[list[int]]]:
    """The demo's model size, trainer model, tokenizer, training ids and prompts (same on every rank)."""
    tok = build_tokenizer()
    mcfg = model_size(cfg)
    ids = torch.tensor([tok(TEXT)["input_ids"][:256]])
    return mcfg, build_model(model_config(**mcfg), seed=0), tok, ids, [tok(p)["input_ids"] for p in PROMPTS]


def run(cfg: DemoConfig, console: Console, trainer=None, engine: EngineProcess | None = None) -> bool:
    """Run the demo over one transport; True when every refit verified. `trainer` defaults to a
    PlainTrainer; the sharded demo passes rank 0's FSDP trainer. `engine`: an engine process
    (`spawn_engine`) to serve this run's session and stay up for the next; by default one is started
    here (before the trainer's model is built, so the two start up side by side) and ended with the run."""
    configure(cfg.verbosity)
    console = _console(console, cfg)
    own = engine is None and cfg.engine == "module"
    if own:
        engine = spawn_engine(cfg)
    try:
        return _run(cfg, console, trainer, engine)
    finally:
        if own and engine is not None:
            engine.close()


def _run(cfg: DemoConfig, console: Console, trainer, process: EngineProcess | None) -> bool:
    with progress_console(quiet=cfg.verbosity < 0).status("building the demo model and tokenizer"):
        mcfg, model, tok, ids, prompts = demo_model(cfg)
        trainer = trainer or make_trainer(cfg, model, ids)
        reference = build_model(model_config(**mcfg), seed=0)
        quantized = quantize_linears(reference, cfg.engine_dtype)
        if cfg.lora:
            reference = wrap(reference, cfg.lora).eval()
    source = trainer.source
    # What vLLM's checkpoint (config, tokenizer; dummy weights) is saved from: never a sharded model.
    model = getattr(trainer, "hf_model", None) or (reference if cfg.trainer == "fsdp" else trainer.model)
    nparams = getattr(trainer, "num_params", None) or sum(p.numel() for p in model.parameters())
    sent = (
        f"a rank-{cfg.lora} LoRA adapter on every linear layer trained and sent alone (fp32 as bf16; the engine "
        "holds the base)"
        if cfg.lora
        else f"fp32 master weights sent as {_sent_as(cfg)}"
    )
    console.print(
        f"[bold]refit demo[/] over [cyan]{cfg.transport}[/] into a [cyan]{cfg.engine}[/] engine: Llama-style "
        f"LM, {nparams / 1e6:.1f}M params, {sent}, {_plural(cfg.steps, 'step')}{_sharding(cfg)}"
    )
    prebuild(console)
    settings = session_settings(cfg)
    canary = Canary(prompts[0], causal_lm(trainer.model), every=cfg.canary) if cfg.canary else None
    # every refit ends with the engine's digests checked against the trainer's live tensors
    sender = (
        MeshRefit(
            source,
            num_workers=cfg.engine_tp,
            transport=cfg.transport,
            settings=settings,
            verify="fingerprint",
            delta=cfg.delta,
        )
        if cfg.mesh
        else Sender(
            source,
            transport=cfg.transport,
            settings=settings,
            verify="fingerprint",
            delta=cfg.delta,
            canary=canary if cfg.engine == "module" else None,
        )
    )
    with tempfile.TemporaryDirectory() as workdir:
        engine = _start_engine(cfg, console, sender, (model, tok, prompts, canary), workdir, process)
        try:
            ok, rows = _loop(cfg, console, trainer, engine, (reference, quantized), prompts)
        finally:
            engine.end_session() if isinstance(engine, EngineProcess) else engine.close()
    mem = sender.predicted_memory() if getattr(sender, "manifest", None) else {}
    _show(cfg, console, rows, mem, ok)
    if cfg.json_path:
        result = {"transport": cfg.transport, "engine": cfg.engine, "trainer": cfg.trainer, "params": nparams}
        with open(cfg.json_path, "w") as f:
            json.dump({**result, "ok": ok, "refits": rows, "predicted_memory": mem}, f)
    return ok


def _sent_as(cfg: DemoConfig) -> str:
    if cfg.engine_dtype in ENGINE_DTYPES:
        return f"{ENGINE_DTYPES[cfg.engine_dtype].sent_as} for the decoder's linears and bf16 for the rest"
    return "bf16"


def _legend(cfg: DemoConfig) -> str:
    return ENGINE_DTYPES[cfg.engine_dtype].legend if cfg.engine_dtype in ENGINE_DTYPES else ""


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _sharding(cfg: DemoConfig) -> str:
    if cfg.trainer == "fsdp":
        return f", trainer sharded with FSDP2 over {cfg.ranks} ranks"
    if cfg.trainer == "megatron":
        return f", trainer a megatron-core GPTModel with TP={cfg.tp} x PP={cfg.pp} (sent under HF names)"
    return ""


def _console(console: Console, cfg: DemoConfig) -> Console:
    """Human output never wraps in a pipe or a file, goes to stderr when stdout carries JSON, and is
    silent with -q (errors only)."""
    stream = sys.stderr if cfg.to_stderr else console.file
    if stream is console.file and console.is_terminal and console.quiet == (cfg.verbosity < 0):
        return console
    return console_on(stream, quiet=cfg.verbosity < 0)


def _start_engine(
    cfg: DemoConfig, console: Console, sender: Sender, trained: tuple, workdir: str, process: EngineProcess | None
) -> EngineProcess | VllmSide:
    """The engine for `sender`: vLLM started now, or the engine process (already started) told where to
    connect. `trained`: the trainer's model, tokenizer, prompts and canary (vLLM's driver runs it)."""
    model, tok, prompts, canary = trained
    if process is None:
        t0 = time.perf_counter()
        status = progress_console(quiet=cfg.verbosity < 0).status
        with status("starting vLLM from dummy weights (a minute or two on CPU; -v shows its logs)"):
            engine: EngineProcess | VllmSide = VllmSide(
                sender, model, tok, prompts, workdir, tp=cfg.engine_tp, canary=canary
            )
        log.info("vLLM started in %.1f s", time.perf_counter() - t0)
        return engine
    process.attach(sender, {"rendezvous": sender.rendezvous(), "prompts": prompts})
    return process


def _loop(
    cfg: DemoConfig,
    console: Console,
    trainer,
    engine: EngineProcess | VllmSide,
    reference: tuple[torch.nn.Module, list[str]],
    prompts: list,
) -> tuple[bool, list[dict]]:
    """Train, refit and check `cfg.steps` times: whether all verified, and one row per refit. `reference`: the
    trainer's reference model and the names it holds quantized (as the engine does)."""
    ok, rows = True, []
    with progress(quiet=cfg.verbosity < 0) as bar:
        task = bar.add_task("", total=cfg.steps)
        for step in range(1, cfg.steps + 1):
            bar.update(task, description=f"step {step}: training")
            loss = trainer.step()
            if step == cfg.dtype_change_at + 1 and not cfg.lora:  # a LoRA source has no KEEP_FP32
                trainer.source.set_wire_dtype(KEEP_FP32, torch.float32)
            first = " (the engine connects first)" if step == 1 else ""
            bar.update(task, description=f"step {step}: refitting{first}")
            stats = trainer.refit(engine, step)
            bar.update(task, description=f"step {step}: checking the engine's weights and generation")
            weights = as_held(trainer.full_weights(), reference[1], cfg.engine_dtype)  # as the engine holds them
            expected = _expected_generation(weights, reference[0], engine.sender, prompts)  # while the engine generates
            report = engine.report(weights)
            if report.get("event") != "refit":
                raise RefitError(f"engine reported: {report.get('message', report)}")
            row = _check(weights, engine.sender, expected, report)
            ok &= not row.problems
            full = getattr(trainer, "full_model_bytes", None)
            rows.append({**_row(stats, row, loss), **({"full_model_bytes": full} if full else {})})
            log.info(
                "step %d: loss %.3f, refit %.1f ms, verified %s", step, loss, stats.total_s * 1e3, not row.problems
            )
            for p in row.problems:
                console.print(f"[red]step {step}: {escape(p)}[/]")
            bar.advance(task)
    return ok, rows


def _show(cfg: DemoConfig, console: Console, rows: list[dict], mem: dict, ok: bool) -> None:
    wide = cfg.wide or cfg.verbosity > 0
    console.print(demo_table(cfg.transport, rows, wide=wide))
    if cfg.delta:
        for line in delta_lines(rows):
            print_wrapped(console, line)
    for text in legends(wide=wide, lora=bool(cfg.lora), delta=cfg.delta, dtype_legend=_legend(cfg)):
        print_wrapped(console, text)
    first = rows[0] if rows else {}
    if first.get("connect_seconds", 0.0) >= 5e-5:  # the engine connects during the first refit only
        console.print(
            f"version {first['version']} first waited {first['connect_seconds'] * 1e3:.1f} ms for the engine to "
            "connect (up to REFIT_CONNECT_TIMEOUT), before its total began"
        )
    if cfg.engine == "vllm" and cfg.verbosity > 0:
        print_wrapped(console, ROTARY_NOTE)
    console.print(
        f"memory allocated or mapped (predicted): sender {mem.get('sender', 0) / 2**20:.1f} MiB, "
        f"receiver {mem.get('receiver', 0) / 2**20:.1f} MiB"
    )
    ran = [r for r in rows if "canary_seconds" in r]
    if ran:
        print_wrapped(
            console,
            f"canary at version(s) {', '.join(str(r['version']) for r in ran)}: the engine scored the probe as the "
            f"trainer did, within its dtype's tolerance ({ran[-1]['canary_seconds'] * 1e3:.1f} ms the last time, "
            "before the commit)",
        )
    console.print("[green]all refits verified[/]" if ok else "[red]verification FAILED[/]")


ROTARY_NOTE = (
    "If vLLM logged 'RotaryEmbedding: Failed to load weights' above, that is expected: its layerwise reload "
    "(which refit uses only where a module falls back to vLLM's loader) finds no checkpoint tensor for the rotary "
    "cos/sin cache, which is computed from the config, and puts vLLM's own cache back."
)


def _trainer_seconds(s: RefitStats) -> dict[str, float]:
    """The Sender's stages, 'other' (what they leave of 'total') and 'total'. A MeshRefit's stats carry only
    the total (its pairs run side by side): then no stage and no 'other'."""
    seconds = {k: s.seconds[k] for k in TRAINER_STAGES if k in s.seconds}
    if seconds:  # disjoint spans of one thread: never more than the total (max: float rounding only)
        seconds["other"] = max(0.0, s.total_s - sum(seconds.values()))
    return {**seconds, "total": s.total_s}


def _row(s: RefitStats, row: Row, loss: float) -> dict:
    """One refit as the table and the JSON show it: the trainer's stages (adding up to its total) and, apart,
    the engine's own (overlapping them)."""
    return {
        "version": s.version,
        "epoch": s.epoch,
        "handshake": s.handshake,
        "loss": loss,
        "nbytes": s.nbytes,
        "wire_bytes": s.wire_bytes,
        "full_bytes": s.full_bytes,
        "delta": s.delta,
        "buckets": dict(s.buckets),
        "num_buckets": s.num_buckets,
        "seconds": _trainer_seconds(s),
        "engine_seconds": dict(row.engine["stats"]["seconds"]),
        "connect_seconds": s.seconds.get("connect", 0.0),
        **({"canary_seconds": s.seconds["canary"]} if "canary" in s.seconds else {}),
        "gbps": s.gbps,
        **({"model_bytes": s.model_bytes, "worker_bytes": s.worker_bytes} if s.worker_bytes else {}),
        "params_ok": row.params_ok,
        "generate_ok": row.generate_ok,
        "problems": row.problems,
    }
