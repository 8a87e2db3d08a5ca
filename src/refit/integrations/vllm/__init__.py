"""vLLM: a refit Engine in every vLLM worker (`engine`, through vLLM's weight-transfer API in `backend`
or a worker extension in `worker`), its compiled copy plan (`plan`, `recording`), the trainer-side
driver (`driver`), the cache policy at commit (`cache`), a speculative draft refitted with its
target as one version (`draft`), LoRA adapters refitted from memory into vLLM's LoRA manager (`lora`),
and backend 'refit' of vLLM's own trainer-side API (`trainer`, reading vLLM's WeightSource through
`weight_source`). Names are imported lazily: only `backend` and `trainer` need vLLM."""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "VllmRefit": "driver",
    "HttpEngine": "driver",
    "VllmEngine": "engine",
    "VllmOptions": "engine",
    "checkpoint_shapes": "engine",
    "layout": "engine",
    "BACKEND": "engine",
    "MODES": "engine",
    "RefitWorkerExtension": "worker",
    "expected_fingerprints": "worker",
    "worker_engine": "worker",
    "worker_held": "worker",
    "worker_parameters": "worker",
    "worker_seconds": "worker",
    "RefitWeightTransferEngine": "backend",
    "RefitInitInfo": "backend",
    "RefitUpdateInfo": "backend",
    "register": "backend",
    "RefitTrainerInitInfo": "trainer",
    "RefitTrainerWeightTransferEngine": "trainer",
    "ClientEngine": "trainer",
    "register_trainer": "trainer",
    "StreamSource": "weight_source",
    "drafted": "draft",
    "DraftedEngine": "draft",
    "DRAFT_PREFIX": "draft",
    "VllmLoraEngine": "lora",
    "VllmLoraOptions": "lora",
    "VllmLoraRefit": "lora",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
