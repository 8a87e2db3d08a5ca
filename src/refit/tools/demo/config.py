"""The demo's configuration: one dataclass, built by `refit demo` from its options and read everywhere else."""

from __future__ import annotations

from dataclasses import dataclass

from refit.settings import Settings
from refit.tools.choices import DEMO_ENGINE_DTYPES


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
    """'float' (the engine holds what the wire carries), 'fp8' or 'mxfp8' (the engine's decoder linears hold block
    FP8 or MXFP8 with scales: the trainer quantizes for it, refit.stages.fp8 and refit.stages.mxfp8)."""
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
        if self.engine_dtype not in DEMO_ENGINE_DTYPES:
            raise ValueError(f"engine_dtype must be one of {', '.join(DEMO_ENGINE_DTYPES)}, got {self.engine_dtype!r}")
        if self.engine_dtype != "float" and (self.engine != "module" or self.trainer != "plain"):
            raise ValueError(f"--engine-dtype {self.engine_dtype} runs with --engine module and --trainer plain")
        if self.lora < 0 or (self.lora and (self.trainer, self.engine) != ("plain", "module")):
            raise ValueError(f"--lora ({self.lora}) is a rank >= 1, with the plain trainer and the module engine")
        if self.lora and self.engine_dtype != "float":
            raise ValueError(f"--lora and --engine-dtype {self.engine_dtype} do not combine: the adapter moves alone")
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


def session_settings(cfg: DemoConfig) -> Settings:
    """The Settings of the demo's Sender: its bucket and timeout from `cfg`; the rest from the environment."""
    return Settings(bucket_bytes=cfg.bucket_bytes, timeout_s=cfg.timeout_s)


def model_size(cfg: DemoConfig) -> dict:
    return {"layers": cfg.layers, "hidden": cfg.hidden, "ffn": cfg.hidden * 3}
