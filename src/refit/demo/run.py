"""The demo's trainer: real optimizer steps on a small LM, a refit after each, every refit checked."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field

import torch
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

import refit
from refit.demo.engine import MARK
from refit.demo.model import PROMPTS, TEXT, build_model, build_tokenizer, greedy, model_config
from refit.errors import RefitError
from refit.sender import Sender
from refit.settings import Settings
from refit.source import ModuleSource
from refit.stats import RefitStats
from refit.verify import differences, fingerprints

KEEP_FP32 = "model.norm.weight"
"""The tensor whose wire dtype switches from bf16 to fp32 partway (the seed's e_score_correction_bias case)."""


@dataclass(kw_only=True, slots=True)
class DemoConfig:
    transport: str = "shm"
    """Transport to refit over."""
    engine: str = "module"
    """'module' (a transformers model in its own process) or 'vllm' (vLLM from dummy weights)."""
    trainer: str = "plain"
    """'plain' (one process) or 'fsdp' (FSDP2 over `ranks` processes, gloo)."""
    ranks: int = 2
    steps: int = 4
    """Optimizer steps, each followed by a refit."""
    dtype_change_at: int = 2
    """Step after which KEEP_FP32 goes on the wire in fp32 (a new epoch); -1 for never."""
    bucket_bytes: int = 8 << 20
    """Bucket capacity; small enough that the demo model needs several buckets."""
    layers: int = 8
    hidden: int = 512
    timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"steps ({self.steps}) must be >= 1")
        if self.trainer not in ("plain", "fsdp") or self.ranks < 1:
            raise ValueError(f"trainer must be 'plain' or 'fsdp' with ranks >= 1, got {self.trainer!r}, {self.ranks}")
        if self.engine not in ("module", "vllm"):
            raise ValueError(f"engine must be 'module' or 'vllm', got {self.engine!r}")
        if self.trainer == "fsdp" and self.engine != "module":
            raise ValueError("--trainer fsdp runs with --engine module")


@dataclass(slots=True)
class Row:
    engine: dict
    params_ok: bool
    generate_ok: bool
    problems: list[str] = field(default_factory=list)


class EngineProcess:
    """The engine as a child process that speaks JSON lines (no pickle crosses the boundary)."""

    def __init__(self, sender: Sender, args: dict) -> None:
        self.sender = sender
        env = dict(os.environ)
        pkg_root = os.path.dirname(os.path.dirname(refit.__file__))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg_root, env.get("PYTHONPATH")) if p)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "refit.demo.engine", json.dumps(args)], stdout=subprocess.PIPE, text=True, env=env
        )

    def refit(self, version: int) -> RefitStats:
        return self.sender.refit(version)

    def report(self) -> dict:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(MARK):
                return json.loads(line[len(MARK) :])
        raise RefitError(f"engine process exited with code {self.proc.wait()} before reporting")

    def close(self) -> int:
        self.sender.close()
        try:
            return self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return -9


class VllmSide:
    """A vLLM engine (default multiprocess mode) that starts from dummy weights, refitted via backend 'refit'."""

    def __init__(self, sender: Sender, model: torch.nn.Module, tok, prompts: list[list[int]], workdir: str) -> None:
        from vllm import LLM

        from refit.demo.model import save
        from refit.engines.vllm import VllmRefit

        path = save(model, tok, os.path.join(workdir, "model"))
        self.llm = LLM(model=path, load_format="dummy", enforce_eager=True, dtype="float32",
                       kv_cache_memory_bytes=64 << 20, max_model_len=512, weight_transfer_config={"backend": "refit"},
                       worker_extension_cls="refit.engines.vllm.RefitWorkerExtension")  # fmt: skip
        self.driver = VllmRefit(self.llm, sender)
        self.sender, self.prompts = sender, prompts

    def refit(self, version: int) -> RefitStats:
        return self.driver.refit(version)

    def report(self) -> dict:
        """Fingerprints of the parameters vLLM keeps in checkpoint layout, and its greedy output."""
        from vllm import SamplingParams

        from refit.engines.vllm import expected_fingerprints

        assert self.sender.manifest is not None
        names = [p.name for p in self.sender.manifest.entries]
        sent = {p.name: t.detach().to(p.spec.dtype) for p, t in zip(self.sender.manifest.entries,
                                                                   self.sender.source.tensors(names))}  # fmt: skip
        outs = self.llm.generate([{"prompt_token_ids": p} for p in self.prompts],
                                 SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)  # fmt: skip
        return {"event": "refit", "stats": {"seconds": {}},
                "fingerprints": self.llm.collective_rpc("refit_fingerprints")[0],
                "expected": expected_fingerprints(sent, self.llm.collective_rpc("refit_layout")[0]),
                "generated": [list(o.outputs[0].token_ids) for o in outs]}  # fmt: skip

    def close(self) -> int:
        self.driver.close()
        self.llm.llm_engine.engine_core.shutdown()
        return 0


def _train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, ids: torch.Tensor) -> float:
    model.train()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    model.eval()
    return float(loss.detach())


class PlainTrainer:
    """The trainer for the default demo: one process, an unsharded model."""

    def __init__(self, model: torch.nn.Module, ids: torch.Tensor) -> None:
        self.model, self.ids = model, ids
        self.opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        self.source = ModuleSource(model, wire_dtype=torch.bfloat16)

    def step(self) -> float:
        return _train_step(self.model, self.opt, self.ids)

    def refit(self, engine: EngineProcess | VllmSide, version: int) -> RefitStats:
        return engine.refit(version)

    def full_weights(self) -> dict[str, torch.Tensor]:
        return dict(self.model.state_dict())


def _check(weights: dict[str, torch.Tensor], reference: torch.nn.Module, sender: Sender, prompts: list,
           report: dict) -> Row:  # fmt: skip
    """Compare the engine's report with what the trainer sent and with the trainer's own generation."""
    assert sender.manifest is not None
    wire = {p.name: p.spec.dtype for p in sender.manifest.entries}
    sent = report.get("expected") or fingerprints(weights.items(), wire)
    with torch.no_grad():
        for name, t in reference.state_dict(keep_vars=True).items():
            t.copy_(weights[name].to(wire[name]))
    expected = greedy(reference, prompts)
    diffs = differences(sent, report["fingerprints"])
    problems = [f"{len(diffs)} parameter(s) differ from what was sent: {diffs[:5]}"] if diffs else []
    gen_ok = report["generated"] == expected
    if not gen_ok:
        problems.append(f"generation differs: engine {report['generated']} vs trainer {expected}")
    return Row(report, not diffs, gen_ok, problems)


def demo_model(cfg: DemoConfig) -> tuple[dict, torch.nn.Module, object, torch.Tensor, list[list[int]]]:
    """The demo's model size, trainer model, tokenizer, training ids and prompts (same on every rank)."""
    tok = build_tokenizer()
    mcfg = {"layers": cfg.layers, "hidden": cfg.hidden, "ffn": cfg.hidden * 3}
    ids = torch.tensor([tok(TEXT)["input_ids"][:256]])
    return mcfg, build_model(model_config(**mcfg), seed=0), tok, ids, [tok(p)["input_ids"] for p in PROMPTS]


def run(cfg: DemoConfig, console: Console, trainer=None) -> bool:
    """Run the demo over one transport; True when every refit verified. `trainer` defaults to a
    PlainTrainer; the sharded demo passes rank 0's FSDP trainer."""
    mcfg, model, tok, ids, prompts = demo_model(cfg)
    trainer = trainer or PlainTrainer(model, ids)
    model, source = trainer.model, trainer.source
    reference = build_model(model_config(**mcfg), seed=0)
    settings = Settings(bucket_bytes=cfg.bucket_bytes, timeout_s=cfg.timeout_s)
    nparams = sum(p.numel() for p in model.parameters())
    console.print(f"[bold]refit demo[/] over [cyan]{cfg.transport}[/] into a [cyan]{cfg.engine}[/] engine: Llama-style "
                  f"LM, {nparams / 1e6:.1f}M params, fp32 master weights sent as bf16, {cfg.steps} steps"
                  f"{f', trainer sharded with FSDP2 over {cfg.ranks} ranks' if cfg.trainer == 'fsdp' else ''}")  # fmt: skip
    table = _table(cfg.transport)
    ok = True
    sender = Sender(source, transport=cfg.transport, settings=settings)
    with tempfile.TemporaryDirectory() as workdir:
        if cfg.engine == "vllm":
            engine: EngineProcess | VllmSide = VllmSide(sender, model, tok, prompts, workdir)
        else:
            engine = EngineProcess(sender, {"rendezvous": sender.rendezvous(), "model": mcfg, "prompts": prompts,
                                            "bucket_bytes": cfg.bucket_bytes, "timeout_s": cfg.timeout_s})  # fmt: skip
        try:
            with Progress(console=console, transient=True) as progress:
                task = progress.add_task("training and refitting", total=cfg.steps)
                for step in range(1, cfg.steps + 1):
                    loss = trainer.step()
                    if step == cfg.dtype_change_at + 1:
                        source.set_wire_dtype(KEEP_FP32, torch.float32)
                    stats = trainer.refit(engine, step)
                    report = engine.report()
                    if report.get("event") != "refit":
                        raise RefitError(f"engine reported: {report.get('message', report)}")
                    row = _check(trainer.full_weights(), reference, sender, prompts, report)
                    ok &= not row.problems
                    _add_row(table, stats, row, loss)
                    for p in row.problems:
                        console.print(f"[red]step {step}: {p}[/]")
                    progress.advance(task)
        finally:
            engine.close()
    console.print(table)
    mem = sender.predicted_memory() if sender.manifest else {}
    console.print(f"predicted peak extra memory: sender {mem.get('sender', 0) / 2**20:.0f} MiB, "
                  f"receiver {mem.get('receiver', 0) / 2**20:.0f} MiB")  # fmt: skip
    console.print("[green]all refits verified[/]" if ok else "[red]verification FAILED[/]")
    return ok


def _table(transport: str) -> Table:
    t = Table(title=f"refits over {transport} (times in ms; params: bitwise equal to what was sent; "
                    "gen: engine's greedy output equals the trainer's)")
    for col in ("ver", "epoch", "loss", "MB", "bkts", "pack", "send", "wait", "load", "total", "GB/s", "params",
                "gen"):  # fmt: skip
        t.add_column(col, justify="right")
    return t


def _add_row(table: Table, s: RefitStats, row: Row, loss: float) -> None:
    ms = {k: v * 1e3 for k, v in s.seconds.items()}
    load_ms = row.engine["stats"]["seconds"].get("load", 0.0) * 1e3
    mark = lambda ok: "[green]✓[/]" if ok else "[red]✗[/]"  # noqa: E731
    table.add_row(
        str(s.version), f"{s.epoch}{'*' if s.handshake else ''}", f"{loss:.3f}", f"{s.nbytes / 1e6:.1f}",
        str(s.num_buckets), f"{ms.get('pack', 0):.1f}", f"{ms.get('send', 0):.1f}", f"{ms.get('wait', 0):.1f}",
        f"{load_ms:.1f}", f"{ms.get('total', 0):.1f}", f"{s.gbps:.2f}", mark(row.params_ok),
        mark(row.generate_ok),
    )  # fmt: skip
