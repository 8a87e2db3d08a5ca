"""ModuleSource: a plain PyTorch module or state dict as the source, read live every refit."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence

import torch
from torch import nn

from refit.layout.packing import LayoutGuard, layout_key
from refit.layout.spec import Slice, TensorSpec
from refit.layout.state_layout import StateLayout, non_persistent_buffers, with_buffers
from refit.layout.tensor_guard import layout_snapshot
from refit.sources.base import Source, WireDtypes


class ModuleSource(WireDtypes, Source):
    """A plain module or state dict, read live: every refit re-reads the module's parameters and buffers,
    so tensors replaced since the last refit (a reassigned buffer, `module.to()`, `load_state_dict(assign=True)`)
    are sent from what the module holds now. A mapping is re-read too (pass the module, not a
    `state_dict()` copy, to see replacements)."""

    signature_covers_layout = True

    def __init__(
        self,
        weights: nn.Module | Mapping[str, torch.Tensor],
        *,
        wire_dtype: torch.dtype | None = None,
        overrides: Mapping[str, torch.dtype] | None = None,
        shards: Mapping[str, Slice] | None = None,
        shapes: Mapping[str, tuple[int, ...]] | None = None,
        non_persistent: bool = False,
    ) -> None:
        """`wire_dtype` casts every floating tensor (e.g. fp32 master weights sent as bf16);
        `overrides` sets the wire dtype of single tensors (e.g. keep a router bias in fp32).
        `shards` and `shapes` (M:N only, `refit.topology.mesh.MeshRefit`): per name, the slice of the
        global tensor this rank's tensor holds, and the global shape; names not listed are held whole.
        `non_persistent`: also send the module's non-persistent buffers (state its `state_dict` leaves out,
        such as a routing table kept off checkpoints), each in its own dtype."""
        self._layout = StateLayout(weights) if isinstance(weights, nn.Module) else None
        self._buffers = non_persistent_buffers(weights) if non_persistent and isinstance(weights, nn.Module) else []
        self._mapping = weights
        self._last: tuple[tuple, Callable[[], bool], Hashable] | None = None
        """(wire-dtype overrides, a check that nothing read moved, the signature) of the last `signature`."""
        self._tensors: dict[str, torch.Tensor] = self._read()
        self._init_wire(wire_dtype, overrides)
        for name, _, _ in self._buffers:  # computed state goes exactly as the module holds it, never cast
            self.set_wire_dtype(name, self._tensors[name].dtype)
        self._shards = dict(shards or {})
        self._shapes = {n: tuple(shapes[n]) for n in self._shards} if shapes and shards else {}
        for n, part in self._shards.items():
            t, shape = self._tensors.get(n), self._shapes.get(n)
            if t is None or shape is None or len(shape) != t.dim() or part.dim >= t.dim():
                raise ValueError(f"shards[{n!r}] needs the module's tensor and its global shape in shapes[{n!r}]")
            want = tuple(part.length if d == part.dim else shape[d] for d in range(t.dim()))
            if tuple(t.shape) != want or part.start + part.length > shape[part.dim]:
                raise ValueError(f"shards[{n!r}] = {part} of {shape} does not fit the tensor's shape {tuple(t.shape)}")

    def _read(self) -> dict[str, torch.Tensor]:
        if self._layout is None:
            return dict(self._mapping)  # type: ignore[arg-type]
        return with_buffers(self._layout.read(), self._buffers)

    def signature(self) -> Hashable:
        """Checks the live tensors (called at the start of every refit), re-reading them unless `_still` proves
        nothing moved. Changes when any tensor is replaced, moved, reshaped, restrided or recast, or a name
        appears or vanishes; the Sender then compares full specs (a new epoch only if a spec or an alias changed)."""
        overrides = tuple(sorted(self._overrides.items(), key=str)) if self._overrides else ()
        last = self._last
        if last is not None and last[0] == overrides and last[1]():
            return last[2]  # the very same object: nothing it covers moved
        self._tensors = self._read()
        names, values = tuple(self._tensors), list(self._tensors.values())
        signature = names, layout_key(values), overrides
        self._last = (overrides, self._still(names, values), signature)
        return signature

    def _still(self, names: tuple[str, ...], values: list[torch.Tensor]) -> Callable[[], bool]:
        """A check that holds only while the weights hold the tensors just read as `_tensors`, in their layout
        (then `_tensors` is current). A plain dict is compared in one C pass without being read: the very same
        key and tensor objects in the same order, each in the same storage and layout (`_tensors` keeps them
        alive, so no address compared there is reused). Anything else is read again and guarded."""
        mapping = self._mapping
        if type(mapping) is dict and self._layout is None:
            same = layout_snapshot(mapping)
            if same is not None:
                return lambda: same(mapping)
        guard = LayoutGuard(values)

        def reread() -> bool:
            self._tensors = self._read()
            return tuple(self._tensors) == names and guard.holds(list(self._tensors.values()))

        return reread

    @property
    def lookup_only(self) -> bool:
        return type(self).tensors is ModuleSource.tensors  # an override may do more than look up (or raise)

    def specs(self) -> list[TensorSpec]:
        out = super().specs()
        if not self._shards:
            return out
        return [TensorSpec(s.name, self._shapes.get(s.name, s.shape), s.dtype, s.aliases) for s in out]

    def holdings(self) -> dict[str, Slice | None]:
        return {s.name: self._shards.get(s.name) for s in self.specs()}

    def local_tensors(self, names: Sequence[str]) -> list[torch.Tensor]:
        return [self._tensors[n] for n in names]

    def tensors(self, names: Sequence[str]) -> list[torch.Tensor]:
        if self._shards:
            raise ValueError("a ModuleSource with shards holds only its slices: refit it with MeshRefit (M:N)")
        return [self._tensors[n] for n in names]
