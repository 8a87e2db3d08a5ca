"""The demo's plain trainer (one process, an unsharded model) and the choice between it and the LoRA one."""

from __future__ import annotations

from typing import Protocol

import torch

from refit.sources.module import ModuleSource
from refit.tools.demo.config import DemoConfig
from refit.tools.demo.lora import LoraTrainer
from refit.tools.demo.model import train_step
from refit.topology.stats import RefitStats


class Engine(Protocol):
    """What a trainer refits: the demo's engine process or vLLM (refit.tools.demo.engines)."""

    def refit(self, version: int) -> RefitStats: ...


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

    def refit(self, engine: Engine, version: int) -> RefitStats:
        return engine.refit(version)

    def full_weights(self) -> dict[str, torch.Tensor]:
        return dict(self.model.state_dict())


def make_trainer(cfg: DemoConfig, model: torch.nn.Module, ids: torch.Tensor) -> PlainTrainer | LoraTrainer:
    if cfg.lora:
        return LoraTrainer(model, ids, rank=cfg.lora, lr=cfg.lr)
    return PlainTrainer(model, ids, lr=cfg.lr, non_persistent=cfg.engine == "module")
