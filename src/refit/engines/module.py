"""ModuleEngine: a plain PyTorch module (e.g. a transformers model) as the refit target, copied in place."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from torch import nn

from refit.checks.validation import waived
from refit.engines.base import Engine
from refit.layout.packing import CopyPlan, LayoutGuard
from refit.layout.reshard import Slice
from refit.layout.spec import TensorSpec
from refit.layout.state_layout import StateLayout


class ModuleEngine(Engine):
    """Loads into a module's parameters and buffers (or a state dict's tensors) in place, under no_grad.

    The targets are re-read at every handshake and refit, so a parameter or buffer the inference side
    replaced (`module.to()`, a reassigned buffer) receives the bytes, not its stale predecessor; copy
    plans are dropped whenever any target's storage, dtype, shape or strides changed. Names that share
    one storage and view (tied weights) are one spec with aliases: the handshake refuses a sender that
    sends them as separate tensors."""

    def __init__(
        self,
        module: nn.Module | Mapping[str, torch.Tensor],
        *,
        name_map: Mapping[str, str] | None = None,
        ignore: Iterable[str] = (),
        shards: Mapping[str, Slice] | None = None,
    ) -> None:
        """`name_map` maps sender names to this module's names where they differ; `ignore`: sender names
        (or fnmatch patterns) never loaded nor checked, whether or not the module has them (reported).
        `shards` (M:N, `refit.topology.mesh`): per sender name, the slice of the checkpoint tensor this
        module's tensor holds (its shape is the slice's); names not listed are held whole."""
        super().__init__()
        self.optional_names = frozenset(ignore)
        self.module = module
        self._layout = StateLayout(module) if isinstance(module, nn.Module) else None
        own = self._own()
        name_map = dict(name_map or {})
        unknown = sorted(v for v in name_map.values() if v not in own)
        if unknown:
            raise ValueError(f"name_map targets names the module does not have: {unknown[:10]}")
        self._inverse = {v: k for k, v in name_map.items()}
        self._plans: dict[int, tuple[list, CopyPlan]] = {}
        self._used: set[int] = set()
        self._names: tuple[str, ...] = ()
        self._guard: LayoutGuard | None = None
        self._targets: dict[str, torch.Tensor] = {}
        self._refresh()
        self._shards = dict(shards or {})
        for name, part in self._shards.items():
            t = self._targets.get(name)
            if t is None or part.dim >= max(t.dim(), 1) or (t.shape[part.dim] if t.dim() else 1) != part.length:
                shape = None if t is None else tuple(t.shape)
                raise ValueError(f"shards[{name!r}] = {part} does not fit the module's tensor (shape {shape})")

    def _own(self) -> dict[str, torch.Tensor]:
        return self._layout.read() if self._layout is not None else dict(self.module)  # type: ignore[arg-type]

    def _refresh(self) -> None:
        """Re-read the live targets; forget every copy plan if any of them was replaced or re-laid-out."""
        self._targets = {self._inverse.get(n, n): t for n, t in self._own().items()}
        names, values = tuple(self._targets), list(self._targets.values())
        if names != self._names or self._guard is None or not self._guard.holds(values):
            self._plans, self._names, self._guard = {}, names, LayoutGuard(values)

    def specs(self) -> list[TensorSpec]:
        self._refresh()
        ties: dict[tuple, list[str]] = {}
        for n, t in self._targets.items():
            ties.setdefault(_view_key(t), []).append(n)
        return [_spec(names, self._targets[names[0]]) for names in ties.values()]

    def begin(self, version: int) -> None:
        self._refresh()
        # Plans unused in the last refit belong to an old manifest; dropping them frees the old
        # buffers' views and staging tensor, which they would otherwise keep alive.
        self._plans = {k: v for k, v in self._plans.items() if k in self._used}
        self._used = set()
        super().begin(version)

    def release_buffers(self) -> None:
        self._plans, self._used = {}, set()

    def shards(self) -> dict[str, Slice | None] | None:
        if not self._shards:
            return None
        self._refresh()
        return {n: self._shards.get(n) for n in self._targets if not waived(n, self.optional_names)}

    def shard_target(self, name: str) -> torch.Tensor | None:
        return self._targets.get(name)

    def tensor(self, name: str) -> torch.Tensor:
        """The engine's tensor for a sender name."""
        return self._targets[name]

    def held(self, name: str) -> tuple[torch.Tensor, None] | None:
        t = None if waived(name, self.optional_names) else self._targets.get(name)
        return None if t is None else (t, None)

    def load(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Copy in place. A list passed again (the receiver reuses one per bucket) replays a cached plan,
        so many small tensors cost one batched launch, not one Python step each."""
        hit = self._plans.get(id(tensors))
        if hit is None or hit[0] is not tensors:
            kept = [(n, t) for n, t in tensors if not waived(n, self.optional_names)]
            hit = (tensors, CopyPlan([self._targets[n] for n, _ in kept], [t for _, t in kept]))
            self._plans[id(tensors)] = hit
        self._used.add(id(tensors))
        with torch.no_grad():
            hit[1].run()


def _spec(names: list[str], t: torch.Tensor) -> TensorSpec:
    return TensorSpec(names[0], tuple(t.shape), t.dtype, tuple(names[1:]))


def _view_key(t: torch.Tensor) -> tuple:
    """Equal for two names of one tensor (tied weights); an empty tensor is never tied to anything."""
    if not t.numel():
        return (id(t),)
    return (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
