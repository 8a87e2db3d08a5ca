"""The receiver a vLLM worker serves refits with: over its model (and its draft model), live or staged, one
trainer or M:N."""

from __future__ import annotations

from typing import Any

import torch

from refit.engines.base import Engine
from refit.integrations.vllm.draft import DraftedEngine
from refit.integrations.vllm.engine import VllmEngine, VllmOptions, worker_index
from refit.log import get_logger
from refit.settings import Settings
from refit.topology.mesh import MeshReceiver
from refit.topology.receiver import Receiver

log = get_logger("vllm")


def make_receiver(
    model: torch.nn.Module,
    model_config: Any,
    device: torch.device,
    rendezvous: dict,
    timeout_s: float,
    options: VllmOptions,
    *,
    staged: bool = False,
    drafted: bool = False,
) -> Receiver:
    """`staged`: refits land in staging memory and `apply_staged()` moves them into vLLM's tensors.
    `drafted`: vLLM runs a speculative draft model, which joins the engine when vLLM names it
    (refit.integrations.vllm.draft)."""
    engine: Engine = VllmEngine(model, model_config, options)
    if drafted and (staged or "mesh" in rendezvous):
        log.warning("staged and M:N refits do not carry a draft model yet: vLLM's draft keeps its loaded weights")
    elif drafted:
        engine = DraftedEngine(engine)  # type: ignore[arg-type]
    settings = Settings(timeout_s=timeout_s)
    if "mesh" in rendezvous:  # M:N (MeshRefit): this worker receives only its slices, from every trainer rank
        mesh = MeshReceiver(engine, rendezvous, worker=worker_index(), settings=settings, device=device, staged=staged)
        mesh.connect()
        return mesh  # type: ignore[return-value]
    receiver = Receiver(engine, rendezvous, settings=settings, device=device, staged=staged)
    receiver.connect()
    return receiver
