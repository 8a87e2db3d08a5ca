"""Stages: what a refit does to its wire bytes between the pack and the unpack, one module each.

`register(name, cls)` makes a `Stage` subclass available by name, in the trainer's process and in every
engine's: a Sender built with `stages=[name]` lists it in each epoch's manifest, and a receiver that has not
registered it refuses the handshake, naming it. refit's own: `delta` (refit.stages.delta), `fp8`
(refit.stages.fp8, added where the engines hold block-FP8 weights), `lora` (refit.stages.lora, added where
the trainer sends a PEFT LoRA adapter alone) and `mxfp8` (refit.stages.mxfp8, where the engines hold MXFP8).

`register_handler(name, cls)` makes a `Handler` (refit.stages.handler) part of every Sender made after it:
what the engines state with READY and what a check carries to their commit, read in one place each. refit's
own, called in this order: `lora`, `canary`, `fp8`, `mxfp8`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

from refit.engines.base import Engine
from refit.layout.manifest import Manifest
from refit.protocol.wire import Bucket
from refit.stages.base import Stage
from refit.stages.canary_handler import CanaryHandler
from refit.stages.delta import DeltaStage
from refit.stages.fp8 import Fp8Stage
from refit.stages.fp8_handler import Fp8Handler
from refit.stages.handler import Handler
from refit.stages.lora import LoraStage
from refit.stages.lora_handler import LoraHandler
from refit.stages.mxfp8 import Mxfp8Handler, Mxfp8Stage

__all__ = [
    "Bucket",
    "Handler",
    "Stage",
    "engine_statement",
    "handler_class",
    "handlers",
    "make",
    "names",
    "register",
    "register_handler",
    "registered",
]

_NAME = re.compile(r"[a-z][a-z0-9_-]{0,31}")
_REGISTRY: dict[str, type[Stage]] = {}
_HANDLERS: dict[str, type[Handler]] = {}


def _check_name(name: str, what: str) -> None:
    if not _NAME.fullmatch(name):
        raise ValueError(f"{what} name {name!r} must be 1 to 32 of a-z, 0-9, '_' and '-', starting with a letter")


def register(name: str, cls: type[Stage]) -> None:
    """Make `cls` (a Stage subclass) available as `name`; registering a name again replaces it."""
    _check_name(name, "stage")
    if not (isinstance(cls, type) and issubclass(cls, Stage)):
        raise ValueError(f"stage {name!r} must be a subclass of refit.stages.Stage, got {cls!r}")
    _REGISTRY[name] = cls


def register_handler(name: str, cls: type[Handler]) -> None:
    """Make every Sender built from now on call `cls` (a Handler subclass, `cls.name == name`), after the
    handlers registered before it; registering a name again replaces it in its place."""
    _check_name(name, "handler")
    if not (isinstance(cls, type) and issubclass(cls, Handler)) or cls.name != name:
        raise ValueError(f"handler {name!r} must be a subclass of refit.stages.Handler named {name!r}, got {cls!r}")
    _HANDLERS[name] = cls


def handlers(options: object) -> list[Handler]:
    """One of each registered handler for a session of `options`, in the order they were registered."""
    return [cls(options) for cls in _HANDLERS.values()]


def handler_class(name: str) -> type[Handler] | None:
    """The handler registered as `name` (an engine reads what COMMIT carries under it), or None."""
    return _HANDLERS.get(name)


def engine_statement(engine: Engine) -> dict:
    """What `engine` states with READY: its own statement, then each registered handler's, by key."""
    out = dict(engine.statement())
    for cls in _HANDLERS.values():
        out.update(cls.stated(engine))
    return out


def registered(name: str) -> bool:
    return name in _REGISTRY


def names() -> list[str]:
    """Every registered stage's name."""
    return sorted(_REGISTRY)


def make(
    names: tuple[str, ...],
    manifest: Manifest,
    device: torch.device,
    *,
    trainer: bool,
    session: Mapping[str, object] | None = None,
) -> list[Stage]:
    """One side's stages for an epoch, in the manifest's order (the engine checked each is registered), each
    configured with the `session`'s settings (`Stage.configure`)."""
    missing = [n for n in names if n not in _REGISTRY]
    if missing:
        raise ValueError(f"stage(s) {', '.join(missing)} not registered; call refit.stages.register first")
    made = [_REGISTRY[n](manifest, device, trainer=trainer) for n in names]
    for stage in made:
        stage.configure(session or {})
    return made


register(DeltaStage.name, DeltaStage)
register(Fp8Stage.name, Fp8Stage)
register(LoraStage.name, LoraStage)
register_handler(LoraHandler.name, LoraHandler)
register_handler(CanaryHandler.name, CanaryHandler)
register_handler(Fp8Handler.name, Fp8Handler)
register(Mxfp8Stage.name, Mxfp8Stage)
register_handler(Mxfp8Handler.name, Mxfp8Handler)
