"""Verify: bitwise fingerprints of weights, to compare what a trainer sent with what an engine holds."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping

import torch


def fingerprint(t: torch.Tensor, wire: torch.dtype, *, held: bool = False) -> str:
    """Hash of `t`'s bytes cast to `wire`, i.e. of what a sender puts on the wire.

    With `held=True` (an engine's copy) the hash is marked lossy when `t` holds values that `wire`
    cannot represent: then the engine holds something other than what was sent.
    """
    t = t.detach().cpu().contiguous()
    as_wire = t.to(wire)
    h = hashlib.blake2b(as_wire.reshape(-1).view(torch.uint8).numpy().tobytes(), digest_size=16).hexdigest()
    if held and t.dtype != wire and not torch.equal(as_wire.to(t.dtype).view(torch.uint8), t.view(torch.uint8)):
        return "lossy:" + h
    return h


def fingerprints(
    tensors: Iterable[tuple[str, torch.Tensor]], wire: Mapping[str, torch.dtype], *, held: bool = False
) -> dict[str, str]:
    """Fingerprint of every named tensor in the wire dtype the manifest gave it."""
    return {name: fingerprint(t, wire[name], held=held) for name, t in tensors}


def differences(expected: Mapping[str, str], got: Mapping[str, str]) -> list[str]:
    """Sorted names whose fingerprints differ or are missing on either side."""
    return sorted(n for n in expected.keys() | got.keys() if expected.get(n) != got.get(n))


_MIX = 0x9E3779B97F4A7C15 - (1 << 64)  # as a signed int64
_LANES = 1024
_ROW = 8 * _LANES


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """`t`'s bytes, flat, as a uint8 tensor whose start is 8-byte aligned (copied only when it must be)."""
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
    return raw if raw.data_ptr() % 8 == 0 else raw.clone()


def digest64(t: torch.Tensor) -> torch.Tensor:
    """A 0-d int64 tensor on `t`'s device summarising `t`'s bytes, position by position.

    The bytes are read as int64 words in rows of 1024 (the last row zero-padded); the digest mixes the
    1024 per-lane sums and the per-row sums with distinct odd weights, plus the byte length. Integer
    sums wrap identically on any device and in any reduction order, so a trainer's GPU and an
    engine's CPU agree bit for bit; a changed word changes the digest, and so do words moved to
    another lane or row (a transposed, shifted or stale layout). Two reading passes, no temporaries
    the size of the tensor.
    """
    raw = _bytes(t)
    whole = raw.numel() - raw.numel() % _ROW
    body = raw[:whole].view(torch.int64).view(-1, _LANES)
    tail = raw.new_zeros(_ROW)
    tail[: raw.numel() - whole] = raw[whole:]
    tail = tail.view(torch.int64).view(1, _LANES)
    lane_sums = body.sum(dim=0) + tail.sum(dim=0)
    row_sums = torch.cat([body.sum(dim=1), tail.sum(dim=1)])
    lanes = torch.arange(_LANES, dtype=torch.int64, device=raw.device) * _MIX + 1
    rows = torch.arange(row_sums.numel(), dtype=torch.int64, device=raw.device) * (_MIX ^ 0x5851F42D) + 3
    return (lane_sums * lanes).sum() + (row_sums * rows).sum() * 0x100000001B3 + raw.numel()
