"""Sender: the trainer side's session (lobby and admission, transport setup, heartbeats, the handshake per
epoch). Each refit is one `refit.topology.round.Round`; the modes are policies given at construction:
`SenderOptions` (refit.topology.options), membership (`Fixed` or `Elastic`, refit.topology.elastic) and
commit (`Commit`, refit.topology.policies)."""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Hashable
from typing import Any

import torch

from refit import stages, transports
from refit.errors import HandshakeError, PeerError, RefitError
from refit.layout import tensor_guard
from refit.layout.manifest import Manifest
from refit.layout.planner import forecast, plan
from refit.log import get_logger
from refit.protocol.lobby import Lobby
from refit.protocol.store import AuthenticatedStores
from refit.protocol.wire import Channel, Kind
from refit.settings import Settings
from refit.sources.base import Source
from refit.stages import handler
from refit.stages.delta import Costs
from refit.topology.admission import admit, agreed_capacity, falls_back, welcome
from refit.topology.digest_plan import DigestPlan
from refit.topology.elastic import Elastic, Fixed
from refit.topology.held import Held
from refit.topology.membership import Membership
from refit.topology.offer import Offers, described
from refit.topology.options import VERIFY_MODES, SenderOptions, stage_rules
from refit.topology.policies import Commit, Vet
from refit.topology.pulse import HEARTBEAT_MAX_S, Pulse
from refit.topology.round import Round
from refit.topology.send_path import SendPath
from refit.topology.stats import RefitStats
from refit.topology.zero_copy import ZeroCopyPath
from refit.transports import address
from refit.transports.base import Transport

log = get_logger("sender")
__all__ = ["VERIFY_MODES", "Sender", "SenderOptions"]


class Sender:
    """Pushes a Source's weights to `num_receivers` Receivers over one transport, set up once.

    Call `rendezvous()` for what receivers need to connect, `connect()` (or let the first `refit` do
    it), then `refit(version)` after every optimizer step. Between refits the session may idle for as
    long as training needs: heartbeats keep the receivers' liveness checks satisfied.
    """

    def __init__(
        self,
        source: Source,
        options: SenderOptions | None = None,
        *,
        settings: Settings | None = None,
        device: torch.device | None = None,
        commit: Commit | None = None,
        vet: Vet | None = None,
        **overrides: Any,
    ) -> None:
        """`options` (see SenderOptions: transport, num_receivers, verify, zero_copy, elastic, min_receivers, ...),
        or any of them as keyword arguments (`Sender(source, transport="gloo")`).
        `commit`: how a refit is decided (default from `verify`: strict or not); per-rank and M:N drivers pass
        `Commit(vote=...)`. `vet` (elastic M:N): judges what a joiner states with READY before it is taken in."""
        o = self.options = SenderOptions.of(options, overrides)
        self._paths: type[SendPath] = ZeroCopyPath if o.zero_copy else SendPath
        """The epoch's data path, chosen once: packed buckets, or the source's tensors read in place."""
        self._paths.check(source)
        self.delta_costs = o.delta_costs or Costs()
        """The link's and the delta scan's costs measured in this session (they outlive an epoch)."""
        self.commit = Commit.matching(commit, o.verify)
        self.handlers = stages.handlers(o)
        """Readers of what the engines state with READY, and the checks COMMIT carries (refit.stages.handler)."""
        self._broken = ""
        self._connected = False
        self.source = source
        self.transport_name = o.transport
        self._transport_cls = transports.get(o.transport)
        self.settings = settings or Settings()
        self.device = device or transports.default_device(o.transport)
        lobby = Lobby(address.listen_host(self.settings), o.port, self.settings.token, backlog=o.num_receivers + 8)
        self._session = Held(lobby)
        self._finalizer = weakref.finalize(self, self._session.close)
        self.membership: Fixed = Elastic(self, min_receivers=o.min_receivers, vet=vet) if o.elastic else Fixed(self)
        self.capacity = 0
        self.manifest: Manifest | None = None
        self._offers = Offers(fingerprint=bool(o.verify))
        self._digests: DigestPlan | None = None
        self._signature: Hashable = None
        self._path: SendPath | None = None
        self._epoch = 0
        self._generation = 0
        self._begun = False
        self.statements: list[bytes] = []
        """What each receiver sent with READY (JSON, by rank; empty when it states nothing)."""
        self._added: tuple[str, ...] = ()
        """Stages the handlers added for what the engines stated, before the session's own."""

    @property
    def channels(self) -> list[Channel]:
        return self._session.channels

    @property
    def transport(self) -> Transport | None:
        return self._session.transport

    @property
    def uses_store(self) -> bool:
        """A group transport (gloo, nccl): a group formed through a store, fixed in size."""
        return bool(self._transport_cls.uses_store)

    def bucket_buffer(self, b: int) -> torch.Tensor | None:
        """The slot buffer bucket `b` of `manifest` will be packed into (None before the first handshake).
        A gathering source may fill it in place (bytes laid out as `manifest` says) so packing copies nothing."""
        path = self._path
        current = path is not None and path.manifest is self.manifest and self.transport is not None
        return path.buffer(b) if current and path is not None else None

    def rendezvous(self) -> dict:
        """JSON-able info a Receiver needs: address, token and transport."""
        host, port = self._session.lobby.address()
        host = address.advertised(host, self.settings)  # a wildcard is no address to dial
        return {"host": host, "port": port, "token": self.settings.token, "transport": self.transport_name}

    def await_receivers(self, count: int, *, timeout_s: float) -> bool:
        """Elastic: wait until `count` receivers take part in the next refit (those in the session, plus
        joiners whose READY arrived), at most `timeout_s`; True when they do. Connects first if needed."""
        if not isinstance(self.membership, Elastic):
            raise ValueError("await_receivers is for an elastic Sender (Sender(..., elastic=True))")
        self.connect()
        return self.membership.await_receivers(count, timeout_s)

    @property
    def connected(self) -> bool:
        """Whether `connect` admitted every receiver and set up the transport."""
        return self._connected

    def cancel_connect(self, reason: str) -> None:
        """From another thread: a `connect` waiting for its receivers raises PeerError(reason) at once
        rather than at the connect timeout (one of them will never come: its process died). The Sender is
        then broken, as after any failed connect; nothing happens once connected."""
        if not self._connected:
            self._session.lobby.cancel(reason)

    def connect(self) -> None:
        """Accept every receiver, agree on the bucket capacity, and set up the transport. A connect that
        fails leaves nothing half-built: its channels and transport are closed, and this Sender refuses
        every later call (build a new one)."""
        if self._broken:
            raise PeerError(f"this session broke earlier ({self._broken}); close() it and build a new Sender")
        if self._connected:
            return
        tensor_guard.prepare()  # the layout check's one-time build, before any receiver waits on a refit
        try:
            self._connect()
        except BaseException as e:
            self._broken = f"connect failed: {type(e).__name__}: {e}"
            self._session.drop_peers()
            raise
        self._connected = True

    def _connect(self) -> None:
        if falls_back(self.transport_name, self._paths.in_place, self.device, self.settings):
            self.transport_name, self._transport_cls, self.device = "shm", transports.get("shm"), torch.device("cpu")
        o = self.options
        limits = admit(self._session.lobby, o.num_receivers, self.settings, into=self.channels)
        self.capacity = agreed_capacity(limits, self.settings, self.device, o.num_slots, self.source.specs())
        transport, info = self.offer_transport(o.num_receivers)
        interval = min(HEARTBEAT_MAX_S, self.settings.timeout_s / 4)
        setup = {"capacity": self.capacity, "transport": self.transport_name, "info": info, "heartbeat_s": interval}
        welcome(self.channels, {**setup, **self.membership.welcome_fields()})
        transport.establish()
        self.statements = [ch.expect(Kind.READY, "transport setup")[1] for ch in self.channels]
        self._adapt()
        self.membership.start(transport, info, interval)
        waiting = self._session.members.waiting if self._session.members else None
        self._session.pulse = Pulse(self._session.channels, interval, waiting)
        log.info(
            "connected %d receiver(s) over %s, buckets of %d B", len(self.channels), self.transport_name, self.capacity
        )

    def _adapt(self) -> None:
        """Every handler reads what the engines stated with READY: the source the session sends from and the
        stages that adds (refit.stages.handler). A refusal is told to every engine."""
        try:
            self.source, self._added = handler.adapt(self.handlers, self.source, self.statements)
            stage_rules(self._added, self.options.stage_names)
        except ValueError as e:
            self._session.tell(f"the trainer refused this engine: {e}")
            raise HandshakeError(str(e)) from None

    def _handshake(self) -> None:
        self._epoch += 1
        names = (*self._added, *self.options.stage_names)
        manifest = plan(self.source.specs(), capacity=self.capacity, epoch=self._epoch, stages=names)
        failures = self.offer_manifest(manifest, self.channels)
        if failures:
            self.manifest, self._signature = None, None
            raise HandshakeError(" | ".join(failures))
        assert self.transport is not None
        digests = self._offers.plan(manifest, self.channels)
        me = weakref.ref(self)  # a stage must not keep its Sender alive
        session = {
            "delta_threshold": self.options.delta_threshold,
            "delta_costs": self.delta_costs,
            "source": self.source,  # a stage may read the source it sends from (its checks, once per refit)
            "bucket_buffer": lambda b: s.bucket_buffer(b) if (s := me()) is not None else None,  # written in place
        }
        made = stages.make(manifest.stages, manifest, self.device, trainer=True, session=session)
        path = self._paths(
            manifest,
            self.transport,
            self.channels,
            settings=self.settings,
            num_slots=self.options.num_slots,
            digests=digests,
            stages=made,
        )
        path.share(self.source)
        self.manifest, self._digests, self._path = manifest, digests, path
        log.info("handshake: %s", described(manifest))

    def offer_manifest(self, manifest: Manifest, channels: list[Channel]) -> list[str]:
        """Send `manifest` to `channels` and read each REPORT (keeping its regions); returns their refusals, each
        as 'receiver R: why'. A channel lost meanwhile goes to the membership's `lost` (see `answered`)."""
        return self._offers.offer(manifest, channels, self.membership.lost)

    def prepare(self, joiners: list[Channel]) -> bool:
        """At a round's start: a new epoch's handshake (with `joiners`) if there is none yet or the source's
        tensors changed, else the joiners validate the current manifest alone. True for a handshake."""
        signature = self.source.signature()
        moved = signature != self._signature
        handshake = self.manifest is None or (moved and self._paths.changed(self.source, self.manifest))
        if handshake:
            self.channels.extend(joiners)
            self._handshake()
        elif joiners:
            self.membership.admit(joiners)
        if moved or not self.source.signature_covers_layout:
            self._generation += 1  # cached copy plans must check their tensors' layout again
        self._signature = signature
        return handshake

    def refit(self, version: int) -> RefitStats:
        """Send the source's current weights as `version`; returns when every receiver committed.

        A receiver that fails reports it here as RefitError while the session stays usable (retry the
        same version). A dead or silent peer raises PeerError and ends the session: make a new Sender.
        """
        if self._broken:
            raise PeerError(f"this session broke earlier ({self._broken}); close() it and build a new Sender")
        if not self._finalizer.alive:
            raise ValueError("this Sender is closed; start a new one")
        t_connect = time.perf_counter()
        self._begun = False
        try:
            self.connect()
            pulse = self._session.pulse
            assert pulse is not None
            with pulse.lock:  # heartbeats never interleave with a refit
                return self._round(version, t_connect)
        except PeerError as e:
            self._broken = self._broken or str(e)
            log.error("session broken: %s", e)
            raise
        except Exception as e:
            if self._begun and not isinstance(e, RefitError):
                self._abort(version, e)
            raise

    def _round(self, version: int, t_connect: float) -> RefitStats:
        try:
            return Round(self, version, t_connect).run()
        except PeerError as e:
            if not (self._begun and self.membership.retries(e)):
                raise
            self._begun = False
            return Round(self, version, t_connect, retry=True).run()

    def _abort(self, version: int, error: Exception) -> None:
        """The trainer side failed mid-refit (its source raised, say): tell every receiver at once, so none
        waits out its timeout, and end the session (their weights are mixed; they report 'failed')."""
        self._broken = f"the trainer failed during refit {version}: {type(error).__name__}: {error}"
        log.error("aborting refit %d: %s", version, self._broken)
        self._session.tell(self._broken)

    # What a round and the membership policy call (refit.topology.seat.SenderInterface); nothing else reaches in.

    @property
    def members(self) -> Membership | None:
        """Elastic: who joins and leaves the session (None for a fixed membership, or before connect)."""
        return self._session.members

    @property
    def epoch(self) -> int:
        """The current epoch: each handshake starts the next one (0 before the first)."""
        return self._epoch

    @property
    def generation(self) -> int:
        """Moves whenever the source's tensors may have moved in memory: copy plans cached under an older
        generation check their tensors' layout again."""
        return self._generation

    @property
    def path(self) -> SendPath:
        """The current epoch's send path (a round reads it after `prepare`)."""
        assert self._path is not None, "no send path before the epoch's handshake"
        return self._path

    @property
    def channel_lock(self) -> threading.Lock:
        """Held by whatever writes to the channels outside the heartbeats (a refit, a sweep of who left), so
        that no heartbeat interleaves with it. Exists once connected."""
        pulse = self._session.pulse
        assert pulse is not None, "no heartbeats before connect"
        return pulse.lock

    def refuse_joiners(self) -> None:
        """From now on the lobby answers every receiver that connects late with an error (a fixed membership)."""
        self._session.lobby.refuse_late(self.options.num_receivers)

    def serve_joiners(self, members: Membership) -> None:
        """From now on the lobby hands every receiver that connects late to `members` (an elastic membership),
        which the session holds and closes with itself."""
        self._session.members = members
        self._session.lobby.serve_late(members.arrive, members.fail)

    def mark_begun(self) -> None:
        """The round told its receivers BEGIN: a trainer-side failure from now on is told to every receiver, and a
        group broken by a dead member may be retried (refit.topology.elastic)."""
        self._begun = True

    def answered(self, ch: Channel) -> bool:
        """Whether `ch` answered the current epoch's manifest with a REPORT (one lost before it did has not)."""
        return self._offers.answered(ch.rank)

    def refresh_digests(self) -> None:
        """The fingerprint plan follows the receivers now in the session (after joiners were admitted)."""
        path = self.path
        self._digests = path.digests = self._offers.plan(self.manifest, self.channels)

    def forget(self, ch: Channel) -> None:
        """Receiver `ch` left: out of the session's channels, the fingerprint plan and the regions it named."""
        if ch in self.channels:
            self.channels.remove(ch)
        if self._digests is not None:
            self._digests.forget(ch.rank)
        self._offers.forget(ch.rank)

    def offer_transport(self, num_receivers: int) -> tuple[Transport, dict]:
        """A new transport of the session's kind and capacity for `num_receivers`, held as the session's (the one
        before must have been dropped): (transport, the setup info its receivers join with)."""
        assert self._session.transport is None, "drop_transport() the session's transport before offering a new one"
        store = {"store": AuthenticatedStores(self.settings.token, self.settings)} if self.uses_store else {}
        transport, info = self._transport_cls.offer(
            capacity=self.capacity,
            num_slots=self.options.num_slots,
            num_receivers=num_receivers,
            device=self.device,
            settings=self.settings,
            **store,
        )
        self._session.transport = transport
        return transport, info

    def drop_transport(self) -> None:
        """Abort the session's transport, so that every peer still blocked in it fails at once, and hold none."""
        self._session.drop_transport()

    def end_epoch(self) -> None:
        """Forget the epoch's manifest and send path (its receivers' paths are gone): the next round handshakes."""
        self._path, self.manifest = None, None

    def predicted_memory(self) -> dict[str, int]:
        """Predicted bytes each side allocates or maps for the manifest (`bench.memory.MemoryProbe` measures it)."""
        if self.manifest is None:
            raise ValueError("no manifest yet: call refit() (or connect and handshake) first")
        f = forecast(self.manifest, num_slots=self.options.num_slots)
        return {"sender": f.sender_bytes + self.source.held_bytes(), "receiver": f.receiver_bytes}

    def close(self) -> None:
        """End the session: tell receivers, stop heartbeats, release the transport, sockets and buffer views."""
        self._finalizer()
        self._path = None

    def __enter__(self) -> Sender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
