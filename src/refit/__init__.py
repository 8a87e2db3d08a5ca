"""refit: move freshly trained weights from an RL trainer into a running inference engine, fast and verified.

This module is the public API: every name in `__all__` is what a user writes. Names are imported
lazily, so `import refit` (and the CLI's start) loads neither torch nor any optional dependency;
a name whose dependency is missing fails with one line when it is used, not when refit is imported.

Import paths of earlier releases (`refit.fsdp`, `refit.engines.vllm`, ...) keep working: they
resolve to the modules that now hold those names, with a DeprecationWarning naming the new path.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import warnings
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "Sender": "refit.topology.sender",
    "Receiver": "refit.topology.receiver",
    "RankedRefit": "refit.topology.ranked",
    "MeshRefit": "refit.topology.mesh",
    "MeshReceiver": "refit.topology.mesh",
    "Slice": "refit.layout.reshard",
    "RefitStats": "refit.topology.stats",
    "Settings": "refit.settings",
    "Source": "refit.sources.base",
    "ModuleSource": "refit.sources.module",
    "FsdpSource": "refit.sources.fsdp",
    "MegatronSource": "refit.sources.megatron",
    "sharded_refit": "refit.integrations.fsdp",
    "megatron_refit": "refit.integrations.megatron",
    "Engine": "refit.engines.base",
    "State": "refit.engines.base",
    "WeightsVersion": "refit.engines.base",
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

_INTERNAL = {
    "Manifest": "refit.layout.manifest",
    "Placement": "refit.layout.manifest",
    "plan": "refit.layout.planner",
}
"""Exported by earlier releases, internal now: still resolved, with a DeprecationWarning."""

_MOVED: dict[str, tuple[str, ...]] = {
    "refit.address": ("refit.transports.address",),
    "refit.bench": ("refit.tools.bench",),
    "refit.budget": ("refit.layout.budget",),
    "refit.cli": ("refit.tools.cli",),
    "refit.colocated": ("refit.topology.ranked",),
    "refit.copy_kernel": ("refit.layout.copy_kernel",),
    "refit.demo": ("refit.tools.demo",),
    "refit.device": ("refit.transports.device",),
    "refit.digest": ("refit.checks.digest",),
    "refit.digests": ("refit.topology.verification",),
    "refit.doctor": ("refit.tools.doctor",),
    "refit.engines.vllm": ("refit.integrations.vllm",),
    "refit.engines.vllm_plan": ("refit.integrations.vllm.plan",),
    "refit.engines.vllm_recording": ("refit.integrations.vllm.recording",),
    "refit.fsdp": ("refit.sources.fsdp", "refit.integrations.fsdp"),
    "refit.integrity": ("refit.checks.checksum",),
    "refit.lobby": ("refit.protocol.lobby",),
    "refit.manifest": ("refit.layout.manifest",),
    "refit.megatron": ("refit.sources.megatron", "refit.integrations.megatron"),
    "refit.megatron_layout": ("refit.sources.megatron_layout",),
    "refit.packing": ("refit.layout.packing",),
    "refit.planner": ("refit.layout.planner",),
    "refit.receiver": ("refit.topology.receiver",),
    "refit.sender": ("refit.topology.sender",),
    "refit.source": ("refit.sources.base", "refit.sources.module"),
    "refit.spec": ("refit.layout.spec", "refit.dtypes"),
    "refit.state_layout": ("refit.layout.state_layout",),
    "refit.stats": ("refit.topology.stats",),
    "refit.tensor_guard": ("refit.layout.tensor_guard",),
    "refit.validation": ("refit.checks.validation",),
    "refit.verify": ("refit.checks.hashes",),
    "refit.wire": ("refit.protocol.wire",),
}
"""Module paths of earlier releases, each with the modules that now hold its names."""


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    if name in _INTERNAL:
        warnings.warn(f"refit.{name} is internal; import it from {_INTERNAL[name]}", DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(_INTERNAL[name]), name)
    raise AttributeError(f"module 'refit' has no attribute {name!r}")


def _moved_module(old: str) -> types.ModuleType:
    """A module at `old` whose names come from the modules that hold them now (the first that has each).

    A stand-in rather than the new module itself, whose `__spec__` the import system would overwrite."""
    new = _MOVED[old]
    module = types.ModuleType(old, f"Moved: see {', '.join(new)}.")

    def lookup(name: str) -> Any:
        for path in new:
            target = importlib.import_module(path)
            if hasattr(target, name):
                return getattr(target, name)
        raise AttributeError(f"module {old!r} has no attribute {name!r}")

    module.__getattr__ = lookup  # type: ignore[method-assign]
    return module


class _MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Resolves the module paths of earlier releases (`_MOVED`) to where their names live now."""

    def find_spec(self, fullname: str, path: object, target: object = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in _MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        warnings.warn(
            f"{spec.name} moved to {' and '.join(_MOVED[spec.name])}; import from there",
            DeprecationWarning,
            stacklevel=2,
        )
        return _moved_module(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        """Nothing to run: the module is the one that holds the names now."""


if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
    sys.meta_path.insert(0, _MovedFinder())
