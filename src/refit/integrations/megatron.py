"""megatron_refit: the per-refit call every model-parallel rank of a Megatron trainer makes (the leader
refits, the others follow)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from refit.sources.megatron import MegatronSource

if TYPE_CHECKING:
    from refit.topology.sender import Sender
    from refit.topology.stats import RefitStats


def megatron_refit(source: MegatronSource, sender: Sender | None, version: int) -> RefitStats | None:
    """Call on every model-parallel rank: the leader (which holds `sender`) refits, the others follow."""
    if source.rank == 0:
        if sender is None:
            raise ValueError("the model-parallel group's first rank must pass its Sender to megatron_refit")
        with source.leading():
            return sender.refit(version)
    source.follow()
    return None
