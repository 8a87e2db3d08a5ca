"""sharded_refit: the per-refit call every FSDP2 trainer rank makes (rank 0 refits, the others follow its gathers)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from refit.sources.fsdp import FsdpSource

if TYPE_CHECKING:
    from refit.topology.sender import Sender
    from refit.topology.stats import RefitStats


def sharded_refit(source: FsdpSource, sender: Sender | None, version: int) -> RefitStats | None:
    """Call on every trainer rank: rank 0 (which holds `sender`) refits, the others follow its gathers.
    Unless set, the gather budget is the bucket capacity the Sender agreed with its receivers."""
    if source.rank == 0:
        with source.leading():
            if source.gather_bytes is None:
                sender.connect()
                source.gather_bytes = sender.capacity
                source.begin()
            return sender.refit(version)
    source.follow()
    return None
