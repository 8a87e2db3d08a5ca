"""refit: move freshly trained weights from an RL trainer into a running inference engine, fast and verified.

This module is the public API: every name in `__all__` is what a user writes. Names are imported
lazily, so `import refit` (and the CLI's start) loads neither torch nor any optional dependency;
a name whose dependency is missing fails with one line when it is used, not when refit is imported.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "Sender": "refit.topology.sender",
    "Receiver": "refit.topology.receiver",
    "RankedRefit": "refit.topology.ranked",
    "MeshRefit": "refit.topology.mesh",
    "MeshReceiver": "refit.topology.mesh",
    "Slice": "refit.layout.spec",
    "RefitStats": "refit.topology.stats",
    "Settings": "refit.settings",
    "SenderOptions": "refit.topology.options",
    "Commit": "refit.topology.policies",
    "Canary": "refit.checks.canary",
    "causal_lm": "refit.checks.canary",
    "Source": "refit.sources.base",
    "ModuleSource": "refit.sources.module",
    "FsdpSource": "refit.sources.fsdp",
    "MegatronSource": "refit.sources.megatron",
    "sharded_refit": "refit.integrations.fsdp",
    "megatron_refit": "refit.integrations.megatron",
    "Engine": "refit.engines.base",
    "State": "refit.engines.versions",
    "WeightsVersion": "refit.engines.versions",
    "ModuleEngine": "refit.engines.module",
    "VllmRefit": "refit.integrations.vllm.driver",
    "HttpEngine": "refit.integrations.vllm.driver",
    "VllmOptions": "refit.integrations.vllm.engine",
    "TensorSpec": "refit.layout.spec",
    "HandshakeError": "refit.errors",
    "IntegrityError": "refit.errors",
    "PeerError": "refit.errors",
    "RefitError": "refit.errors",
}
__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    # What type checkers see (`X as X`: an explicit re-export); at run time `__getattr__` imports each on first use.
    from refit.checks.canary import Canary as Canary
    from refit.checks.canary import causal_lm as causal_lm
    from refit.engines.base import Engine as Engine
    from refit.engines.module import ModuleEngine as ModuleEngine
    from refit.engines.versions import State as State
    from refit.engines.versions import WeightsVersion as WeightsVersion
    from refit.errors import HandshakeError as HandshakeError
    from refit.errors import IntegrityError as IntegrityError
    from refit.errors import PeerError as PeerError
    from refit.errors import RefitError as RefitError
    from refit.integrations.fsdp import sharded_refit as sharded_refit
    from refit.integrations.megatron import megatron_refit as megatron_refit
    from refit.integrations.vllm.driver import HttpEngine as HttpEngine
    from refit.integrations.vllm.driver import VllmRefit as VllmRefit
    from refit.integrations.vllm.engine import VllmOptions as VllmOptions
    from refit.layout.spec import Slice as Slice
    from refit.layout.spec import TensorSpec as TensorSpec
    from refit.settings import Settings as Settings
    from refit.sources.base import Source as Source
    from refit.sources.fsdp import FsdpSource as FsdpSource
    from refit.sources.megatron import MegatronSource as MegatronSource
    from refit.sources.module import ModuleSource as ModuleSource
    from refit.topology.mesh import MeshReceiver as MeshReceiver
    from refit.topology.mesh import MeshRefit as MeshRefit
    from refit.topology.options import SenderOptions as SenderOptions
    from refit.topology.policies import Commit as Commit
    from refit.topology.ranked import RankedRefit as RankedRefit
    from refit.topology.receiver import Receiver as Receiver
    from refit.topology.sender import Sender as Sender
    from refit.topology.stats import RefitStats as RefitStats


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'refit' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
