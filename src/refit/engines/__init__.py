"""Engines: the inference side that holds the weights (a PyTorch module, vLLM)."""

from refit.engines.base import Engine, State, WeightsVersion
from refit.engines.module import ModuleEngine

__all__ = ["Engine", "ModuleEngine", "State", "WeightsVersion"]
