"""PieceSource: what one trainer rank sends one engine worker in an M:N refit, as a Source of its own.

Each move of the reshard plan (`refit.layout.reshard`) is one box of one tensor: a view of the rank's
live local part (never gathered, never copied before packing). The pair's manifest names the box
`<tensor>@<offsets>` (where it lands in the worker's local part) with the box's shape, so the pair
runs the ordinary protocol: handshake, buckets, fingerprint and commit, over any transport.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence

import torch

from refit.layout.reshard import Move, box, piece_name
from refit.layout.spec import TensorSpec
from refit.sources.base import Source


class PieceSource(Source):
    """The boxes one rank moves to one worker, cut live from `base.local_tensors`: again every refit, or,
    where the base's signature covers every tensor's layout, again whenever that signature moved."""

    stable_tensors = True

    def __init__(
        self,
        base: Source,
        moves: Sequence[Move],
        wire: Mapping[str, torch.dtype],
        plan_digest: bytes,
        names: Mapping[str, Sequence[str]] | None = None,
    ) -> None:
        """`moves`: the plan's moves of this (rank, worker) pair; `wire`: each tensor's wire dtype; `names`:
        the worker's names for a tensor where they differ (a tensor the engine holds twice, untied)."""
        self.base = base
        self.plan_digest = plan_digest
        names = names or {}
        self._by_piece = {piece_name(n, m.dst_at): m for m in moves for n in names.get(m.name, [m.name])}
        self._specs = sorted(
            (TensorSpec(p, m.shape, wire[m.name]) for p, m in self._by_piece.items()), key=lambda s: s.name
        )
        self.signature_covers_layout = base.signature_covers_layout
        self.base_signature: Hashable = None
        """Set by MeshRefit once per refit (one read of the base for all pairs)."""
        self._views: tuple[Hashable, tuple[str, ...], list[torch.Tensor]] | None = None

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self._specs)

    def specs(self) -> list[TensorSpec]:
        return list(self._specs)

    @property
    def lookup_only(self) -> bool:
        return self.base.signature_covers_layout and self.base.lookup_only

    def signature(self) -> Hashable:
        base = self.base_signature if self.base_signature is not None else self.base.signature()
        return (self.plan_digest, base)

    def tensors(self, names: Sequence[str]) -> list[torch.Tensor]:
        key = tuple(names)
        hit = self._views
        if self.lookup_only and hit is not None and hit[0] is self.base_signature and hit[1] == key:
            return hit[2]  # the base vouches that no tensor moved: the same views
        moves = [self._by_piece[n] for n in names]
        locals_ = self.base.local_tensors([m.name for m in moves])
        views = [box(t, m.src_at, m.shape) for t, m in zip(locals_, moves)]
        self._views = (self.base_signature, key, views) if self.base_signature is not None else None
        return views
