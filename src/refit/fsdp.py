"""FsdpSource: a trainer sharded with FSDP2 (DTensor parameters) as the source, gathered bucket by bucket.

Every trainer rank holds an FsdpSource over its sharded module. Rank 0 runs the Sender; the other
ranks call `follow()` and take part in each bucket's gathers in the same order. Rank 0 announces
each bucket's gathers with a 3-integer broadcast (go, first tensor, count) over the trainer's group,
so the followers need no manifest and never wait on a refit that has ended or failed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from refit.manifest import Manifest
from refit.source import Source, WireDtypes


def _full(t: torch.Tensor) -> torch.Tensor:
    full = getattr(t, "full_tensor", None)
    return full() if callable(full) else t


class FsdpSource(WireDtypes, Source):
    """Specs from the DTensors' global shapes (nothing gathered); tensors gathered only per bucket."""

    stable_tensors = False

    def __init__(
        self,
        module: nn.Module,
        *,
        wire_dtype: torch.dtype | None = None,
        overrides: Mapping[str, torch.dtype] | None = None,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        self._tensors: dict[str, torch.Tensor] = dict(sorted(module.state_dict(keep_vars=True).items()))
        self._names = list(self._tensors)
        self._index = {n: i for i, n in enumerate(self._names)}
        self._init_wire(wire_dtype, overrides)
        self.group = group
        self.rank = dist.get_rank(group)
        self.peak_gathered_bytes = 0
        """Most bytes of gathered (full) tensors alive at once on this rank, for checking the budget."""
        self._live = 0

    def _control(self, go: int, first: int = 0, count: int = 0) -> tuple[int, int, int]:
        msg = torch.tensor([go, first, count], dtype=torch.int64)
        if dist.get_backend(self.group) == "nccl":
            msg = msg.cuda()
        dist.broadcast(msg, src=dist.get_global_rank(self.group, 0) if self.group else 0, group=self.group)
        go, first, count = (int(v) for v in msg.tolist())
        return go, first, count

    def _gather(self, names: Sequence[str]) -> list[torch.Tensor]:
        with torch.no_grad():
            out = [_full(self._tensors[n]) for n in names]
        self._live = sum(t.numel() * t.element_size() for t in out)
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, self._live)
        return out

    def tensors(self, names: Sequence[str]) -> list[torch.Tensor]:
        """Rank 0 (inside `leading()`): announce the gathers, then take part in them."""
        if self.rank != 0:
            raise ValueError("only trainer rank 0 sends; the other ranks call follow()")
        first = self._index[names[0]] if names else 0
        if list(names) != self._names[first : first + len(names)]:
            raise ValueError("FsdpSource gathers contiguous runs of tensors in name order (as the planner lays them)")
        self._control(1, first, len(names))
        return self._gather(names)

    @contextlib.contextmanager
    def leading(self) -> Iterator[None]:
        """Rank 0: wrap each Sender.refit so the followers are released however it ends."""
        try:
            yield
        finally:
            self._control(0)

    def follow(self) -> None:
        """Ranks other than 0: take part in one refit's gathers until rank 0 says it ended."""
        while True:
            go, first, count = self._control(0)
            if not go:
                return
            self._gather(self._names[first : first + count])

    def predicted_gather_bytes(self, manifest: Manifest) -> int:
        """Peak bytes of full tensors alive at once: the largest bucket's tensors in their training dtype."""
        own = {n: t.element_size() * t.numel() for n, t in self._tensors.items()}
        return max((sum(own[manifest.entries[s.entry].name] for s in segs) for segs in manifest.segments), default=0)


def sharded_refit(source: FsdpSource, sender, version: int):
    """Call on every trainer rank: rank 0 (which holds `sender`) refits, the others follow its gathers."""
    if source.rank == 0:
        with source.leading():
            return sender.refit(version)
    source.follow()
    return None
