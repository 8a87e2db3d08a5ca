"""refit: move freshly trained weights from an RL trainer into a running inference engine, fast and verified.

Names are imported lazily, so `import refit` (and the CLI's start) does not load torch until needed.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "Engine": "refit.engines.base", "State": "refit.engines.base", "WeightsVersion": "refit.engines.base",
    "ModuleEngine": "refit.engines.module", "HandshakeError": "refit.errors", "IntegrityError": "refit.errors",
    "PeerError": "refit.errors", "RefitError": "refit.errors", "Manifest": "refit.manifest",
    "Placement": "refit.manifest", "plan": "refit.planner", "Receiver": "refit.receiver", "Sender": "refit.sender",
    "Settings": "refit.settings", "ModuleSource": "refit.source", "Source": "refit.source",
    "TensorSpec": "refit.spec", "RefitStats": "refit.stats",
}  # fmt: skip
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'refit' has no attribute {name!r}")
