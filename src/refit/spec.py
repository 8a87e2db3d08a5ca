"""TensorSpec: one tensor's name, shape and wire dtype, and the dtype names used on the wire."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

_DTYPES: dict[str, torch.dtype] = {
    "bool": torch.bool,
    "uint8": torch.uint8,
    "int8": torch.int8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
}
for _name in ("float8_e4m3fn", "float8_e5m2"):
    if hasattr(torch, _name):
        _DTYPES[_name] = getattr(torch, _name)
_NAMES: dict[torch.dtype, str] = {v: k for k, v in _DTYPES.items()}

# Casts that keep every value exactly, so an engine may hold a wider dtype than the wire carries.
_LOSSLESS: set[tuple[torch.dtype, torch.dtype]] = {
    (torch.bfloat16, torch.float32),
    (torch.float16, torch.float32),
    (torch.bfloat16, torch.float64),
    (torch.float16, torch.float64),
    (torch.float32, torch.float64),
}


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of a torch dtype."""
    try:
        return _NAMES[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} cannot go on the wire; supported: {sorted(_DTYPES)}") from None


def dtype_from_name(name: str) -> torch.dtype:
    """The torch dtype for a wire name."""
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown wire dtype {name!r}; supported: {sorted(_DTYPES)}") from None


def lossless(wire: torch.dtype, held: torch.dtype) -> bool:
    """True when a tensor sent as `wire` can be held as `held` with every value unchanged."""
    return wire == held or (wire, held) in _LOSSLESS


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
        if self.dtype not in _NAMES:
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
