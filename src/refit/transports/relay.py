"""relay transport: gloo broadcast fanned out by site. The trainer broadcasts each bucket once to one relay per
site (the trunk group: the trainer and the relays); each relay sends it on to each member of its site over the
site's own gloo group while it receives the next bucket into its other slot. A site is what a receiver states
(`Receiver(..., site=...)`, or REFIT_SITE): the replicas behind one link; a receiver that states none is a site
of its own, so with no sites stated this is gloo's broadcast.

Relays only move bytes: each replica still checks its own tensors against the trainer's fingerprint, which
reaches it over its own authenticated channel, and a version commits fleet-wide as with any transport.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch.distributed as dist

from refit.errors import PeerError
from refit.log import get_logger
from refit.transports.base import Pending
from refit.transports.gloo import GlooTransport

log = get_logger("transports")

MAX_SITE_CHARS = 128


@dataclass(frozen=True, slots=True)
class Sites:
    """Who relays to whom: per site, its group ranks (its relay first, the lowest rank); sites in the order of
    their relays."""

    members: tuple[tuple[int, ...], ...]

    @classmethod
    def of(cls, stated: dict[int, str]) -> Sites:
        """Group ranks by the site each stated ('' is a site of its own)."""
        groups: dict[str, list[int]] = {}
        for rank in sorted(stated):
            groups.setdefault(stated[rank] or f"\0{rank}", []).append(rank)
        return cls(tuple(tuple(g) for g in groups.values()))

    @property
    def relays(self) -> tuple[int, ...]:
        return tuple(g[0] for g in self.members)

    def site_of(self, rank: int) -> int:
        for k, g in enumerate(self.members):
            if rank in g:
                return k
        raise PeerError(f"the relay plan names no site for group rank {rank}")

    def to_json(self) -> str:
        return json.dumps([list(g) for g in self.members])

    @classmethod
    def from_json(cls, raw: bytes, size: int) -> Sites:
        """The plan the trainer wrote into the group's store, checked: every rank 1..size-1 exactly once."""
        try:
            groups = json.loads(raw)
        except ValueError:
            groups = None
        ok = isinstance(groups, list) and bool(groups)
        ok = ok and all(isinstance(g, list) and g and all(type(r) is int for r in g) for g in groups)
        if not ok or sorted(r for g in groups for r in g) != list(range(1, size)):
            raise PeerError(f"the relay plan in the group's store is malformed: {raw[:200]!r}")
        return cls(tuple(tuple(g) for g in groups))


class _Relayed(Pending):
    """A relay's receive: the trunk broadcast, then the start of its sends on to the site's members."""

    def __init__(self, trunk: Pending, forward: Callable[[], None]) -> None:
        self._trunk, self._forward = trunk, forward

    def wait(self, timeout_s: float, interrupted: Callable[[], bool] | None = None) -> None:
        self._trunk.wait(timeout_s, interrupted)
        self._forward()


class _All(Pending):
    """Several transfers, done when each is."""

    def __init__(self, parts: list[Pending]) -> None:
        self._parts = parts

    def wait(self, timeout_s: float, interrupted: Callable[[], bool] | None = None) -> None:
        deadline = time.monotonic() + timeout_s
        for part in self._parts:
            part.wait(max(deadline - time.monotonic(), 1e-3), interrupted)


class _Whole(Pending):
    """A receive from the relay, waited in one piece: gloo closes the pair of a point-to-point receive whose wait
    times out, so it is never waited in slices (a dead relay closes the pair itself; a stalled one: the timeout)."""

    def __init__(self, pending: Pending) -> None:
        self._pending = pending

    def wait(self, timeout_s: float, interrupted: Callable[[], bool] | None = None) -> None:
        self._pending.wait(timeout_s)


class _Checked(Pending):
    """The trainer's broadcast, which fails once the group broke (`check` raises) even where its bytes left."""

    def __init__(self, pending: Pending, check: Callable[[], None]) -> None:
        self._pending, self._check = pending, check

    def wait(self, timeout_s: float, interrupted: Callable[[], bool] | None = None) -> None:
        self._check()
        self._pending.wait(timeout_s, interrupted)
        self._check()


class RelayTransport(GlooTransport):
    """Rank 0 is the trainer; ranks 1..n the receivers, each a relay (the lowest rank of its site) or a member."""

    name = "relay"

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.sites: Sites | None = None
        self._site_pg: dist.ProcessGroup | None = None
        """Relays and members: the site's group (its relay is rank 0); None for a site of one."""
        self._tag = 0
        """Inside a site: the tag of the next bucket sent on (relay) or received (member)."""
        self._broken = ""
        """Trainer: why a site lost this group's refits (a receiver of a shared site left); '' while none did."""
        self._forwards: dict[int, Pending] = {}
        """A relay's sends on to its site in flight, by slot: waited before the slot is received into again."""

    def _group(self, store: dist.Store) -> dist.ProcessGroup | None:  # type: ignore[override]
        """Trainer: read every receiver's site, write the plan, make the trunk. Receiver: state the site, read the
        plan, make the trunk (a relay) and the site's group. Each wait is bounded by REFIT_TIMEOUT."""
        timeout = datetime.timedelta(seconds=self._settings.timeout_s)
        key = f"{self._prefix}/site/"
        if self._rank == 0:
            ranks = range(1, self._size)
            self._wait(store, [key + str(r) for r in ranks], timeout, "every receiver to state its site")
            self.sites = Sites.of({r: store.get(key + str(r)).decode(errors="replace") for r in ranks})
            store.set(f"{self._prefix}/plan", self.sites.to_json())
            log.info("relay: %d site(s), relays %s", len(self.sites.members), list(self.sites.relays))
            return self._make(store, "trunk", 0, len(self.sites.members) + 1)
        site = self._settings.site[:MAX_SITE_CHARS]
        store.set(key + str(self._rank), site)
        self._wait(store, [f"{self._prefix}/plan"], timeout, "the trainer's relay plan")
        self.sites = sites = Sites.from_json(store.get(f"{self._prefix}/plan"), self._size)
        k = sites.site_of(self._rank)
        group = sites.members[k]
        if len(group) > 1:
            self._site_pg = self._make(store, f"site{k}", group.index(self._rank), len(group))
        return self._make(store, "trunk", k + 1, len(sites.members) + 1) if group[0] == self._rank else None

    def _wait(self, store: dist.Store, keys: list[str], timeout: datetime.timedelta, what: str) -> None:
        try:
            store.wait(keys, timeout)
        except Exception as e:  # noqa: BLE001 - the store raises torch's own error types
            raise PeerError(f"relay setup: gave up waiting for {what} after {timeout}: {e}") from None

    def _make(self, store: dist.Store, name: str, rank: int, size: int) -> dist.ProcessGroup:
        prefix, self._prefix = self._prefix, f"{self._prefix}/{name}"
        rank_, size_, self._rank, self._size = self._rank, self._size, rank, size
        try:
            return super()._group(store)
        finally:
            self._prefix, self._rank, self._size = prefix, rank_, size_

    @property
    def relays(self) -> bool:
        """This receiver relays to the rest of its site."""
        return self._rank > 0 and self.sites is not None and self._rank in self.sites.relays

    def send(self, slot: int, nbytes: int) -> Pending:
        assert self.sites is not None
        self._check()
        what = f"relay broadcast of {nbytes} bytes to {len(self.sites.relays)} relay(s)"
        return _Checked(self._broadcast(slot, nbytes, what), self._check)

    def left(self, rank: int) -> None:
        """A receiver left mid-refit: where it shared a site, the others of that site miss what it relayed or
        fail relaying to it, and wait for a new group (never for this refit's bytes)."""
        if self.sites is None or self._broken:
            return
        k = self.sites.site_of(rank)
        group = self.sites.members[k]
        if len(group) > 1:
            role = "the relay" if group[0] == rank else "a member"
            self._broken = f"group rank {rank}, {role} of a site of {len(group)}, left mid-refit"

    def _check(self) -> None:
        if self._broken:
            raise PeerError(f"the relay group broke: {self._broken}")

    def recv(self, slot: int, nbytes: int) -> Pending:
        if not self.relays:
            return self._in_site(slot, nbytes, f"relay receive of {nbytes} bytes from its site's relay")
        done = self._forwards.pop(slot, None)
        if done is not None:  # the slot's last bucket has left for the site before this one overwrites it
            done.wait(self._settings.timeout_s)
        trunk = self._broadcast(slot, nbytes, f"relay receive of {nbytes} bytes from the trainer")
        if self._site_pg is None:
            return trunk

        def forward() -> None:
            what = f"relay send of {nbytes} bytes on to its site"
            self._forwards[slot] = self._in_site(slot, nbytes, what)

        return _Relayed(trunk, forward)

    def _in_site(self, slot: int, nbytes: int, what: str) -> Pending:
        """Inside the site, the relay sends to each member itself (never gloo's tree, in which a member waits on
        another member: a relay's death must reach every member of its site at once, not at the timeout)."""
        pg = self._site_pg
        if pg is None or self.sites is None:
            raise PeerError(f"{self.name} transport is closed or was never set up")
        data, tag = [self.buffers[slot][:nbytes]], self._tag
        self._tag = (tag + 1) % (1 << 30)  # both ends count the buckets: each send meets its own receive
        try:  # a pair a dead peer closed refuses the operation at once
            if not self.relays:
                return _Whole(self._pending(pg.recv(data, 0, tag), what))
            size = len(self.sites.members[self.sites.site_of(self._rank)])
            return _All([self._pending(pg.send(data, m, tag), what) for m in range(1, size)])
        except RuntimeError as e:
            if isinstance(e, PeerError):
                raise
            raise PeerError(f"{what} failed: {e}; did the relay or a member of its site exit?") from None

    def _broadcast(self, slot: int, nbytes: int, what: str) -> Pending:
        try:
            return super()._broadcast(slot, nbytes, what)
        except RuntimeError as e:  # as above: PeerError is a RuntimeError too, and passes unchanged
            if isinstance(e, PeerError):
                raise
            raise PeerError(f"{what} failed: {e}; did a peer exit?") from None

    def flush(self) -> None:
        """A relay: every send on to its site it started is done (its site's members need them to commit)."""
        forwards, self._forwards = self._forwards, {}
        for pending in forwards.values():
            pending.wait(self._settings.timeout_s)

    def arrived(self) -> set[int] | None:
        store = self._store
        if store is None:
            return None
        return {0} | {r for r in range(1, self._size) if store.check([f"{self._prefix}/site/{r}"])}

    def abort(self) -> None:
        site, self._site_pg = self._site_pg, None
        if site is not None:
            with contextlib.suppress(Exception):  # a group already broken may refuse; it is dropped either way
                site.abort()
        super().abort()

    def close(self) -> None:
        self._site_pg = None
        self._forwards = {}
        super().close()
