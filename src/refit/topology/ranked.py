"""RankedRefit: per-rank colocated refit. Every trainer rank runs its own Sender, feeding the engine
worker on its own device; a version commits only when every worker committed.

Trainer side, on every rank (each call is collective over the trainer's group):

    ranked = RankedRefit(FsdpSource(model) or ModuleSource(model), transport="cuda-ipc")
    infos = ranked.rendezvous()     # every rank's rendezvous in rank order, each naming its GPU's UUID
    ranked.refit(version)

Engine side, worker i: `Receiver(engine, pick(infos, device, index=i))`: the rendezvous of the
trainer rank on the worker's own GPU (by UUID, whatever each process's CUDA_VISIBLE_DEVICES).

The commit is two-phase across the ranks. Each Sender streams its buckets and its receiver commits
locally, answering DONE; the ranks then agree in one all-reduce whether every worker committed, and
each Sender tells its receivers the verdict, which they wait for before returning. A failure on any
worker (or any rank's Sender) leaves every worker 'failed'; a retry of the same version restores them.
A rank whose refit broke off still takes part in the remaining gathers and in the vote, so the other
ranks never hang on it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from refit.dtypes import dtype_name
from refit.errors import PeerError, RefitError
from refit.layout.manifest import Manifest
from refit.layout.planner import plan
from refit.log import get_logger
from refit.settings import Settings
from refit.sources.base import Source
from refit.sources.fsdp import FsdpSource
from refit.topology.collective import Collective
from refit.topology.options import SenderOptions
from refit.topology.policies import Commit
from refit.topology.sender import Sender
from refit.topology.stats import RefitStats
from refit.transports import device as devices

NO_LIMIT = 1 << 62


def departed(error: Exception, worker: str, *, elastic: bool = False) -> Exception:
    """A lost peer in a per-rank or M:N refit, said as such: its shard has no other holder, so the refit
    fails on every worker (they keep their last committed weights, state 'failed')."""
    if not isinstance(error, PeerError) or "broke earlier" in str(error):
        return error
    then = (
        "start a replacement under the same worker index: the next refit waits for it"
        if elastic
        else "restart that worker and start a new session"
    )
    out = PeerError(
        f"{worker} departed or failed ({error}); its shard has no other holder, so this refit fails on every "
        f"worker (they report state 'failed'); {then}"
    )
    out.__cause__ = error
    return out


def pick(rendezvous: Sequence[dict] | dict, device: torch.device, *, index: int) -> dict:
    """Worker `index`'s rendezvous out of every trainer rank's: the one on this worker's GPU (by UUID),
    or, for CPU workers, the one at `index`. A single dict is returned as is (one Sender for all)."""
    if isinstance(rendezvous, dict):
        return rendezvous
    uuids = [r.get("device_uuid") for r in rendezvous]
    if device.type == "cuda" and any(uuids):
        own = devices.uuid(device)
        for r in rendezvous:
            if r.get("device_uuid") == own:
                return r
        raise ValueError(
            f"no trainer rank is on this worker's GPU ({own}); trainer ranks are on {uuids}. "
            "Per-rank colocated refit needs every engine worker on a trainer rank's GPU"
        )
    if not 0 <= index < len(rendezvous):
        raise ValueError(f"worker index {index} is out of range for {len(rendezvous)} trainer ranks")
    return rendezvous[index]


class RankedRefit:
    """Drives one trainer rank's Sender in a per-rank refit; call every method on every rank."""

    def __init__(
        self,
        source: Source,
        options: SenderOptions | None = None,
        *,
        group: dist.ProcessGroup | None = None,
        settings: Settings | None = None,
        device: torch.device | None = None,
        **overrides: Any,
    ) -> None:
        """This rank's Sender, built here with the vote across trainer ranks as its commit policy: `options`
        (SenderOptions, or any of them as keyword arguments: transport, verify, elastic, ...) are its own."""
        if isinstance(source, Sender):
            raise ValueError(
                "RankedRefit builds its rank's Sender itself (its commit is the vote across ranks): pass the source "
                "and the Sender's options, e.g. RankedRefit(FsdpSource(model), transport='cuda-ipc')"
            )
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self._device = (
            torch.device("cuda", torch.cuda.current_device())
            if dist.get_backend(group) == "nccl"
            else torch.device("cpu")
        )
        self._collective = Collective(group)
        o = SenderOptions.of(options, overrides)
        commit = Commit(strict=o.verify == "strict", vote=self._vote)
        self.sender = Sender(source, o, settings=settings, device=device, commit=commit)
        self._agreed = False
        self._voted = False
        self._infos: list[dict] | None = None
        self.gather_into_buckets = True
        """Gather along the buckets, straight into the bucket buffers, when every rank has one layout."""
        self._cached: tuple = ((), None, 0)
        self.log = get_logger("sender", self.rank)

    @property
    def num_receivers(self) -> int:
        """Engine workers fed in all (one per trainer rank), as drivers such as VllmRefit check."""
        return self.world

    @property
    def _elastic(self) -> bool:
        return self.sender.options.elastic

    @property
    def settings(self) -> Settings:
        return self.sender.settings

    @property
    def source(self) -> Source:
        """This rank's source (what drivers such as VllmRefit read names from, as from a Sender's)."""
        return self.sender.source

    def rendezvous(self) -> list[dict]:
        """Every rank's rendezvous, in rank order, each with its trainer rank and device UUID.
        Collective the first time; later calls (on any rank) return the same list."""
        if self._infos is None:
            own = {
                **self.sender.rendezvous(),
                "trainer_rank": self.rank,
                "device_uuid": devices.uuid(self.sender.device),
            }
            self._infos = self._all_gather_json(own)
        return self._infos

    def connect(self) -> None:
        """Accept this rank's worker(s) and agree on the gather budget (collective; the first refit does it too)."""
        self._agree()

    def refit(self, version: int) -> RefitStats:
        """Refit every worker to `version`; returns this rank's stats once every worker committed."""
        source = self.sender.source
        gathers = isinstance(source, FsdpSource)
        error: Exception | None = None
        stats = None
        self._voted = False
        try:
            self._agree()
        except RefitError as e:
            error = e
        if gathers:
            source.begin(layout=self._layout(), sender=self.sender)
        try:
            if error is None:
                stats = self._refit(version)
        except Exception as e:  # noqa: BLE001 - whatever broke this rank's refit, the other ranks wait for its vote
            error = departed(e, f"the engine worker of trainer rank {self.rank}", elastic=self._elastic)
        finally:
            if gathers:
                source.end(drain=True)
        if not self._voted:  # this rank's refit broke off before its Sender's vote: vote for it
            self._vote(f"{type(error).__name__}: {error}" if error is not None else "")
        if error is not None:
            raise error
        assert stats is not None
        return stats

    def _refit(self, version: int) -> RefitStats:
        """This rank's Sender's refit. An elastic Sender first waits (up to the connect timeout) for its worker:
        a replacement under the same worker index takes the place of one that departed."""
        sender = self.sender
        if not self._elastic:
            return sender.refit(version)
        if not sender.await_receivers(1, timeout_s=sender.settings.connect_timeout_s):
            raise PeerError(f"no engine worker of trainer rank {self.rank} is connected (none replaced the last)")
        stats = sender.refit(version)
        if not stats.receivers:  # no worker took part, so no vote was cast: the shard went nowhere
            raise PeerError(f"no engine worker of trainer rank {self.rank} is connected (none replaced the last)")
        return stats

    def _agree(self) -> None:
        """Once: connect, and agree on the gather budget (the smallest bucket capacity of any rank)."""
        if self._agreed:
            return
        self._agreed = True
        error, capacity = None, NO_LIMIT
        try:
            self.sender.connect()
            capacity = self.sender.capacity
        except RefitError as e:
            error = e
        t = torch.tensor([capacity], dtype=torch.int64, device=self._device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        source = self.sender.source
        if isinstance(source, FsdpSource) and source.gather_bytes is None:
            source.gather_bytes = int(t.item()) if int(t.item()) < NO_LIMIT else None
        if error is not None:
            raise error

    def _layout(self) -> Manifest | None:
        """This refit's bucket layout when every rank has the same one (same specs and capacity), else None.
        Collective (one all-reduce); the layout is planned again only when the source's signature moves."""
        source, capacity = self.sender.source, self.sender.capacity
        key = (source.signature(), capacity)
        if key != self._cached[0]:
            specs = source.specs()
            layout = plan(specs, capacity=capacity) if capacity and self.gather_into_buckets else None
            text = json.dumps(
                [capacity, sorted([s.name, list(s.shape), dtype_name(s.dtype), list(s.aliases)] for s in specs)]
            )
            digest = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=7).digest(), "big")
            self._cached = (key, layout, digest if layout is not None else -1)
        _, layout, digest = self._cached
        t = torch.tensor([digest, -digest], dtype=torch.int64, device=self._device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return layout if digest >= 0 and int(t[0].item()) == -int(t[1].item()) == digest else None

    def _vote(self, own: str) -> str:
        """Phase two: '' when every rank's workers committed, else every failing rank's reason."""
        self._voted = True
        return self._collective.vote(own)

    def _all_gather_json(self, obj: object) -> list:
        return self._collective.all_gather_json(obj)

    def close(self) -> None:
        self.sender.close()
