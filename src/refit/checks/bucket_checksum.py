"""Integrity: a cheap per-bucket checksum computed where the bytes live (host or device)."""

from __future__ import annotations

import torch

_MASK = (1 << 64) - 1
_LANES = 32


def checksum(buf: torch.Tensor) -> int:
    """A 64-bit checksum of a uint8 buffer whose length is a multiple of 256.

    Two wrapping 64-bit sums: the plain sum of all words (catches any single flipped bit) and a sum
    of per-lane totals times odd weights (catches words moved between lanes). Runs as two reductions
    on the buffer's own device.
    """
    if buf.numel() % (8 * _LANES):
        raise ValueError(f"checksum needs a length that is a multiple of {8 * _LANES}, got {buf.numel()}")
    words = buf.view(torch.int64).view(-1, _LANES)
    lanes = words.sum(dim=0)
    weights = torch.arange(1, 2 * _LANES, 2, dtype=torch.int64, device=buf.device) * 0x9E3779B1
    total = int(lanes.sum()) & _MASK
    mixed = int((lanes * weights).sum()) & _MASK
    return (total ^ (mixed * 0x100000001B3)) & _MASK
