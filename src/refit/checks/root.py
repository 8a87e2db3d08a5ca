"""Root: one digest over a version's per-tensor fingerprints, a Merkle root in manifest order.

A tensor's leaf is its fingerprint (the 64-bit digest `refit.topology.digest_plan` sends as 16 hex digits). A node
is two 64-bit lanes: a leaf's are its fingerprint and a mix of it; a parent's lane j is
`mix(left_j * P_j + mix(right_j ^ S_j))`, where `mix` is SplitMix64's finalizer (a bijection of 64-bit words) and
P_j odd, so a change of either child changes each lane, and swapping two children changes it too. A level of
odd length carries its last node up unchanged. The root is the last node's two lanes, 32 hex digits. A proof
that a tensor belongs to a root is the path of sibling nodes from its leaf up.

Like the digests it folds, it is a check against mistakes, not against an adversary: each level is a few
vector operations over 64-bit words, so the fold of 10,000 fingerprints costs about a millisecond.
The trainer folds the digests it sends each receiver; an engine folds those of what it holds
(`held_leaves`). Equal roots for one version: the replica holds the trainer's bytes, tensor for tensor.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import torch

from refit.checks.copy_digest import prepared_digests
from refit.checks.manifest_check import waived
from refit.checks.tensor_digest import Pending

UNREADABLE = "0" * 16
"""The leaf of a name an engine cannot read back: its root then differs from the trainer's (unproven)."""


_P = np.array([0x9E3779B97F4A7C15, 0xD6E8FEB86659FD93], dtype=np.uint64)
_S = np.array([0x2545F4914F6CDD1D, 0xA0761D6478BD642F], dtype=np.uint64)
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_K = (np.uint64(30), np.uint64(27), np.uint64(31))


def _mix(z: np.ndarray) -> np.ndarray:
    """SplitMix64's finalizer, element-wise on uint64 words (wrapping)."""
    z = (z ^ (z >> _K[0])) * _M1
    z = (z ^ (z >> _K[1])) * _M2
    return z ^ (z >> _K[2])


def _node(left: np.ndarray, right: np.ndarray) -> np.ndarray:
    """Parents of (n, 2) lanes `left` and `right`, row by row (both lanes at once)."""
    return _mix(left * _P + _mix(right ^ _S))


def _leaves(fingerprints: Sequence[str]) -> np.ndarray:
    """(n, 2) lanes of 16-hex-digit fingerprints."""
    text = "".join(fingerprints)
    if len(text) != 16 * len(fingerprints):
        raise ValueError("a leaf is a 16-hex-digit fingerprint; got one of another length")
    try:
        words = np.frombuffer(bytes.fromhex(text), dtype=">u8").astype(np.uint64)
    except ValueError:
        raise ValueError("a leaf is a 16-hex-digit fingerprint; got one that is not hex") from None
    return np.stack([words, _mix(words ^ _S[1])], 1)


def _hex(node: np.ndarray) -> str:
    return node.astype(">u8").tobytes().hex()


def _unhex(text: str) -> np.ndarray:
    if len(text) != 32:
        raise ValueError(f"a node is 32 hex digits, not {text!r}")
    return np.frombuffer(bytes.fromhex(text), dtype=">u8").astype(np.uint64)


def _up(level: np.ndarray) -> np.ndarray:
    pairs = level.shape[0] // 2
    up = _node(level[0 : 2 * pairs : 2], level[1 : 2 * pairs : 2])
    return np.concatenate([up, level[-1:]]) if level.shape[0] % 2 else up


def root(leaves: Sequence[str]) -> str:
    """The Merkle root of `leaves` (fingerprints in manifest order), as 32 hex digits; the empty string for none."""
    if not leaves:
        return ""
    level = _leaves(leaves)
    while level.shape[0] > 1:
        level = _up(level)
    return _hex(level[0])


def proof(leaves: Sequence[str], index: int) -> list[str]:
    """The path proving that `leaves[index]` belongs to `root(leaves)`: the sibling at each level, bottom up
    (levels where the node has none, the carried last node, are skipped)."""
    if not 0 <= index < len(leaves):
        raise ValueError(f"index {index} is outside the {len(leaves)} leaves")
    level, path = _leaves(leaves), []
    while level.shape[0] > 1:
        sibling = index ^ 1
        if sibling < level.shape[0]:
            path.append(_hex(level[sibling]))
        level, index = _up(level), index // 2
    return path


def verify_proof(root_hex: str, leaf: str, index: int, path: Sequence[str], num_leaves: int) -> bool:
    """Whether `leaf`, at `index` of `num_leaves` leaves, belongs to the root `root_hex` through `path`."""
    if not 0 <= index < num_leaves:
        return False
    try:
        node, steps = _leaves([leaf])[0], [_unhex(p) for p in path]
    except ValueError:
        return False
    width = num_leaves
    while width > 1:
        if index ^ 1 < width:
            if not steps:
                return False
            sibling = steps.pop(0)
            pair = (node, sibling) if index % 2 == 0 else (sibling, node)
            node = _node(pair[0][None], pair[1][None])[0]
        index, width = index // 2, (width + 1) // 2
    return not steps and _hex(node) == root_hex.lower()


def held_leaves(names: Sequence[str], held: Sequence[torch.Tensor | None], wire: Sequence[torch.dtype]) -> list[str]:
    """An engine's leaves: the digest of each held tensor cast to its wire dtype (`UNREADABLE` for None)."""
    pending = Pending()
    where = [i for i, t in enumerate(held) if t is not None]
    with torch.no_grad():
        views = [held[i].to(wire[i]) for i in where]  # type: ignore[union-attr]
        on_cpu = views and all(v.device.type == "cpu" for v in views)
        run = prepared_digests(views) if on_cpu else None  # the CPU kernel reads each once, no copy
        if run is not None:
            pending.add_digests(run())
        else:
            pending.add(views)
    out = [UNREADABLE] * len(names)
    for i, h in zip(where, pending.hexes()):
        out[i] = h
    return out


def verified_root(
    names: Sequence[str], digests: Sequence[str], unverified: Iterable[str], optional: frozenset[str] = frozenset()
) -> str:
    """A receiver's root once its fingerprint check passed: the trainer's digests it matched, with the
    `UNREADABLE` leaf for each name left unverified or waived (`optional`), as `refit.engines.root` reads them."""
    leaves = [d.lower() for d in digests]
    skip = set(unverified) | ({n for n in names if waived(n, optional)} if optional else set())
    if skip:
        leaves = [UNREADABLE if n in skip else d for n, d in zip(names, leaves)]
    return root(leaves)


def roots(payloads: Mapping[int, Sequence[str]]) -> dict[int, str]:
    """The trainer's root per receiver rank, from the digests it sends each (one fold per distinct list)."""
    seen: dict[tuple[str, ...], str] = {}
    out = {}
    for rank, digests in payloads.items():
        key = tuple(digests)
        if key not in seen:
            seen[key] = root(digests)
        out[rank] = seen[key]
    return out
