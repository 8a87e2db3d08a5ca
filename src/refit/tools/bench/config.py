"""The bench's configuration: its methods, which apply where, and one run's settings (BenchConfig)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from refit import transports
from refit.dtypes import dtype_from_name
from refit.layout.copy_kernel import available
from refit.layout.spec import TensorSpec
from refit.tools.bench.link import rate_bits
from refit.tools.bench.presets import PRESETS, Shape, from_config, specs
from refit.tools.bench.quantize import FP8_ENGINE, FP8_METHODS, sides
from refit.topology.options import ZERO_COPY_TRANSPORTS

METHODS = (
    "floor",
    "foreach",
    "kernel",
    "refit",
    "checksum",
    "fingerprint",
    "zero_copy",
    "zero_copy_fingerprint",
    "digest",
    "copy_digest",
    "serial",
    "per_tensor",
    "per_tensor_meta",
    "step_full",
    "step_delta",
    "step_delta_worst",
    "quantize",
)
SENDER_STAGES = ("handshake", "pack", "send", "wait", "commit")
"""Sender stages in the report; `handshake` includes the per-refit signature check."""
RECEIVER_STAGES = ("recv", "load", "commit")
"""The first receiver's stages in the report, as `recv.<stage>`."""
LOCAL = {"foreach", "kernel"}
"""Copies of the tensors inside the sender's process: measured for colocated transports only."""
PROBES = {"digest", "copy_digest"}
"""The fingerprint's kernels alone, in the sender's process, each against a flat copy and a flat read of the
model's bytes on the same device (copy_digest: with the fused CUDA kernel only). Not stages of a verified
refit: it takes its digests inside the copies it makes anyway."""
COLOCATED = {"shm", "cuda-ipc"}
STEPPED = {"step_full", "step_delta", "step_delta_worst"}
"""Refits after a real optimizer step each (fp32 master weights, AdamW at STEP_LR, sent in the wire dtype):
full, and delta (only the chunks changed since the last commit); delta's worst case at WORST_LR."""
STEP_LR = 1e-6
"""RL post-training's learning rates are 1e-6 to 1e-5: each step changes a small fraction of bf16 values."""
WORST_LR = 1e-2
"""AdamW moves each value by about its learning rate: at 1e-2, far over a bf16 step of any weight drawn at std
0.02, so every trained value changes every step (delta's worst case: it must cost no more than a full refit)."""
LINKED = ("gloo", "relay", "nixl")
"""Transports the bench runs across a namespaced link. Not nixl yet: this process enters the trainer's
namespace per thread (setns) and keeps the host's /sys, where UCX lists network devices, so UCX's TCP
transport finds no veth; the sender needs its own process under `ip netns exec` for that."""
LINK_METHODS = ("floor", "refit", "fingerprint", "step_full", "step_delta")
"""The default methods across a namespaced link (--link-rate): the floor, and refits full and delta."""


def default_transport(name: str = "") -> str:
    """`name`, or the bench's default: cuda-ipc with CUDA, shm without."""
    return name or ("cuda-ipc" if torch.cuda.is_available() else "shm")


EITHER_MEMORY = {"nixl"}
"""Transports that move host or device memory: the bench gives them the GPU where there is one."""


def bench_device(transport: str) -> torch.device:
    """Where the sender's tensors and buffers live: cuda:0 for a CUDA transport, and for one in
    EITHER_MEMORY where CUDA is available (nixl then reads VRAM, two processes on one GPU); else the CPU."""
    on_gpu = transports.get(transport).device_type == "cuda" or (
        transport in EITHER_MEMORY and torch.cuda.is_available()
    )
    return torch.device("cuda:0" if on_gpu else "cpu")


def applicable(transport: str, device: torch.device | None = None) -> tuple[str, ...]:
    """The methods that measure something over `transport` with the sender's tensors on `device` (default:
    `bench_device`), in METHODS order."""
    if device is None:
        device = bench_device(transport)

    def applies(m: str) -> bool:
        if m in LOCAL:
            return transport in COLOCATED and (m == "foreach" or available(device))
        if m == "copy_digest":
            return available(device) and device.type == "cuda"
        if m.startswith("zero_copy"):
            return transport in ZERO_COPY_TRANSPORTS
        return True

    return tuple(m for m in METHODS if applies(m))


@dataclass(kw_only=True, slots=True)
class BenchConfig:
    preset: str = "tiny"
    """A name from PRESETS, ignored when `config` is set."""
    config: str | None = None
    """Path of a transformers config.json to derive the shapes from."""
    dtype: str = "bfloat16"
    transport: str = ""
    """Any registered transport; empty: cuda-ipc with CUDA, shm without."""
    receivers: int = 1
    repeats: int = 5
    """Timed refits per method, after `warmup` untimed ones."""
    warmup: int = 1
    bucket_bytes: int = 1 << 30
    timeout_s: float = 300.0
    """Limit on each wait inside a refit, on both sides (the CLI: REFIT_TIMEOUT when set)."""
    methods: tuple[str, ...] = tuple(m for m in METHODS if m != "quantize")
    """Default: every method but `quantize`, which needs an FP8 engine (`engine_dtype="fp8"`)."""
    layers: int | None = None
    """Keep only the model's first `layers` layers (None: all)."""
    link_rate: str | None = None
    """Put the receivers in their own network namespace, joined to the sender's by a veth pair limited to this
    tc rate ("1gbit", "10gbit"; "none": the veth's own speed), and measure the floor as a raw TCP transfer
    across it (refit.tools.bench.link; needs root). None: no link, everything in this namespace."""
    sites: int = 0
    """With `link_rate`: 0, the receivers in one namespace behind one veth; S, a fleet of S sites, each its own
    namespace behind its own veth off one bridge, `receivers` / S replicas in each stating their site."""
    engine_dtype: str | None = None
    """What the engine holds (refit.tools.bench.quantize.sides): None, the shape as it is on both sides;
    `float`, no FP8 anywhere; `fp8`, every linear weight in FP8 blocks, quantized by the trainer each refit."""

    def __post_init__(self) -> None:
        if not self.config and self.preset not in PRESETS:
            raise ValueError(f"unknown preset {self.preset!r}; choose one of {', '.join(PRESETS)}, or pass --config")
        if self.receivers < 1 or self.repeats < 1 or self.warmup < 0:
            raise ValueError("receivers and repeats must be >= 1 and warmup >= 0")
        unknown = set(self.methods) - set(METHODS)
        if unknown:
            raise ValueError(f"unknown methods {', '.join(sorted(unknown))}; choose from {', '.join(METHODS)}")
        self.transport = default_transport(self.transport)
        transports.get(self.transport)
        dtype_from_name(self.dtype)
        if self.layers is not None:
            self.shape  # noqa: B018 - validates layers against the model
        self._check_engine_dtype()
        if self.link_rate is not None:
            rate_bits(self.link_rate)
            if self.transport not in LINKED:
                raise ValueError(f"--link-rate runs {', '.join(LINKED)} for now, not {self.transport}")
        if self.sites and (self.link_rate is None or self.receivers % self.sites):
            raise ValueError(f"--sites {self.sites} needs --link-rate and a receiver count it divides")

    @property
    def shape(self) -> Shape:
        shape = from_config(self.config) if self.config else PRESETS[self.preset]
        return shape if self.layers is None else shape.truncated(self.layers)

    def specs(self) -> tuple[list[TensorSpec], list[TensorSpec]]:
        """(what the trainer holds, what the engine holds)."""
        trainer, engine = sides(self.shape, self.engine_dtype)
        dtype = dtype_from_name(self.dtype)
        return specs(trainer, dtype), specs(engine, dtype)

    def _check_engine_dtype(self) -> None:
        sides(self.shape, self.engine_dtype)
        if self.engine_dtype == FP8_ENGINE:
            other = [m for m in self.methods if m not in FP8_METHODS]
            if other:
                raise ValueError(f"with an FP8 engine the bench runs {', '.join(FP8_METHODS)}; drop {', '.join(other)}")
        elif "quantize" in self.methods:
            raise ValueError("the quantize method measures the trainer's FP8 quantizer: pass --engine-dtype fp8")
