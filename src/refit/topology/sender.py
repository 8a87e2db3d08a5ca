"""Sender: the trainer side's session (lobby and admission, transport setup, heartbeats, handshake per
epoch, commit vote). Each refit's buckets go through the epoch's data path, `refit.topology.send_path`."""

from __future__ import annotations

import contextlib
import json
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Hashable
from dataclasses import replace

import torch

from refit import transports
from refit.checks.validation import Report
from refit.errors import HandshakeError, IntegrityError, PeerError, RefitError
from refit.layout.budget import NUM_SLOTS, bucket_capacity, free_bytes, needed_bytes
from refit.layout.manifest import Manifest
from refit.layout.planner import forecast, plan
from refit.log import get_logger
from refit.protocol import auth
from refit.protocol.auth import manifest_binding
from refit.protocol.lobby import Lobby
from refit.protocol.store import AuthenticatedStores
from refit.protocol.wire import Channel, Header, Kind, parse_json
from refit.settings import Settings
from refit.sources.base import Source
from refit.topology.membership import Membership, readable
from refit.topology.send_path import SendPath, each, share_sources
from refit.topology.stats import RefitStats
from refit.topology.verification import DigestPlan, parse_regions
from refit.transports import address
from refit.transports.base import Transport

log = get_logger("sender")
VERIFY_MODES = (None, "fingerprint", "strict")
HEARTBEAT_MAX_S = 5.0
"""Longest gap between heartbeats to idle receivers (shorter when REFIT_TIMEOUT is short)."""
UNREAD_LIMIT = 4096
"""A receiver that has not read this many queued bytes is not waiting: skip its heartbeats, never block."""


class _Pulse:
    """Heartbeats to every receiver between refits, from a thread that holds no reference to the Sender
    (so an unclosed Sender can still be collected). A refit holds `lock`; heartbeats never interleave with it."""

    def __init__(
        self, channels: list[Channel], interval_s: float, waiting: Callable[[], list[Channel]] | None = None
    ) -> None:
        self.channels = channels
        self.waiting = waiting
        """Elastic: the joiners welcomed but not yet in a refit, which must not time out either."""
        self.lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(interval_s,), name="refit-heartbeat", daemon=True)
        self._thread.start()

    def _run(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            if not self.lock.acquire(blocking=False):
                continue
            try:
                for ch in self.channels + (self.waiting() if self.waiting else []):
                    if ch.unsent_bytes() < UNREAD_LIMIT:
                        with contextlib.suppress(PeerError):  # the next refit reports the dead peer with its stage
                            ch.send(Header(Kind.HEARTBEAT))
            finally:
                self.lock.release()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join()


class _Session:
    """What a Sender holds open (lobby, heartbeats, channels, transport); closed by `close` or, for a
    Sender never closed, when it is garbage collected or the interpreter exits."""

    def __init__(self, lobby: Lobby) -> None:
        self.lobby = lobby
        self.pulse: _Pulse | None = None
        self.channels: list[Channel] = []
        self.transport: Transport | None = None
        self.members: Membership | None = None

    def drop_peers(self) -> None:
        """After a failed connect: close every channel and the transport (the lobby stays until `close`)."""
        for ch in self.channels:
            ch.close()
        self.channels.clear()
        if self.transport is not None:
            self.transport.close()
            self.transport = None

    def close(self) -> None:
        if self.pulse is not None:
            self.pulse.stop()
            self.pulse = None
        self.lobby.close()
        if self.members is not None:
            self.members.close()
        for ch in self.channels:
            with contextlib.suppress(PeerError):
                ch.send(Header(Kind.CLOSE))
            ch.close()
        self.channels.clear()
        if self.transport is not None:
            self.transport.close()
            self.transport = None


class Sender:
    """Pushes a Source's weights to `num_receivers` Receivers over one transport, set up once.

    Call `rendezvous()` for what receivers need to connect, `connect()` (or let the first `refit` do
    it), then `refit(version)` after every optimizer step. Between refits the session may idle for as
    long as training needs: heartbeats keep the receivers' liveness checks satisfied.
    """

    def __init__(
        self,
        source: Source,
        *,
        transport: str = "shm",
        num_receivers: int = 1,
        settings: Settings | None = None,
        device: torch.device | None = None,
        verify_checksum: bool = False,
        verify: str | None = "fingerprint",
        num_slots: int = NUM_SLOTS,
        zero_copy: bool = False,
        port: int = 0,
        elastic: bool = False,
        min_receivers: int = 1,
    ) -> None:
        """`verify="fingerprint"` (the default; `verify=None` turns it off): after the last bucket, each
        receiver compares a digest of what its engine now holds with a digest of the trainer's live
        tensors (after the wire cast), and the refit fails, naming the tensors that differ, unless all
        agree; tensors an engine cannot read back are reported (`RefitStats.unverified_names`) but
        accepted. `verify="strict"` verifies the same way and fails the refit (committed on no receiver)
        when any tensor went unverified.
        `zero_copy` (cuda-ipc only): receivers copy straight from the source tensors, whose IPC handles
        are exported once per epoch; the source must hold contiguous device tensors in their wire dtype.
        `elastic`: receivers beyond the first `num_receivers` may join at any time (they take part from
        the next refit), and one that leaves or dies is dropped while the refit goes on with the rest
        (`RefitStats.departed` names it); without it any lost receiver fails the refit and the session.
        `min_receivers` (elastic): a refit that commits on fewer receivers raises RefitError naming who left
        and why (those that committed hold the version); 0 lets a refit with no receiver at all pass."""
        if num_receivers < 1:
            raise ValueError(f"num_receivers ({num_receivers}) must be >= 1")
        if num_slots < 1:
            raise ValueError(f"num_slots ({num_slots}) must be >= 1 (2 overlaps packing with transfer)")
        if verify not in VERIFY_MODES:
            raise ValueError(f"verify must be one of {VERIFY_MODES}, got {verify!r}")
        if min_receivers < 0:
            raise ValueError(f"min_receivers ({min_receivers}) must be >= 0")
        if not elastic and min_receivers > num_receivers:
            raise ValueError(
                f"min_receivers ({min_receivers}) is for an elastic Sender (elastic=True); a fixed one always "
                f"needs all num_receivers ({num_receivers})"
            )
        if elastic and zero_copy:
            raise ValueError("elastic=True cannot be combined with zero_copy (a joiner would need the source handles)")
        if zero_copy and (transport != "cuda-ipc" or not source.stable_tensors):
            raise ValueError(
                f"zero_copy needs the cuda-ipc transport ({transport!r} given) and a source whose "
                "tensors persist between refits (not a gathering one)"
            )
        self.num_slots = num_slots
        self.zero_copy = zero_copy
        self.verify = verify
        self.elastic = elastic
        self.min_receivers = min_receivers
        self._broken = ""
        self._connected = False
        self.source = source
        self.transport_name = transport
        self._transport_cls = transports.get(transport)
        self.num_receivers = num_receivers
        self.settings = settings or Settings()
        self.device = device or transports.default_device(transport)
        self.verify_checksum = verify_checksum
        lobby = Lobby(address.listen_host(self.settings), port, self.settings.token, backlog=num_receivers + 8)
        self._session = _Session(lobby)
        self._finalizer = weakref.finalize(self, self._session.close)
        self.capacity = 0
        self.manifest: Manifest | None = None
        self._regions: dict[int, dict] = {}
        """Per receiver rank: the regions (shards) it named at its handshake (fingerprint check)."""
        self._digests: DigestPlan | None = None
        self._signature: Hashable = None
        self._path: SendPath | None = None
        self._epoch = 0
        self._generation = 0
        self._group: list[Channel] = []
        """Elastic gloo/nccl: the receivers the transport's group was formed with (a change means a new group)."""
        self._begun = False
        self.statements: list[bytes] = []
        """What each receiver sent with READY: M:N shard statements (JSON; refit.topology.mesh), else empty."""
        self.verdict: Callable[[str], str] | None = None
        """Set by a per-rank driver (refit.topology.ranked): given this Sender's failure ('' when its receivers
        committed), returns the failure across every trainer rank ('' when every worker committed).
        When set, receivers hold their commit open until they are told this verdict."""
        self.vet: Callable[[bytes], str] | None = None
        """Elastic, set by M:N (refit.topology.mesh): given what a joiner sent with READY, '' to take it in, else
        why not (it is told so and dropped before it sees a manifest)."""

    @property
    def channels(self) -> list[Channel]:
        return self._session.channels

    @property
    def _lost(self) -> Callable[[Channel, Exception], None] | None:
        """Elastic: what to do with a receiver lost mid-refit (drop it); else None: the loss fails the refit."""
        return self._drop if self.elastic else None

    @property
    def transport(self) -> Transport | None:
        return self._session.transport

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
        if not self.elastic:
            raise ValueError("await_receivers is for an elastic Sender (Sender(..., elastic=True))")
        self.connect()
        members, pulse = self._session.members, self._session.pulse
        assert members is not None and pulse is not None
        with pulse.lock:  # who left since the last refit does not count
            members.sweep(self.channels, self._drop)
        need = count - len(self.channels)
        return need <= 0 or members.await_ready(need, timeout_s) >= need

    # -- session setup ---------------------------------------------------------------------------

    def connect(self) -> None:
        """Accept every receiver, agree on the bucket capacity, and set up the transport. A connect that
        fails leaves nothing half-built: its channels and transport are closed, and this Sender refuses
        every later call (build a new one)."""
        if self._broken:
            raise PeerError(f"this session broke earlier ({self._broken}); close() it and build a new Sender")
        if self._connected:
            return
        try:
            self._connect()
        except BaseException as e:
            self._broken = f"connect failed: {type(e).__name__}: {e}"
            self._session.drop_peers()
            raise
        self._connected = True

    def _connect(self) -> None:
        self._fall_back_if_needed()
        limits = self._admit()
        own = bucket_capacity(
            bucket_bytes=self.settings.bucket_bytes,
            ratio=self.settings.ratio,
            free=free_bytes(self.device),
            num_slots=self.num_slots,
            needed=needed_bytes(self.source.specs()),
        )
        # Fixed for the session: a model that grows later (a dtype switch) takes more buckets of this size.
        self.capacity = min([own, *limits])
        uses_store = self._transport_cls.uses_store
        store = {"store": AuthenticatedStores(self.settings.token, self.settings)} if uses_store else {}
        transport, info = self._transport_cls.offer(
            capacity=self.capacity,
            num_slots=self.num_slots,
            num_receivers=self.num_receivers,
            device=self.device,
            settings=self.settings,
            **store,
        )
        self._session.transport = transport
        interval = min(HEARTBEAT_MAX_S, self.settings.timeout_s / 4)
        for rank, ch in enumerate(self.channels, start=1):
            welcome = {
                "rank": rank,
                "capacity": self.capacity,
                "transport": self.transport_name,
                "info": info,
                "heartbeat_s": interval,
                **({"elastic": True} if self.elastic else {}),
            }
            data = json.dumps(welcome).encode()
            ch.send(Header(Kind.WELCOME, digest=auth.tag(ch.key, b"WELCOME", data)), data)
        transport.establish()
        self.statements = [ch.expect(Kind.READY, "transport setup")[1] for ch in self.channels]
        if self.elastic:  # the buffers stay open to later joiners (shm keeps its memfds until close)
            members = Membership(
                capacity=self.capacity,
                transport=self.transport_name,
                info=None if uses_store else info,  # a group's joiners are welcomed into the next group
                heartbeat_s=interval,
                timeout_s=self.settings.timeout_s,
            )
            members.start(first_rank=self.num_receivers)
            self._session.members = members
            self._group = list(self.channels)
            self._session.lobby.serve_late(members.arrive)
        else:
            transport.joined()
            self._session.lobby.refuse_late(self.num_receivers)
        waiting = self._session.members.waiting if self._session.members else None
        self._session.pulse = _Pulse(self._session.channels, interval, waiting)
        log.info(
            "connected %d receiver(s) over %s, buckets of %d bytes",
            self.num_receivers,
            self.transport_name,
            self.capacity,
        )

    def _admit(self) -> list[int]:
        """Admit every receiver (token checked by the lobby); return their bucket capacity limits."""
        arrivals = self._session.lobby.admit(self.num_receivers, self.settings.connect_timeout_s)
        limits = []
        for rank, a in enumerate(arrivals, start=1):
            ch = Channel(a.sock, peer=f"receiver {rank} ({a.addr})", timeout_s=self.settings.timeout_s)
            ch.key, ch.rank = a.key, rank
            self.channels.append(ch)
            limit = a.hello.get("capacity")
            if not isinstance(limit, int) or isinstance(limit, bool) or limit <= 0:
                ch.send(Header(Kind.ERROR), {"message": f"invalid capacity limit {limit!r} in HELLO"})
                raise PeerError(f"receiver {rank} sent an invalid capacity limit {limit!r}")
            limits.append(limit)
        return limits

    def _fall_back_if_needed(self) -> None:
        """cuda-ipc where CUDA IPC cannot work: stage through pinned host shared memory, and say why."""
        if self.transport_name != "cuda-ipc" or self.zero_copy:
            return
        from refit.transports.cuda_ipc import blocker

        reason = blocker(self.device, self.settings)
        if reason:
            warnings.warn(
                f"cuda-ipc cannot be used ({reason}); staging through pinned host shared memory "
                "(transport 'shm') instead, which is slower",
                RuntimeWarning,
                stacklevel=3,
            )
            log.warning("cuda-ipc falls back to shm: %s", reason)
            self.transport_name, self._transport_cls, self.device = "shm", transports.get("shm"), torch.device("cpu")

    # -- handshake -------------------------------------------------------------------------------

    def _handshake(self) -> None:
        self._epoch += 1
        manifest = plan(self.source.specs(), capacity=self.capacity, epoch=self._epoch)
        failures = self._offer_manifest(manifest, self.channels)
        if failures:
            self.manifest, self._signature = None, None
            raise HandshakeError(" | ".join(failures))
        if self.zero_copy:
            share_sources(self.source, manifest, self.channels)
        self.manifest = manifest
        self._digests = self._digest_plan()
        assert self.transport is not None
        self._path = SendPath(
            manifest,
            self.transport,
            self.channels,
            settings=self.settings,
            num_slots=self.num_slots,
            zero_copy=self.zero_copy,
            digests=self._digests,
        )
        log.info(
            "handshake: epoch %d, digest %s, %d tensors, %d bucket(s) of %d bytes",
            manifest.epoch,
            manifest.digest.hex()[:12],
            len(manifest.entries),
            manifest.num_buckets,
            manifest.capacity,
        )

    def _offer_manifest(self, manifest: Manifest, channels: list[Channel]) -> list[str]:
        """Send `manifest` to `channels` and read each REPORT (keeping its regions); returns their refusals."""
        payload = manifest.to_json()

        def offer(ch: Channel) -> None:  # each receiver's copy is bound to its session: digest is a MAC under its key
            binding = auth.tag(ch.key, b"MANIFEST", manifest_binding(manifest.epoch, manifest.digest))
            ch.send(Header(Kind.MANIFEST, epoch=manifest.epoch, digest=binding, status=int(bool(self.verify))), payload)

        failures: list[str] = []

        def report(ch: Channel) -> None:
            obj = parse_json(ch.expect(Kind.REPORT, "handshake")[1], "REPORT")
            report = Report.from_json(obj)
            self._regions[ch.rank] = parse_regions(obj.get("regions"), manifest) if self.verify else {}
            if not report.ok:
                failures.append(f"receiver {ch.rank}: {report.message()}")

        each(channels, offer, self._lost)
        each(channels, report, self._lost)
        return failures

    def _digest_plan(self) -> DigestPlan | None:
        """The fingerprint plan for the current manifest and receivers (regions by receiver rank)."""
        if not self.verify or self.manifest is None:
            return None
        return DigestPlan(self.manifest, {ch.rank: self._regions.get(ch.rank, {}) for ch in self.channels})

    def _admit_joiners(self, joiners: list[Channel]) -> None:
        """Elastic, at refit start: each joiner validates the current manifest alone (no other receiver sees it
        again); one that refuses it is told why and dropped, and the refit goes on without it."""
        assert self.manifest is not None and self._path is not None
        for ch in joiners:
            refused = self._offer_manifest(self.manifest, [ch])
            if refused:
                with contextlib.suppress(PeerError):
                    ch.send(Header(Kind.ERROR), {"message": f"this engine does not fit the session: {refused[0]}"})
                self._drop(ch, HandshakeError(refused[0]))
            elif ch.rank in self._regions:  # a joiner lost during its handshake has no regions
                self.channels.append(ch)
        self._digests = self._path.digests = self._digest_plan()

    def _regroup(self, joiners: list[Channel], *, after_break: bool = False) -> None:
        """Elastic gloo/nccl, between refits: a new group of the receivers still here and the joiners (a fixed-size
        group cannot shrink or grow), then a new epoch's handshake for all (their receive paths were on the old one).
        `after_break`: a receiver waiting on the broken group's bytes stops when this REGROUP reaches it, but one
        busy in its engine (loading a bucket) reads it only after that, so the new group waits twice REFIT_TIMEOUT."""
        members = self._session.members
        assert members is not None
        everyone = [*self.channels, *joiners]
        old = self._session.transport
        if old is not None:  # abort: a member still blocked in the old group (a broken refit) fails at once
            getattr(old, "abort", old.close)()
            self._session.transport = None
        self._path, self.manifest, self._group = None, None, []
        if not everyone:  # the next joiner forms the next group
            return
        settings = replace(self.settings, timeout_s=2 * self.settings.timeout_s) if after_break else self.settings
        transport, info = self._transport_cls.offer(
            capacity=self.capacity,
            num_slots=self.num_slots,
            num_receivers=max(1, len(everyone)),
            device=self.device,
            settings=settings,
            store=AuthenticatedStores(self.settings.token, settings),
        )
        self._session.transport = transport
        for g, ch in enumerate(everyone, start=1):
            members.welcome(ch, Kind.WELCOME if ch in joiners else Kind.REGROUP, {**info, "group_rank": g})
        transport.establish()  # every member joins the new group, or this raises (the session is over)
        for ch in everyone:
            statement = _expect_ready(ch)
            if ch in joiners:
                members.stated[ch.rank] = statement
        self.channels[:] = everyone
        self._group = list(everyone)
        log.info("formed a new %s group of %d receiver(s)", self.transport_name, len(everyone))
        if len(self._vetted(joiners)) < len(joiners):  # a refused joiner is in the group: form it again without
            self._regroup([], after_break=after_break)

    def _vetted(self, joiners: list[Channel]) -> list[Channel]:
        """The joiners whose READY statement `vet` accepts; each other one is told why and dropped."""
        members = self._session.members
        assert members is not None
        if self.vet is None:
            members.stated.clear()
            return joiners
        kept = []
        for ch in joiners:
            why = self.vet(members.stated.pop(ch.rank, b""))
            if not why:
                kept.append(ch)
                continue
            with contextlib.suppress(PeerError):
                ch.send(Header(Kind.ERROR), {"message": f"this engine does not fit the session: {why}"})
            self._drop(ch, HandshakeError(why))
        return kept

    def _drop(self, ch: Channel, error: Exception) -> None:
        """Elastic: `ch` left (LEAVE, closed, died or broke the protocol): the refit goes on without it."""
        if ch in self.channels:
            self.channels.remove(ch)
        if self._digests is not None:
            self._digests.forget(ch.rank)
        self._regions.pop(ch.rank, None)
        assert self._session.members is not None
        self._session.members.drop(ch, error)

    def _changed(self) -> bool:
        """The cheap signature moved: does that need a new epoch? Yes if any spec or alias changed, and in
        zero-copy mode also when only storage or layout moved (the exported handles point at the old memory)."""
        assert self.manifest is not None
        if self.zero_copy:
            return True
        return sorted(self.source.specs(), key=lambda s: s.name) != [p.spec for p in self.manifest.entries]

    # -- refit -----------------------------------------------------------------------------------

    def refit(self, version: int) -> RefitStats:
        """Send the source's current weights as `version`; returns when every receiver committed.

        A receiver that fails reports it here as RefitError while the session stays usable (retry the
        same version). A dead or silent peer raises PeerError and ends the session: make a new Sender.
        """
        if self._broken:
            raise PeerError(f"this session broke earlier ({self._broken}); close() it and build a new Sender")
        if not self._finalizer.alive:
            raise ValueError("this Sender is closed; start a new one")
        pulse = self._session.pulse
        self._begun = False
        try:
            if pulse is None:
                return self._refit(version)
            with pulse.lock:
                return self._refit(version)
        except PeerError as e:
            self._broken = self._broken or str(e)
            log.error("session broken: %s", e)
            raise
        except Exception as e:
            if self._begun and not isinstance(e, RefitError):
                self._abort(version, e)
            raise

    def _abort(self, version: int, error: Exception) -> None:
        """The trainer side failed mid-refit (its source raised, say): tell every receiver at once, so none
        waits out its timeout, and end the session (their weights are mixed; they report 'failed')."""
        self._broken = f"the trainer failed during refit {version}: {type(error).__name__}: {error}"
        log.error("aborting refit %d: %s", version, self._broken)
        for ch in self.channels:
            with contextlib.suppress(PeerError):
                ch.send(Header(Kind.ERROR), {"message": self._broken})

    def _refit(self, version: int) -> RefitStats:
        t_connect = time.perf_counter()
        if not self._connected:
            self.connect()
            if self._session.pulse is not None:  # connected inside this call: hold off heartbeats as refit() does
                with self._session.pulse.lock:
                    return self._refit_connected(version, t_connect)
        return self._refit_connected(version, t_connect)

    def _refit_connected(self, version: int, t_connect: float) -> RefitStats:
        try:
            return self._refit_once(version, t_connect)
        except PeerError as e:
            if not (self.elastic and self._transport_cls.uses_store and self._begun):
                raise
            # A member died mid-refit and broke the group for everyone: drop it, form a new group, retry once.
            log.warning(
                "the %s group broke during refit %d (%s); retrying it once in a new group",
                self.transport_name,
                version,
                e,
            )
            self._settle()
            self._group, self._begun = [], False
            return self._refit_once(version, t_connect, retry=True)

    def _settle(self) -> None:
        """After a broken group: drop each receiver whose connection ended; read (and forget) what the rest said
        of the broken refit so far."""
        for ch in list(self.channels):
            try:
                while readable(ch):
                    ch.recv("the refit the group broke in")
            except (PeerError, IntegrityError) as e:
                self._drop(ch, e)

    def _refit_once(self, version: int, t_connect: float, *, retry: bool = False) -> RefitStats:
        t0 = time.perf_counter()
        members = self._session.members
        joiners = []
        if members is not None:  # elastic: who left since the last refit, who is ready to join
            if not retry:  # (a retry's receivers may still be acknowledging the broken attempt: _settle saw to them)
                members.sweep(self.channels, self._drop)
            joiners = members.take_ready()
            if not self._transport_cls.uses_store:  # a group's joiners say READY (and are vetted) in _regroup
                joiners = self._vetted(joiners)
            if self._transport_cls.uses_store and (joiners or self.channels != self._group):
                self._regroup(joiners, after_break=retry)
                joiners = []
            if not self.channels and not joiners:
                if self.min_receivers:
                    raise RefitError(self._too_few(version, "reached", 0, members.departed))
                log.warning("refit of version %d reached no receiver: none is connected", version)
                return RefitStats(version=version, epoch=self._epoch, departed=members.take_departed())
        signature = self.source.signature()
        moved = signature != self._signature
        handshake = self.manifest is None or (moved and self._changed())
        if handshake:
            self.channels.extend(joiners)
            self._handshake()
        elif joiners:
            self._admit_joiners(joiners)
        if moved or not self.source.signature_covers_layout:
            self._generation += 1  # cached copy plans must check their tensors' layout again
        self._signature = signature
        m = self.manifest
        assert m is not None
        stats = RefitStats(
            version=version, epoch=m.epoch, handshake=handshake, num_buckets=m.num_buckets, nbytes=m.nbytes
        )
        stats.add("connect", t0 - t_connect)
        stats.add("handshake", time.perf_counter() - t0)
        ctrl0 = self._control_bytes()
        begin = Header(
            Kind.BEGIN,
            epoch=m.epoch,
            version=version,
            digest=m.digest,
            index=m.num_buckets,
            status=int(self.zero_copy) | (2 if self._two_phase() else 0),
        )
        if self.zero_copy:  # the optimizer's writes must be done before receivers read the tensors
            torch.cuda.current_stream(self.device).synchronize()
        each(self.channels, lambda ch: ch.send(begin), self._lost)
        self._begun = True
        assert self._path is not None
        errors = self._path.send(
            self.source, version, stats, self._generation, verify_checksum=self.verify_checksum, on_lost=self._lost
        )
        self._commit(m, version, stats, errors)
        stats.control_bytes = max(0, self._control_bytes() - ctrl0)  # a receiver dropped mid-refit takes its count
        stats.seconds["total"] = time.perf_counter() - t0
        log.info(
            "committed version %d: %d bytes in %d bucket(s), %.1f ms",
            version,
            m.nbytes,
            m.num_buckets,
            stats.seconds["total"] * 1e3,
        )
        return stats

    def _commit(self, m: Manifest, version: int, stats: RefitStats, errors: list[str]) -> None:
        t = time.perf_counter()
        commit = Header(Kind.COMMIT, epoch=m.epoch, version=version, digest=m.digest)
        each(self.channels, lambda ch: ch.send(commit), self._lost)
        failures: list[str] = []
        committed: list[Channel] = []
        names: set[str] = set()

        def done(ch: Channel) -> None:  # every DONE is read, whatever it says, so the next refit starts in step
            header, payload = ch.expect(Kind.DONE, f"commit of version {version}")
            try:
                answer = parse_json(payload, "DONE") if payload else {}
            except IntegrityError as e:
                failures.append(f"{ch.peer}: {e}")
                return
            if header.status:
                failures.append(f"{ch.peer}: {answer.get('message', 'unknown error')}")
            else:
                committed.append(ch)
            unverified = answer.get("unverified")
            if isinstance(unverified, int) and not isinstance(unverified, bool):
                stats.unverified = max(stats.unverified, unverified)
            listed = answer.get("unverified_names")
            if isinstance(listed, list):
                names.update(str(n) for n in listed[:100_000])

        each(self.channels, done, self._lost)
        stats.add("commit", time.perf_counter() - t)
        _set_unverified_names(stats, sorted(names))
        self._record_members(stats, committed, version)
        if self.verdict is not None and self.elastic and not committed and not failures:
            failures.append(
                f"its engine worker departed during the refit ({_named(stats.departed)}); its shard has no other "
                "holder, so no worker commits; a replacement under the same worker index takes the next refit"
            )
        if self.verify == "strict" and names and not failures and not errors:
            failures.append(_strict_failure(sorted(names)))
        few = self.elastic and len(stats.receivers) < self.min_receivers and not failures and not errors
        if few and self._two_phase():  # the verdict makes it fail on the receivers holding their commit open
            failures.append(self._too_few(version, "committed on", len(stats.receivers), stats.departed))
        if failures or errors:
            own = (
                f"refit of version {version} failed; receivers keep their last committed weights and report "
                f"state 'failed': {'; '.join(failures or errors)}"
            )
        else:
            own = ""
        if self._two_phase():
            own = self._decide(m, version, own, committed)
        if own:
            raise RefitError(own)
        if few:  # committed where it reached: those receivers hold the version
            raise RefitError(self._too_few(version, "committed on", len(stats.receivers), stats.departed))

    def _record_members(self, stats: RefitStats, committed: list[Channel], version: int) -> None:
        """Who took this refit, and (elastic) who departed since the last one's stats."""
        stats.receivers = sorted(ch.rank for ch in committed if ch in self.channels)
        if self._session.members is not None:
            stats.departed = self._session.members.take_departed()

    def _too_few(self, version: int, did: str, count: int, departed: list[dict]) -> str:
        """Elastic: fewer than `min_receivers` took the refit. Who left stays listed for the next refit's stats."""
        members = self._session.members
        if members is not None and departed is not members.departed:
            members.departed[:0] = departed
        return (
            f"refit of version {version} {did} {count} receiver(s), fewer than min_receivers ({self.min_receivers}); "
            f"departed since the last refit's stats: {_named(departed)}; start or reconnect an engine (await_receivers "
            "waits for one), or pass min_receivers=0 to let a refit reach none"
        )

    def _two_phase(self) -> bool:
        """Receivers hold their commit open until told the verdict: per-rank refits, and strict
        verification (whose verdict needs every receiver's list of unverified tensors)."""
        return self.verdict is not None or self.verify == "strict"

    def _decide(self, m: Manifest, version: int, own: str, committed: list[Channel]) -> str:
        """Agree with the other trainer ranks (per-rank refit), then tell the receivers that committed."""
        verdict = self.verdict(own) if self.verdict is not None else own
        told = Header(Kind.COMMIT, epoch=m.epoch, version=version, digest=m.digest, status=int(bool(verdict)))
        still = [ch for ch in committed if ch in self.channels]
        each(still, lambda ch: ch.send(told, {"message": verdict}), self._lost)
        return own or (
            f"refit of version {version} failed on another trainer rank; every worker reports state 'failed': {verdict}"
            if verdict
            else ""
        )

    def _control_bytes(self) -> int:
        return sum(ch.bytes_sent + ch.bytes_received for ch in self.channels)

    def predicted_memory(self) -> dict[str, int]:
        """Predicted bytes each side allocates or maps for the current manifest (buffers x slots, and the
        receiver's staging tensor); `refit.tools.bench.memory.MemoryProbe` measures the same."""
        if self.manifest is None:
            raise ValueError("no manifest yet: call refit() (or connect and handshake) first")
        f = forecast(self.manifest, num_slots=self.num_slots)
        return {"sender": f.sender_bytes, "receiver": f.receiver_bytes}

    def close(self) -> None:
        """End the session: tell receivers, stop heartbeats, release the transport and sockets, and drop
        the send path's views into the buffers."""
        self._finalizer()
        self._path = None

    def __enter__(self) -> Sender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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


def _set_unverified_names(stats: RefitStats, names: list[str]) -> None:
    """Record the tensors no receiver could read back (RefitStats may not have the field in older installs)."""
    with contextlib.suppress(AttributeError, TypeError):
        stats.unverified_names = names  # type: ignore[attr-defined]


def _strict_failure(names: list[str]) -> str:
    shown = ", ".join(names[:10]) + (f" and {len(names) - 10} more" if len(names) > 10 else "")
    return (
        f"verify='strict': {len(names)} tensor(s) could not be read back from the engine to verify: {shown}; "
        "verify='fingerprint' accepts unverified tensors"
    )
