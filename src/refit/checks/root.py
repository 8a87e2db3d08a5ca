"""Root: one digest over a version's per-tensor fingerprints, a Merkle root in manifest order.

A tensor's leaf is its fingerprint (the 8 bytes of its 16-hex-digit digest, `refit.topology.digest_plan`);
an internal node is BLAKE2b-128 of a marker byte and its two children; a level of odd length carries its
last node up unchanged. One wrong tensor changes the root, and a proof that a tensor belongs to a root is
the path of sibling nodes from its leaf up. Leaves (8 bytes) and nodes (16 bytes) differ in length and nodes
are hashed with their own marker, so a node can never pass for a leaf.

The trainer folds the digests it sends each receiver; an engine folds those of what it holds
(`held_leaves`). Equal roots for one version: the replica holds the trainer's bytes, tensor for tensor.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence

import torch

from refit.checks.manifest_check import waived
from refit.checks.tensor_digest import Pending

NODE = b"\x01"
UNREADABLE = "0" * 16
"""The leaf of a name an engine cannot read back: its root then differs from the trainer's (unproven)."""


def _node(left: bytes, right: bytes) -> bytes:
    return hashlib.blake2b(NODE + left + right, digest_size=16).digest()


def _leaf(fingerprint: str) -> bytes:
    if len(fingerprint) != 16:
        raise ValueError(f"a leaf is a 16-hex-digit fingerprint, not {fingerprint!r}")
    return bytes.fromhex(fingerprint)


def _up(level: list[bytes]) -> list[bytes]:
    out = [_node(level[i], level[i + 1]) for i in range(0, len(level) - 1, 2)]
    if len(level) % 2:
        out.append(level[-1])
    return out


def root(leaves: Sequence[str]) -> str:
    """The Merkle root of `leaves` (fingerprints in manifest order), as hex; the empty string for none."""
    level = [_leaf(f) for f in leaves]
    if not level:
        return ""
    while len(level) > 1:
        level = _up(level)
    return level[0].hex()


def proof(leaves: Sequence[str], index: int) -> list[str]:
    """The path proving that `leaves[index]` belongs to `root(leaves)`: the sibling at each level, bottom up
    (levels where the node has none, the carried last node, are skipped)."""
    if not 0 <= index < len(leaves):
        raise ValueError(f"index {index} is outside the {len(leaves)} leaves")
    level, path = [_leaf(f) for f in leaves], []
    while len(level) > 1:
        sibling = index ^ 1
        if sibling < len(level):
            path.append(level[sibling].hex())
        level, index = _up(level), index // 2
    return path


def verify_proof(root_hex: str, leaf: str, index: int, path: Sequence[str], num_leaves: int) -> bool:
    """Whether `leaf`, at `index` of `num_leaves` leaves, belongs to the root `root_hex` through `path`."""
    if not 0 <= index < num_leaves:
        return False
    try:
        node, steps = _leaf(leaf), [bytes.fromhex(p) for p in path]
    except ValueError:
        return False
    width = num_leaves
    while width > 1:
        if index ^ 1 < width:
            if not steps:
                return False
            sibling = steps.pop(0)
            node = _node(node, sibling) if index % 2 == 0 else _node(sibling, node)
        index, width = index // 2, (width + 1) // 2
    return not steps and node.hex() == root_hex


def held_leaves(names: Sequence[str], held: Sequence[torch.Tensor | None], wire: Sequence[torch.dtype]) -> list[str]:
    """An engine's leaves: the digest of each held tensor cast to its wire dtype (`UNREADABLE` for None)."""
    pending = Pending()
    where = [i for i, t in enumerate(held) if t is not None]
    with torch.no_grad():
        pending.add([held[i].to(wire[i]) for i in where])  # type: ignore[union-attr]
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
