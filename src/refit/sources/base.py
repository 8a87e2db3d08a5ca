"""Source: the trainer-side weights to send, with their wire dtypes, read without materialising."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Hashable, Mapping, Sequence

import torch

from refit.dtypes import dtype_name
from refit.layout.spec import Slice, TensorSpec


class Source(ABC):
    """What a Sender reads from: specs up front, tensors per bucket."""

    stable_tensors: bool = True
    """True when `tensors` returns the same long-lived tensors every refit (so copy plans may be cached);
    False when it materialises fresh ones (gathers), which must be dropped after each bucket."""
    signature_covers_layout: bool = False
    """True when `signature()` changes whenever any tensor's storage, dtype, shape or strides change (not
    only its spec): then an unchanged signature vouches for every cached copy plan at once."""

    @property
    def lookup_only(self) -> bool:
        """True when `tensors` only looks up what `signature()` read, so that while the signature stands a
        cached copy plan may run without calling `tensors` at all (a subclass that does more says False)."""
        return False

    @abstractmethod
    def specs(self) -> list[TensorSpec]:
        """Name, global shape and wire dtype of every tensor to send; must not materialise data."""

    @abstractmethod
    def tensors(self, names: Sequence[str]) -> list[torch.Tensor]:
        """The source tensors for `names`, in that order, in any dtype (packing casts to the wire dtype).
        Only read under no_grad; they may be live parameters."""

    def signature(self) -> Hashable:
        """Changes whenever a wire dtype or shape changes; called every refit, so keep it cheap."""
        return tuple((s.name, s.shape, s.dtype) for s in self.specs())

    def prepare_refit(self) -> None:
        """M:N: called on every rank before each refit (collective where the source needs agreement)."""

    def holdings(self) -> dict[str, Slice | None]:
        """M:N: per primary name, the slice of the tensor this rank holds (None: the whole tensor)."""
        return {s.name: None for s in self.specs()}

    def local_tensors(self, names: Sequence[str]) -> list[torch.Tensor]:
        """M:N: this rank's part of each tensor (as `holdings` states it), live, never gathered."""
        return self.tensors(names)

    def held_bytes(self) -> int:
        """Memory the source keeps for refits beyond the trainer's own tensors (a stage's copies), predicted."""
        return 0

    def held_tensors(self) -> list[torch.Tensor]:
        """The tensors behind `held_bytes` that exist now (what a memory probe measures)."""
        return []


class WireDtypes:
    """The wire-dtype rule shared by sources: one default for floating tensors, plus per-name overrides."""

    _tensors: dict[str, torch.Tensor]

    def _init_wire(self, wire_dtype: torch.dtype | None, overrides: Mapping[str, torch.dtype] | None) -> None:
        if wire_dtype is not None:
            dtype_name(wire_dtype)
        self.wire_dtype = wire_dtype
        self._overrides: dict[str, torch.dtype] = {}
        for name, dtype in (overrides or {}).items():
            self.set_wire_dtype(name, dtype)

    def set_wire_dtype(self, name: str, dtype: torch.dtype | None) -> None:
        """Send `name` as `dtype` from the next refit on (None: back to the default rule)."""
        if name not in self._tensors:
            raise ValueError(f"no tensor named {name!r} in this source")
        if dtype is None:
            self._overrides.pop(name, None)
        else:
            dtype_name(dtype)
            self._overrides[name] = dtype

    def _wire(self, name: str, t: torch.Tensor) -> torch.dtype:
        if name in self._overrides:
            return self._overrides[name]
        if self.wire_dtype is not None and t.is_floating_point():
            return self.wire_dtype
        return t.dtype

    def specs(self) -> list[TensorSpec]:
        """One spec per distinct tensor; names sharing storage and view (tied weights) become aliases."""
        items = list(self._tensors.items())
        starts = [_address(t) for _, t in items]
        shared = {a for a, k in Counter(starts).items() if k > 1}  # only these can be aliases: look closer
        groups: dict[Hashable, list[str]] = {}
        for (n, t), start in zip(items, starts):
            key = alias_key(n, t, self._wire(n, t)) if start in shared else n
            groups.setdefault(key, []).append(n)
        out = []
        for names in groups.values():
            names.sort()
            t = self._tensors[names[0]]
            out.append(TensorSpec(names[0], tuple(t.shape), self._wire(names[0], t), tuple(names[1:])))
        return out

    def signature(self) -> Hashable:
        return (
            tuple((t.dtype, t.shape) for t in self._tensors.values()),
            tuple(sorted(self._overrides.items(), key=str)),
        )


def _address(t: torch.Tensor) -> int:
    """Where the (local) data starts: equal for aliases, so a cheap first filter (empty shards all give 0)."""
    return getattr(t, "_local_tensor", t).data_ptr()


def alias_key(name: str, t: torch.Tensor, wire: torch.dtype) -> Hashable:
    """Equal for two names only when they are one tensor on the wire: same storage, same view, same wire dtype.
    Different views of one flat buffer are not aliases; neither are empty tensors.

    Keyed by the storage's identity and the view's place in it (offset, strides, shape), never by a data
    pointer: an empty DTensor shard has a null one, and on every rank the key must find the same aliases."""
    local = getattr(t, "_local_tensor", t)  # a DTensor: its shard's storage identifies it
    if t.numel() == 0:
        return name
    storage = local.untyped_storage()._cdata  # the storage object itself, also for empty or meta storage
    view = (local.storage_offset(), local.stride(), tuple(local.shape))
    return (local.device, storage, view, t.dtype, tuple(t.shape), wire)
