"""Who takes part in a Sender's refits, as a policy: `Fixed` (the receivers admitted at connect, all of them,
every refit) or `Elastic` (receivers join and leave between and during refits; see refit.topology.membership).

Both answer the same questions for the Sender and its rounds: who joins this round, what to do with a
receiver lost mid-refit, and whether a round that reached fewer receivers than asked for may stand."""

from __future__ import annotations

import contextlib
import threading
import time

from refit.errors import HandshakeError, IntegrityError, PeerError, RefitError
from refit.log import get_logger
from refit.protocol.wire import Channel, Header, Kind
from refit.topology.membership import Membership, hung_up, readable
from refit.topology.policies import Vet
from refit.topology.seat import SenderInterface
from refit.topology.send_path import Lost
from refit.topology.stats import RefitStats
from refit.transports.base import INTERRUPT_EVERY_S, Transport

log = get_logger("sender")
DETECT_BEATS = 3
"""Heartbeat intervals a new group waits for a member before dropping it (a receiver calls a sender that has
been silent for as many dead)."""


class Fixed:
    """Every receiver admitted at connect takes every refit; a lost one fails the refit and the session."""

    def __init__(self, sender: SenderInterface) -> None:
        self.s = sender

    @property
    def lost(self) -> Lost | None:
        """What to do with a receiver lost mid-refit: None, the loss fails the refit."""
        return None

    def start(self, transport: Transport, info: dict, interval: float) -> None:
        transport.joined()
        self.s.refuse_joiners()

    def welcome_fields(self) -> dict:
        """What WELCOME tells each receiver of the membership."""
        return {}

    def gather(self, version: int, retry: bool) -> list[Channel] | RefitStats:
        """The joiners this round takes in (none), or the stats of a round that reaches no one."""
        return []

    def admit(self, joiners: list[Channel]) -> None:
        """Joiners outside a handshake (none)."""

    def retries(self, error: PeerError) -> bool:
        """Whether a round broken by `error` is tried once more (never: the session is over)."""
        return False

    def shortfall(
        self, version: int, stats: RefitStats, committed: list[Channel], failures: list[str], errors: list[str]
    ) -> bool:
        """A round that committed on fewer receivers than it may: adds to `failures`, or True to fail it after
        the receivers that committed were told (they hold the version)."""
        return False

    def record(self, stats: RefitStats, committed: list[Channel]) -> None:
        stats.receivers = sorted(ch.rank for ch in committed if ch in self.s.channels)

    def too_few(self, version: int, did: str, count: int, departed: list[dict]) -> str:
        raise AssertionError("a fixed membership never falls short: every receiver takes every refit")

    def failed(self, message: str, stats: RefitStats) -> str:
        """The error of a round that failed after `record` (nobody departs a fixed membership)."""
        return message


class Elastic(Fixed):
    """Receivers beyond the first may join at any time (they take part from the next refit); one that leaves
    or dies is dropped while the refit goes on. A round that commits on fewer than `min_receivers` fails."""

    def __init__(self, sender: SenderInterface, *, min_receivers: int, vet: Vet | None) -> None:
        super().__init__(sender)
        self.min_receivers = min_receivers
        self.vet = vet
        self.group: list[Channel] = []
        """Group transports: the receivers the group was formed with (a change means a new group)."""
        self.detect_s = 0.0
        """How long a new group waits for a member to join: the heartbeat detection window (set at start)."""

    @property
    def lost(self) -> Lost | None:
        return self.drop

    @property
    def members(self) -> Membership:
        members = self.s.members
        assert members is not None
        return members

    def start(self, transport: Transport, info: dict, interval: float) -> None:
        """The buffers stay open to later joiners (shm keeps its memfds until close); a group transport's
        joiners are welcomed into the next group, so they get no setup now."""
        s = self.s
        members = Membership(
            capacity=s.capacity,
            transport=s.transport_name,
            info=None if s.uses_store else info,
            heartbeat_s=interval,
            timeout_s=s.settings.timeout_s,
        )
        members.start(first_rank=s.options.num_receivers)
        self.detect_s = DETECT_BEATS * interval
        self.group = list(s.channels)
        s.serve_joiners(members)

    def welcome_fields(self) -> dict:
        return {"elastic": True}

    def await_receivers(self, count: int, timeout_s: float) -> bool:
        s = self.s
        self.members.check()
        with s.channel_lock:  # who left since the last refit does not count
            self.members.sweep(s.channels, self.drop)
        need = count - len(s.channels)
        return need <= 0 or self.members.await_ready(need, timeout_s) >= need

    def gather(self, version: int, retry: bool) -> list[Channel] | RefitStats:
        s, members = self.s, self.members
        members.check()
        if not retry:  # (a retry's receivers may still be acknowledging the broken attempt: settle saw to them)
            members.sweep(s.channels, self.drop)
        joiners = members.take_ready()
        if not s.uses_store:  # a group's joiners say READY (and are vetted) in regroup
            joiners = self._vetted(joiners)
        elif joiners or s.channels != self.group:
            self.regroup(joiners)
            joiners = []
        if s.channels or joiners:
            return joiners
        if self.min_receivers:
            raise RefitError(self.too_few(version, "reached", 0, members.departed))
        log.warning("refit of version %d reached no receiver: none is connected", version)
        return RefitStats(version=version, epoch=s.epoch, departed=members.take_departed())

    def admit(self, joiners: list[Channel]) -> None:
        """At refit start, outside a handshake: each joiner validates the current manifest alone (no other
        receiver sees it again); one that refuses it is told why and dropped, and the refit goes on without it."""
        s = self.s
        assert s.manifest is not None
        for ch in joiners:
            refused = s.offer_manifest(s.manifest, [ch])
            if refused:
                with contextlib.suppress(PeerError):
                    ch.send(Header(Kind.ERROR), {"message": f"this engine does not fit the session: {refused[0]}"})
                self.drop(ch, HandshakeError(refused[0]))
            elif s.answered(ch):  # a joiner lost during its handshake did not
                s.channels.append(ch)
        s.refresh_digests()

    def retries(self, error: PeerError) -> bool:
        """A member died mid-refit and broke the group for everyone: drop it, form a new group, retry once."""
        s = self.s
        if not s.uses_store:
            return False
        log.warning("the %s group broke (%s); retrying the refit once in a new group", s.transport_name, error)
        self._settle()
        self.group = []
        return True

    def _settle(self) -> None:
        """After a broken group: drop each receiver whose connection ended; read (and forget) what the rest said
        of the broken refit so far."""
        for ch in list(self.s.channels):
            try:
                while readable(ch):
                    ch.recv("the refit the group broke in")
            except (PeerError, IntegrityError) as e:
                self.drop(ch, e)

    def regroup(self, joiners: list[Channel]) -> None:
        """Group transports, between refits: a new group of the receivers still here and the joiners (a fixed-size
        group cannot shrink or grow), then a new epoch's handshake for all (their receive paths were on the old one).
        A member that has not joined within the heartbeat detection window is dropped and the group formed again
        without it, so no member's slowness holds the session longer than that."""
        s = self.s
        everyone = [*s.channels, *joiners]
        s.drop_transport()  # abort: a member still blocked in the old group (a broken refit) fails at once
        s.end_epoch()
        self.group = []
        welcomed = False
        while everyone:
            late = self._form(everyone, [] if welcomed else joiners)
            if not late:
                break
            welcomed = True  # the joiners had their WELCOME: they wait for the next REGROUP like the rest
            everyone = [ch for ch in everyone if ch not in late]
        if not everyone:  # the next joiner forms the next group
            return
        joiners = [ch for ch in joiners if ch in everyone]
        for ch in everyone:
            statement = _expect_ready(ch)
            if ch in joiners:
                self.members.stated[ch.rank] = statement
        s.channels[:] = everyone
        self.group = list(everyone)
        log.info("formed a new %s group of %d receiver(s)", s.transport_name, len(everyone))
        if len(self._vetted(joiners)) < len(joiners):  # a refused joiner is in the group: form it again without
            self.regroup([])

    def _form(self, everyone: list[Channel], welcome: list[Channel]) -> list[Channel]:
        """One attempt at a group of `everyone` (`welcome`: joiners told WELCOME, the rest REGROUP): [] once it is
        formed, else the members dropped for not joining (the attempt is given up; the rest wait for the next)."""
        s = self.s
        transport, info = s.offer_transport(max(1, len(everyone)))
        late: list[Channel] = []
        for g, ch in enumerate(everyone, start=1):
            try:
                self.members.welcome(ch, Kind.WELCOME if ch in welcome else Kind.REGROUP, {**info, "group_rank": g})
            except PeerError as e:
                late.append(ch)
                self.drop(ch, e)
        late = late or self._establish(transport, everyone)
        if late:  # closes the attempt's store: every member still joining it fails at once and awaits a REGROUP
            s.drop_transport()
        return late

    def _establish(self, transport: Transport, everyone: list[Channel]) -> list[Channel]:
        """Form the group while watching its members: [] once formed, else who did not join (dropped): each member
        whose connection ended, or (after the heartbeat detection window) each not yet in the group's rendezvous."""
        failed: list[BaseException] = []

        def establish() -> None:
            try:
                transport.establish()
            except BaseException as e:  # noqa: BLE001 - reported by the caller's thread
                failed.append(e)

        thread = threading.Thread(target=establish, name="refit-group-form", daemon=True)
        thread.start()
        deadline = time.monotonic() + self.detect_s
        dead: list[Channel] = []
        while thread.is_alive() and not dead and time.monotonic() < deadline:
            thread.join(INTERRUPT_EVERY_S)
            dead = [ch for ch in everyone if hung_up(ch)]
        arrived = transport.arrived()
        late = dead or [ch for g, ch in enumerate(everyone, start=1) if arrived is None or g not in arrived]
        if not late:  # all at the rendezvous, or the group formed: its setup ends on its own (gloo's own timeout)
            thread.join()
            if failed:
                raise PeerError(f"the new {self.s.transport_name} group failed to form: {failed[0]}")
            return []
        for ch in late:
            why = "closed the connection" if ch in dead else f"did not join within {self.detect_s:g}s"
            self.drop(ch, PeerError(f"{ch.peer} {why} while a new {self.s.transport_name} group formed"))
        return late

    def _vetted(self, joiners: list[Channel]) -> list[Channel]:
        """The joiners whose READY statement every handler (refit.stages.handler) and `vet` accept; each other
        one is told why and dropped."""
        members = self.members
        kept = []
        for ch in joiners:
            stated = members.stated.pop(ch.rank, b"")
            why = next((w for h in self.s.handlers if (w := h.vet(stated, ch.rank))), "")
            why = why or (self.vet(stated) if self.vet else "")
            if not why:
                kept.append(ch)
                continue
            with contextlib.suppress(PeerError):
                ch.send(Header(Kind.ERROR), {"message": f"this engine does not fit the session: {why}"})
            self.drop(ch, HandshakeError(why))
        return kept

    def drop(self, ch: Channel, error: Exception) -> None:
        """`ch` left (LEAVE, closed, died or broke the protocol): the refit goes on without it."""
        if ch in self.group and self.s.transport is not None:  # a relay's site loses the bytes it carried
            self.s.transport.left(self.group.index(ch) + 1)
        self.s.forget(ch)
        self.members.drop(ch, error)

    def record(self, stats: RefitStats, committed: list[Channel]) -> None:
        """Who took this refit, and who departed since the last one's stats."""
        super().record(stats, committed)
        stats.departed = self.members.take_departed()

    def shortfall(
        self, version: int, stats: RefitStats, committed: list[Channel], failures: list[str], errors: list[str]
    ) -> bool:
        commit = self.s.commit
        if commit.vote is not None and not committed and not failures:
            failures.append(
                f"its engine worker departed during the refit ({_named(stats.departed)}); its shard has no other "
                "holder, so no worker commits; a replacement under the same worker index takes the next refit"
            )
        few = len(stats.receivers) < self.min_receivers and not failures and not errors
        if few and commit.two_phase:  # the verdict makes it fail on the receivers holding their commit open
            failures.append(self.too_few(version, "committed on", len(stats.receivers), stats.departed))
            return False
        return few

    def too_few(self, version: int, did: str, count: int, departed: list[dict]) -> str:
        """Fewer than `min_receivers` took the refit. Who left stays listed for the next refit's stats."""
        members = self.members
        if departed is not members.departed:
            members.departed[:0] = departed
        return (
            f"refit of version {version} {did} {count} receiver(s), fewer than min_receivers ({self.min_receivers}); "
            f"departed since the last refit's stats: {_named(departed)}; start or reconnect an engine (await_receivers "
            "waits for one), or pass min_receivers=0 to let a refit reach none"
        )

    def failed(self, message: str, stats: RefitStats) -> str:
        """A failed round's error names who departed since the last refit's stats; they stay listed for the
        next refit's stats (a failed round returns none)."""
        if not stats.departed:
            return message
        members = self.members
        members.departed[:0] = [d for d in stats.departed if d not in members.departed]  # too_few may have
        return f"{message}; departed since the last refit's stats: {_named(stats.departed)}"


def _named(departed: list[dict]) -> str:
    return "; ".join(f"receiver {d['receiver']}: {d['reason']}" for d in departed) or "no receiver"


def _expect_ready(ch: Channel) -> bytes:
    """READY for a new group (its payload), after whatever is left of a broken refit (acknowledgements, a DONE)."""
    while True:
        header, payload = ch.recv("joining the new group")
        if header.kind == Kind.READY:
            return payload
        if header.kind not in (Kind.ACK, Kind.DONE):
            raise PeerError(f"{ch.peer} sent {header.kind.name} while joining the new group, expected READY")
