"""TensorSpec: one tensor's name, shape and wire dtype."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from refit.dtypes import NAMES, dtype_name


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """What a tensor looks like on the wire."""

    name: str
    """Name as the sender calls it (the engine may map it)."""
    shape: tuple[int, ...]
    """Global shape."""
    dtype: torch.dtype
    """Wire dtype: what the bytes in the bucket are."""
    aliases: tuple[str, ...] = ()
    """Other names of the same tensor (same storage and view, e.g. tied embeddings): sent once, loaded under each."""
    nbytes: int = field(init=False, repr=False, compare=False)
    """Bytes on the wire (computed once: manifests of 100k tensors read it many times)."""

    def __post_init__(self) -> None:
        if not self.name or (self.aliases and not all(self.aliases)):
            raise ValueError("a tensor spec needs non-empty names")
        if self.shape and min(self.shape) < 0:
            raise ValueError(f"tensor {self.name!r} has a negative dimension in shape {self.shape}")
        if self.dtype not in NAMES:
            dtype_name(self.dtype)
        object.__setattr__(self, "nbytes", math.prod(self.shape) * self.dtype.itemsize)

    @classmethod
    def checked(cls, name: str, shape: tuple[int, ...], dtype: torch.dtype, nbytes: int) -> TensorSpec:
        """A spec whose fields the caller has already checked as `__post_init__` would (a manifest parser
        checking 100k entries column by column): skips the per-spec checks, not the frozen fields."""
        spec = _new(cls)
        _set_name(spec, name)
        _set_shape(spec, shape)
        _set_dtype(spec, dtype)
        _set_aliases(spec, ())
        _set_nbytes(spec, nbytes)
        return spec

    @property
    def names(self) -> tuple[str, ...]:
        """The name and every alias."""
        return (self.name, *self.aliases)

    def expanded(self) -> list[TensorSpec]:
        """One alias-free spec per name, for validation against an engine."""
        if not self.aliases:
            return [self]
        return [TensorSpec(n, self.shape, self.dtype) for n in self.names]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor, dtype: torch.dtype | None = None) -> TensorSpec:
        """The spec of `tensor` sent as `dtype` (its own dtype by default); reads metadata only."""
        return cls(name, tuple(tensor.shape), dtype or tensor.dtype)


_new = object.__new__
_set_name, _set_shape, _set_dtype, _set_aliases, _set_nbytes = (
    TensorSpec.__dict__[f].__set__ for f in ("name", "shape", "dtype", "aliases", "nbytes")
)


def changes(before: list[TensorSpec] | None, now: list[TensorSpec]) -> str:
    """The first few names whose spec differs between two layouts, as 'name: float32 (4, 4) -> float16 (4, 4)'."""
    was = {n: s for s in before or [] for n in s.names}
    out = []
    for spec in now:
        for n in spec.names:
            old = was.pop(n, None)
            if old is None or (old.shape, old.dtype) != (spec.shape, spec.dtype):
                out.append(f"{n}: {said(old)} -> {said(spec)}")
    out.extend(f"{n}: {said(old)} -> gone" for n, old in was.items())
    return "; ".join(out[:5]) + (f" and {len(out) - 5} more" if len(out) > 5 else "") or "aliases changed"


def said(spec: TensorSpec | None) -> str:
    """A spec's dtype and shape, as an error message names them."""
    return "absent" if spec is None else f"{str(spec.dtype).removeprefix('torch.')} {tuple(spec.shape)}"


@dataclass(frozen=True, slots=True)
class Slice:
    """The part of a tensor a holder keeps: `length` entries of dimension `dim` from `start`."""

    dim: int
    start: int
    length: int

    def __post_init__(self) -> None:
        if self.dim < 0 or self.start < 0 or self.length < 0:
            raise ValueError(f"a slice needs dim, start and length >= 0, not {self}")

    def to_json(self) -> list[int]:
        return [self.dim, self.start, self.length]
