"""Source: the trainer-side weights to send, with their wire dtypes, read without materialising."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Hashable, Mapping, Sequence

import torch
from torch import nn

from refit.spec import TensorSpec, dtype_name


class Source(ABC):
    """What a Sender reads from: specs up front, tensors per bucket."""

    stable_tensors: bool = True
    """True when `tensors` returns the same long-lived tensors every refit (so copy plans may be cached);
    False when it materialises fresh ones (gathers), which must be dropped after each bucket."""

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
        return [TensorSpec(n, tuple(t.shape), self._wire(n, t)) for n, t in self._tensors.items()]

    def signature(self) -> Hashable:
        return (tuple((t.dtype, t.shape) for t in self._tensors.values()), tuple(sorted(self._overrides.items(), key=str)))


class ModuleSource(WireDtypes, Source):
    """A plain module or state dict. Holds references, so in-place optimizer steps need no re-read."""

    def __init__(
        self,
        weights: nn.Module | Mapping[str, torch.Tensor],
        *,
        wire_dtype: torch.dtype | None = None,
        overrides: Mapping[str, torch.dtype] | None = None,
    ) -> None:
        """`wire_dtype` casts every floating tensor (e.g. fp32 master weights sent as bf16);
        `overrides` sets the wire dtype of single tensors (e.g. keep a router bias in fp32)."""
        items = weights.state_dict(keep_vars=True) if isinstance(weights, nn.Module) else weights
        self._tensors: dict[str, torch.Tensor] = dict(items)
        self._init_wire(wire_dtype, overrides)

    def signature(self) -> Hashable:
        # Reading .shape costs ~2 us a tensor (a new torch.Size); dtype, byte size and storage address
        # are ~0.1 us and change whenever a tensor is replaced. The Sender compares full specs only
        # when this changes.
        return (tuple((t.dtype, t.nbytes, t.data_ptr()) for t in self._tensors.values()),
                tuple(sorted(self._overrides.items(), key=str)))  # fmt: skip

    def tensors(self, names: Sequence[str]) -> list[torch.Tensor]:
        return [self._tensors[n] for n in names]
