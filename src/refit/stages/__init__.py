"""Stages: what a refit does to its wire bytes between the pack and the unpack, one module each.

`register(name, cls)` makes a `Stage` subclass available by name, in the trainer's process and in every
engine's: a Sender built with `stages=[name]` lists it in each epoch's manifest, and a receiver that has not
registered it refuses the handshake, naming it. refit's own: `delta` (refit.stages.delta), `fp8`
(refit.stages.fp8, added where the engines hold block-FP8 weights) and `lora` (refit.stages.lora, added where
the trainer sends a PEFT LoRA adapter alone).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

from refit.layout.manifest import Manifest
from refit.protocol.wire import Bucket
from refit.stages.base import Stage
from refit.stages.delta import DeltaStage
from refit.stages.fp8 import Fp8Stage
from refit.stages.lora import LoraStage

__all__ = ["Bucket", "Stage", "make", "names", "register", "registered"]

_NAME = re.compile(r"[a-z][a-z0-9_-]{0,31}")
_REGISTRY: dict[str, type[Stage]] = {}


def register(name: str, cls: type[Stage]) -> None:
    """Make `cls` (a Stage subclass) available as `name`; registering a name again replaces it."""
    if not _NAME.fullmatch(name):
        raise ValueError(f"stage name {name!r} must be 1 to 32 of a-z, 0-9, '_' and '-', starting with a letter")
    if not (isinstance(cls, type) and issubclass(cls, Stage)):
        raise ValueError(f"stage {name!r} must be a subclass of refit.stages.Stage, got {cls!r}")
    _REGISTRY[name] = cls


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
