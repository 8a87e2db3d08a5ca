"""Verify: bitwise fingerprints of weights, to compare what a trainer sent with what an engine holds."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping

import torch


def fingerprint(t: torch.Tensor, wire: torch.dtype) -> str:
    """Hash of `t`'s bytes as `wire` dtype; marked lossy if `t` holds values `wire` cannot represent."""
    t = t.detach().cpu().contiguous()
    as_wire = t.to(wire)
    h = hashlib.blake2b(as_wire.reshape(-1).view(torch.uint8).numpy().tobytes(), digest_size=16).hexdigest()
    exact = torch.equal(as_wire.to(t.dtype).view(torch.uint8), t.view(torch.uint8)) if t.dtype != wire else True
    return h if exact else "lossy:" + h


def fingerprints(tensors: Iterable[tuple[str, torch.Tensor]], wire: Mapping[str, torch.dtype]) -> dict[str, str]:
    """Fingerprint of every named tensor in the wire dtype the manifest gave it."""
    return {name: fingerprint(t, wire[name]) for name, t in tensors}


def differences(expected: Mapping[str, str], got: Mapping[str, str]) -> list[str]:
    """Sorted names whose fingerprints differ or are missing on either side."""
    return sorted(n for n in expected.keys() | got.keys() if expected.get(n) != got.get(n))
