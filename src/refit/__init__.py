"""refit: move freshly trained weights from an RL trainer into a running inference engine, fast and verified."""

from refit.engines.base import Engine, State, WeightsVersion
from refit.engines.module import ModuleEngine
from refit.errors import HandshakeError, IntegrityError, PeerError, RefitError
from refit.manifest import Manifest, Placement
from refit.planner import plan
from refit.receiver import Receiver
from refit.sender import Sender
from refit.settings import Settings
from refit.source import ModuleSource, Source
from refit.spec import TensorSpec
from refit.stats import RefitStats

__version__ = "0.1.0"

__all__ = [
    "Engine", "HandshakeError", "IntegrityError", "Manifest", "ModuleEngine", "ModuleSource", "PeerError",
    "Placement", "Receiver", "RefitError", "RefitStats", "Sender", "Settings", "Source", "State", "TensorSpec",
    "WeightsVersion", "plan",
]  # fmt: skip
