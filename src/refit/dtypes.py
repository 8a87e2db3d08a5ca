"""Dtypes: the names torch dtypes go by on the wire, and which casts keep every value."""

from __future__ import annotations

import torch

DTYPES: dict[str, torch.dtype] = {
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
        DTYPES[_name] = getattr(torch, _name)
NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}

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
        return NAMES[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} cannot go on the wire; supported: {', '.join(sorted(DTYPES))}") from None


def dtype_from_name(name: str) -> torch.dtype:
    """The torch dtype for a wire name."""
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown wire dtype {name!r}; supported: {', '.join(sorted(DTYPES))}") from None


def lossless(wire: torch.dtype, held: torch.dtype) -> bool:
    """True when a tensor sent as `wire` can be held as `held` with every value unchanged."""
    return wire == held or (wire, held) in _LOSSLESS
