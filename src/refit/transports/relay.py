"""relay transport: gloo broadcast fanned out by site. The trainer broadcasts each bucket once to one relay per
site (the trunk group: the trainer and the relays); each relay re-broadcasts it inside its site's own gloo group
while it receives the next bucket into its other slot. A site is what a receiver states (`Settings.site`,
REFIT_SITE, `Receiver(..., site=...)`): the replicas behind one link; a receiver that states none is a site of
its own, so with no sites stated this is gloo's broadcast.

Relays only move bytes: each replica still checks its own tensors against the trainer's fingerprint, which
reaches it over its own authenticated channel, and a version commits fleet-wide as with any transport.
"""

from __future__ import annotations

import contextlib
import datetime
import json
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
        ranks = [r for g in groups or () for r in (g if isinstance(g, list) else [None])]
        if not groups or sorted(r for r in ranks if isinstance(r, int)) != list(range(1, size)) or None in ranks:
            raise PeerError(f"the relay plan in the group's store is malformed: {raw[:200]!r}")
        return cls(tuple(tuple(g) for g in groups))


class _Relayed(Pending):
    """A relay's receive: the trunk broadcast, then the start of its re-broadcast inside the site."""

    def __init__(self, trunk: Pending, forward: Callable[[], None]) -> None:
        self._trunk, self._forward = trunk, forward

    def wait(self, timeout_s: float, interrupted: Callable[[], bool] | None = None) -> None:
        self._trunk.wait(timeout_s, interrupted)
        self._forward()


class RelayTransport(GlooTransport):
    """Rank 0 is the trainer; ranks 1..n the receivers, each a relay (the lowest rank of its site) or a member."""

    name = "relay"

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.sites: Sites | None = None
        self._site_pg: dist.ProcessGroup | None = None
        """Relays and members: the site's group (its relay is rank 0); None for a site of one."""
        self._forwards: dict[int, Pending] = {}
        """A relay's re-broadcasts in flight, by slot: waited before the slot is received into again."""

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
        return self._broadcast(slot, nbytes, f"relay broadcast of {nbytes} bytes to {len(self.sites.relays)} relay(s)")

    def recv(self, slot: int, nbytes: int) -> Pending:
        if not self.relays:
            return self._in_site(slot, nbytes, f"relay receive of {nbytes} bytes from the site's relay")
        done = self._forwards.pop(slot, None)
        if done is not None:  # the slot's last bucket has left for the site before this one overwrites it
            done.wait(self._settings.timeout_s)
        trunk = self._broadcast(slot, nbytes, f"relay receive of {nbytes} bytes from the trainer")
        if self._site_pg is None:
            return trunk

        def forward() -> None:
            what = f"relay re-broadcast of {nbytes} bytes inside its site"
            self._forwards[slot] = self._in_site(slot, nbytes, what)

        return _Relayed(trunk, forward)

    def _in_site(self, slot: int, nbytes: int, what: str) -> Pending:
        if self._site_pg is None:
            raise PeerError(f"{self.name} transport is closed or was never set up")
        return self._pending(self._site_pg.broadcast([self.buffers[slot][:nbytes]], self._opts), what)

    def flush(self) -> None:
        """A relay: every re-broadcast it started is done (its site's members need them to commit)."""
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
