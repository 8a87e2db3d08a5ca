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
