"""Sender: the trainer side's session (lobby and admission, transport setup, heartbeats, the handshake per
epoch). Each refit is one `refit.topology.round.Round`; the modes are policies given at construction:
`SenderOptions` (refit.topology.options), membership (`Fixed` or `Elastic`, refit.topology.elastic) and
commit (`Commit`, refit.topology.policies)."""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from collections.abc import Callable, Hashable
from typing import Any

import torch

from refit import stages, transports
from refit.checks import canary
from refit.checks.manifest_check import Report
from refit.errors import HandshakeError, PeerError, RefitError
from refit.layout import tensor_guard
from refit.layout.budget import bucket_capacity, free_bytes, needed_bytes
from refit.layout.fp8 import BlockFormat
from refit.layout.manifest import Manifest
from refit.layout.planner import forecast, plan
from refit.log import get_logger
from refit.protocol import auth
from refit.protocol.auth import manifest_binding
from refit.protocol.lobby import Lobby
from refit.protocol.store import AuthenticatedStores
from refit.protocol.wire import Channel, Header, Kind, Offer, parse_json
from refit.settings import Settings
from refit.sources.base import Source
from refit.stages import Stage, fp8, lora
from refit.stages.delta import Costs
from refit.topology.admission import admit, falls_back, welcome
from refit.topology.digest_plan import DigestPlan, parse_regions
from refit.topology.elastic import Elastic, Fixed
from refit.topology.held import Held
from refit.topology.membership import Membership
from refit.topology.options import VERIFY_MODES, SenderOptions
from refit.topology.policies import Commit, Vet
from refit.topology.pulse import HEARTBEAT_MAX_S, Pulse
from refit.topology.round import Round
from refit.topology.send_path import SendPath, each
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
        o = SenderOptions.of(options, overrides)
        self._paths: type[SendPath] = ZeroCopyPath if o.zero_copy else SendPath
        """The epoch's data path, chosen once: packed buckets, or the source's tensors read in place."""
        self._paths.check(source)
        self.options = o
        self.delta_costs = o.delta_costs or Costs()
        """The link's and the delta scan's costs measured in this session (they outlive an epoch)."""
        self.num_slots, self.zero_copy, self.verify = o.num_slots, o.zero_copy, o.verify
        self.elastic, self.min_receivers = o.elastic, o.min_receivers
        self.verify_checksum, self.num_receivers = o.verify_checksum, o.num_receivers
        self.commit = Commit.matching(commit, o.verify)
        self.canary = o.canary
        self._since_probe: int | None = None
        """Refits committed since the last probed one committed, counting it (None: none probed yet)."""
        self._probed: frozenset[int] = frozenset()
        """The receivers the last committed probe reached."""
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
        self._regions: dict[int, dict] = {}
        """Per receiver rank: the regions (shards) it named at its handshake (fingerprint check)."""
        self._digests: DigestPlan | None = None
        self._signature: Hashable = None
        self._path: SendPath | None = None
        self._epoch = 0
        self._generation = 0
        self._begun = False
        self.statements: list[bytes] = []
        self.formats: dict[str, BlockFormat] = {}
        """The block FP8 formats the engines stated (refit.stages.fp8): the source is sent quantized to them."""
        self._added: tuple[str, ...] = ()
        """Stages the engines' statements added (fp8), before the session's own."""
        """What each receiver sent with READY: M:N shard statements (JSON; refit.topology.mesh), else empty."""

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
        if path is None or path.manifest is not self.manifest or self.transport is None:
            return None
        return path.buffer(b)

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
        limits = admit(self._session.lobby, self.num_receivers, self.settings, into=self.channels)
        own = bucket_capacity(
            bucket_bytes=self.settings.bucket_bytes,
            ratio=self.settings.ratio,
            free=free_bytes(self.device),
            num_slots=self.num_slots,
            needed=needed_bytes(self.source.specs()),
        )
        # Fixed for the session: a model that grows later (a dtype switch) takes more buckets of this size.
        self.capacity = min([own, *limits])
        transport, info = self.offer_transport(self.num_receivers)
        interval = min(HEARTBEAT_MAX_S, self.settings.timeout_s / 4)
        setup = {"capacity": self.capacity, "transport": self.transport_name, "info": info, "heartbeat_s": interval}
        welcome(self.channels, {**setup, **self.membership.welcome_fields()})
        transport.establish()
        self.statements = [ch.expect(Kind.READY, "transport setup")[1] for ch in self.channels]
        self._quantize()
        self.membership.start(transport, info, interval)
        waiting = self._session.members.waiting if self._session.members else None
        self._session.pulse = Pulse(self._session.channels, interval, waiting)
        log.info(
            "connected %d receiver(s) over %s, buckets of %d B", len(self.channels), self.transport_name, self.capacity
        )

    def _quantize(self) -> None:
        """Where the engines hold block FP8 (their READY says), send from the source as they hold it; a LoRA
        source checks that they hold its adapter's layout over its base. A refusal is told to every engine."""
        try:
            added = lora.adapt(self.source, self.statements)
            if self.canary is not None:
                canary.refuse_unable(self.statements)
            self.formats = fp8.stated(self.statements)
            self.source, self._added = fp8.adapt(self.source, self.formats, zero_copy=self.zero_copy)
            self._added += added
        except ValueError as e:
            for ch in self.channels:
                with contextlib.suppress(PeerError):
                    ch.send(Header(Kind.ERROR), {"message": f"the trainer refused this engine: {e}"})
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
        digests = self._digest_plan(manifest)
        path = self._paths(
            manifest,
            self.transport,
            self.channels,
            settings=self.settings,
            num_slots=self.num_slots,
            digests=digests,
            stages=self._stages(manifest),
        )
        path.share(self.source)
        self.manifest, self._digests, self._path = manifest, digests, path
        log.info(
            "handshake: epoch %d, digest %s, %d tensors, %d bucket(s) of %d bytes",
            manifest.epoch,
            manifest.digest.hex()[:12],
            len(manifest.entries),
            manifest.num_buckets,
            manifest.capacity,
        )

    def _stages(self, manifest: Manifest) -> list[Stage]:
        """The trainer's half of each stage the manifest lists, for this epoch."""
        me = weakref.ref(self)  # a stage must not keep its Sender alive
        session = {
            "delta_threshold": self.options.delta_threshold,
            "delta_costs": self.delta_costs,
            "source": self.source,  # FP8: the stage reads the quantizer's non-finite flags once, at the last bucket
            "bucket_buffer": lambda b: s.bucket_buffer(b) if (s := me()) is not None else None,  # FP8: into the bucket
        }
        return stages.make(manifest.stages, manifest, self.device, trainer=True, session=session)

    def offer_manifest(self, manifest: Manifest, channels: list[Channel]) -> list[str]:
        """Send `manifest` to `channels` and read each REPORT (keeping its regions); returns their refusals, each
        as 'receiver R: why'. A channel lost meanwhile goes to the membership's `lost` (see `answered`)."""
        payload, (flags, regions) = manifest.to_json(), _offered(bool(self.verify))

        def offer(ch: Channel) -> None:  # each receiver's copy is bound to its session: digest is a MAC under its key
            binding = auth.tag(ch.key, b"MANIFEST", manifest_binding(manifest.epoch, manifest.digest))
            ch.send(Header(Kind.MANIFEST, epoch=manifest.epoch, digest=binding, status=flags), payload)

        failures: list[str] = []

        def report(ch: Channel) -> None:
            obj = parse_json(ch.expect(Kind.REPORT, "handshake")[1], "REPORT")
            report = Report.from_json(obj)
            self._regions[ch.rank] = regions(obj.get("regions"), manifest)
            if not report.ok:
                failures.append(f"receiver {ch.rank}: {report.message()}")
            elif report.unsynced:
                log.warning("receiver %d: %s", ch.rank, report.unsynced_message())

        each(channels, offer, self.membership.lost)
        each(channels, report, self.membership.lost)
        return failures

    def _digest_plan(self, manifest: Manifest | None) -> DigestPlan | None:
        """The fingerprint plan for `manifest` and the current receivers (regions by receiver rank)."""
        if not self.verify or manifest is None:
            return None
        return DigestPlan(manifest, {ch.rank: self._regions.get(ch.rank, {}) for ch in self.channels})

    def prepare(self, joiners: list[Channel]) -> bool:
        """At a round's start: a new epoch's handshake (with `joiners`) if there is none yet or the source's
        tensors changed, else the joiners validate the current manifest alone. True for a handshake."""
        signature = self.source.signature()
        moved = signature != self._signature
        handshake = self.manifest is None or (moved and self._changed())
        if handshake:
            self.channels.extend(joiners)
            self._handshake()
        elif joiners:
            self.membership.admit(joiners)
        if moved or not self.source.signature_covers_layout:
            self._generation += 1  # cached copy plans must check their tensors' layout again
        self._signature = signature
        return handshake

    def _changed(self) -> bool:
        """The cheap signature moved: does that need a new epoch? Yes if any spec or alias changed, and on a path
        that reads the source in place also when only storage or layout moved (what it shared is the old memory)."""
        assert self.manifest is not None
        if self._paths.restarts_on_move:
            return True
        return sorted(self.source.specs(), key=lambda s: s.name) != [p.spec for p in self.manifest.entries]

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
        for ch in self.channels:
            with contextlib.suppress(PeerError):
                ch.send(Header(Kind.ERROR), {"message": self._broken})

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
        self._session.lobby.refuse_late(self.num_receivers)

    def serve_joiners(self, members: Membership) -> None:
        """From now on the lobby hands every receiver that connects late to `members` (an elastic membership),
        which the session holds and closes with itself."""
        self._session.members = members
        self._session.lobby.serve_late(members.arrive, members.fail)

    def mark_begun(self) -> None:
        """The round told its receivers BEGIN: a trainer-side failure from now on is told to every receiver, and a
        group broken by a dead member may be retried (refit.topology.elastic)."""
        self._begun = True

    def canary_probe(self, ranks: frozenset[int]) -> dict | None:
        """This refit's canary reference (the trainer's scores of the probe), when one is due: by the count of
        committed refits, or because it reaches receivers (`ranks`) the last probe did not; else None."""
        c = self.canary
        due = c is not None and (c.due(self._since_probe) or not ranks <= self._probed)
        return c.reference_payload() if due and c is not None else None

    def canary_committed(self, probed: bool, ranks: list[int]) -> None:
        """A refit committed on `ranks`, with the probe or without: the canary's count moves (never on failure)."""
        if probed:
            self._since_probe, self._probed = 1, frozenset(ranks)
        elif self._since_probe is not None:
            self._since_probe += 1

    def answered(self, ch: Channel) -> bool:
        """Whether `ch` answered the current epoch's manifest with a REPORT (one lost before it did has not)."""
        return ch.rank in self._regions

    def refresh_digests(self) -> None:
        """The fingerprint plan follows the receivers now in the session (after joiners were admitted)."""
        path = self.path
        self._digests = path.digests = self._digest_plan(self.manifest)

    def forget(self, ch: Channel) -> None:
        """Receiver `ch` left: out of the session's channels, the fingerprint plan and the regions it named."""
        if ch in self.channels:
            self.channels.remove(ch)
        if self._digests is not None:
            self._digests.forget(ch.rank)
        self._regions.pop(ch.rank, None)

    def offer_transport(self, num_receivers: int) -> tuple[Transport, dict]:
        """A new transport of the session's kind and capacity for `num_receivers`, held as the session's (the one
        before must have been dropped): (transport, the setup info its receivers join with)."""
        assert self._session.transport is None, "drop_transport() the session's transport before offering a new one"
        store = {"store": AuthenticatedStores(self.settings.token, self.settings)} if self.uses_store else {}
        transport, info = self._transport_cls.offer(
            capacity=self.capacity,
            num_slots=self.num_slots,
            num_receivers=num_receivers,
            device=self.device,
            settings=self.settings,
            **store,
        )
        self._session.transport = transport
        return transport, info

    def drop_transport(self) -> None:
        """Abort the session's transport, so that every peer still blocked in it fails at once, and hold none."""
        transport, self._session.transport = self._session.transport, None
        if transport is not None:
            transport.abort()

    def end_epoch(self) -> None:
        """Forget the epoch's manifest and send path (its receivers' paths are gone): the next round handshakes."""
        self._path, self.manifest = None, None

    def predicted_memory(self) -> dict[str, int]:
        """Predicted bytes each side allocates or maps for the manifest (`bench.memory.MemoryProbe` measures it)."""
        if self.manifest is None:
            raise ValueError("no manifest yet: call refit() (or connect and handshake) first")
        f = forecast(self.manifest, num_slots=self.num_slots)
        return {"sender": f.sender_bytes + self.source.held_bytes(), "receiver": f.receiver_bytes}

    def close(self) -> None:
        """End the session: tell receivers, stop heartbeats, release the transport, sockets and buffer views."""
        self._finalizer()
        self._path = None

    def __enter__(self) -> Sender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _offered(fingerprint: bool) -> tuple[Offer, Callable[[object, Manifest], dict]]:
    """MANIFEST's flags, and how each REPORT's regions (shards it holds) are read: only for the fingerprint."""
    return (Offer.FINGERPRINT, parse_regions) if fingerprint else (Offer(0), _no_regions)


def _no_regions(obj: object, manifest: Manifest) -> dict:
    return {}
