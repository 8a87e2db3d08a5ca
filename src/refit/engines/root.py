"""Root: an engine's committed version and the Merkle root over what it holds (refit.checks.root), read together."""

from __future__ import annotations

import torch

from refit.checks.manifest_check import waived
from refit.checks.root import held_leaves, root
from refit.engines.base import Engine
from refit.engines.versions import State
from refit.layout.manifest import Manifest


def engine_root(engine: Engine, manifest: Manifest) -> tuple[int | None, str]:
    """(the engine's committed version, the root over what it holds now for `manifest`'s names). Raises
    ValueError unless the weights are current: during or after a broken refit they belong to no one version.
    A name the engine waives or cannot read back has the `UNREADABLE` leaf, so that root differs from the
    trainer's: those tensors are not proven."""
    w = engine.weights
    if w.state != State.CURRENT:
        raise ValueError(
            f"the engine's weights are {w.state.value} (version {w.version}, target {w.target}): "
            "read the root once a refit committed"
        )
    names = manifest.names
    held: list[torch.Tensor | None] = []
    for name in names:
        got = None if engine.optional_names and waived(name, engine.optional_names) else engine.held(name)
        held.append(None if got is None else got[0])
    found = root(held_leaves(names, held, [manifest.entry(n).spec.dtype for n in names]))
    if engine.weights is not w:  # a refit began while the tensors were read: they belong to no one version
        raise ValueError(f"a refit began while the root of version {w.version} was read: read it again")
    return w.version, found
