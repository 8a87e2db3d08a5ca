"""Choices: the names the command line's help and parser list, importable without torch, so that parsing
(`--version`, `--help`, a mistake) answers before torch loads. tests/tools/test_cli.py keeps them equal to
the modules that own them."""

from __future__ import annotations

TRANSPORTS = ("shm", "gloo", "cuda-ipc", "nccl", "nixl", "relay")
"""The built-in transports (refit.transports.names(), before entry points)."""
PRESETS = ("tiny", "qwen2-0.5b", "qwen2-7b", "moe", "moe-small", "deepseek-v3")
"""The bench's and plan's presets (refit.tools.bench.presets.PRESETS)."""
BENCH_METHODS = (
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
"""The bench's methods (refit.tools.bench.config.METHODS)."""
COLOCATED_METHODS = ("floor", "per_rank", "per_rank_schedule", "rank0_led", "m_to_n")
"""The bench's methods with --ranks (refit.tools.bench.colocated.METHODS)."""
DEMO_ENGINE_DTYPES = ("float", "fp8", "mxfp8")
"""The demo's engine dtypes: 'float' and the quantized ones (refit.tools.demo.fp8.ENGINE_DTYPES)."""
