"""Receiver: the engine side's session (connect and join, handshake per epoch, commit and the per-rank
verdict, close). Each refit's buckets go through the epoch's data path, `refit.topology.receive_path`."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable

import torch

from refit import transports
from refit.checks.manifest_check import validate
from refit.engines.base import Engine
from refit.engines.staging import Split, Staging
from refit.errors import HandshakeError, IntegrityError, PeerError, RefitError
from refit.layout.budget import bucket_capacity, free_bytes
from refit.layout.manifest import Manifest
from refit.layout.spec import TensorSpec, changes
from refit.log import get_logger
from refit.protocol import auth
from refit.protocol.lobby import read_auth
from refit.protocol.store import AuthenticatedStores
from refit.protocol.wire import (
    MAX_REASON_CHARS,
    Begin,
    Channel,
    Header,
    Kind,
    Offer,
    PeerFailed,
    parse_json,
)
from refit.settings import Settings, check_bucket_bytes
from refit.topology.digest_plan import engine_regions
from refit.topology.receive_path import ReceivePath
from refit.topology.stats import RefitStats
from refit.transports.base import Transport

log = get_logger("receiver")
MAX_WELCOME_BYTES = 1 << 20
"""Largest WELCOME read (transport setup: a few paths or an address)."""


class Receiver:
    """Runs in the engine's process; `receive()` handles one refit (and any handshake before it)."""

    def __init__(
        self,
        engine: Engine,
        rendezvous: dict,
        *,
        settings: Settings | None = None,
        device: torch.device | None = None,
        staged: bool = False,
        staging_bytes: int | None = None,
        on_commit: Callable[[int], None] | None = None,
    ) -> None:
        """`rendezvous` is what `Sender.rendezvous()` returned (host, port, token, transport).

        `staged`: refits land in staging memory while the engine keeps generating with its current version;
        `apply_staged()` moves a verified, committed version into the live engine (refit.engines.staging).
        `staging_bytes` bounds that memory: the tensors first in bucket order that fit are staged; the rest is
        received during the pause, straight into the live engine (`staging_split` says what the pause covers).
        `on_commit(version)` is called each time the live engine commits a version (staged: in `apply_staged`)."""
        self.engine = engine
        self.settings = settings or Settings()
        check_bucket_bytes(self.settings.bucket_bytes)  # Settings is mutable: checked again before any socket
        self.rendezvous = rendezvous
        name = rendezvous.get("transport")
        if not isinstance(name, str):
            raise ValueError("rendezvous must name a transport")
        self._transport_cls = transports.get(name)
        self.device = device or transports.default_device(name)
        self.channel: Channel | None = None
        self.transport: Transport | None = None
        self.rank = 0
        self.manifest: Manifest | None = None
        self._path: ReceivePath | None = None
        self._layout: list[TensorSpec] | None = None
        """The engine's specs this epoch's manifest was validated against (`_relayout` checks them per refit)."""
        self._broken = ""
        self._ended = False
        """The sender ended the session (CLOSE), or this side already said LEAVE: nothing more to tell it."""
        self._idle_timeout_s = self.settings.timeout_s
        self.warn_unverified = True
        """Log the tensors the fingerprint cannot read back (once per epoch); M:N logs it for one pair only."""
        self._regroups = False
        """Elastic gloo/nccl (WELCOME says elastic): a broken group is re-formed by the sender, not the end."""
        self.statement: dict | None = None
        """M:N: what this worker keeps (refit.topology.mesh), sent with READY for the trainer's plan."""
        self.on_commit = on_commit
        self.staging = _staging(engine, self.device, staged=staged, limit=staging_bytes, settings=self.settings)
        """The staged refit's side (None: refits load the live engine directly); the protocol drives it."""
        self.staging_split: Split | None = None
        """Staged: how this epoch's tensors divide between staging memory and the pause."""
        if self.staging is not None:
            self.engine = self.staging

    def connect(self) -> None:
        """Connect to the sender, present the token and join the transport. On failure the sender is
        told why and the socket is closed."""
        if self.channel is not None:
            return
        host, port = self.rendezvous.get("host"), self.rendezvous.get("port")
        try:
            sock = socket.create_connection((host, port), timeout=self.settings.timeout_s)
        except OSError as e:
            raise PeerError(f"cannot connect to the sender at {host}:{port}: {e}; is it running?") from None
        ch = Channel(sock, peer=f"sender ({host}:{port})", timeout_s=self.settings.timeout_s)
        try:
            self._join(ch)
        except BaseException as e:
            if not isinstance(e, PeerError) or "failed:" not in str(e):  # the sender already knows when it refused us
                with contextlib.suppress(PeerError):
                    ch.send(Header(Kind.ERROR), {"message": f"receiver could not join: {e}"})
            ch.close()
            raise
        self.channel = ch
        ch.send(Header(Kind.READY), self.statement)
        log.info("joined as receiver %d over %s", self.rank, self._transport_cls.name)

    def _join(self, ch: Channel) -> None:
        limit = bucket_capacity(
            bucket_bytes=self.settings.bucket_bytes, ratio=self.settings.ratio, free=free_bytes(self.device)
        )
        ch.set_timeout(self.settings.connect_timeout_s)  # the sender admits every receiver first; they start slowly
        self._authenticate(ch, limit)
        # idle: an elastic gloo/nccl sender welcomes a joiner when it forms its next group, beating meanwhile
        header, raw = ch.recv(
            "rendezvous (waiting for every receiver to connect)", idle=True, max_payload=MAX_WELCOME_BYTES
        )
        if header.kind != Kind.WELCOME:
            raise PeerError(f"{ch.peer} sent {header.kind.name} during rendezvous, expected WELCOME")
        self._join_group(ch, header, raw, limit)

    def _join_group(self, ch: Channel, header: Header, raw: bytes, limit: int) -> None:
        """`_setup`; elastic gloo/nccl: a group the sender gave up forming (a member did not join in time: it
        closed the group's store under this side) is joined again from the sender's next REGROUP."""
        while True:
            try:
                self._setup(ch, header, raw, limit)
                return
            except PeerError as e:
                if not self._regroups:
                    raise
                log.warning("could not join the sender's new group (%s); waiting for it to form one again", e)
            header, raw = ch.recv(
                "the sender's new group (formed again without a member)",
                timeout_s=self._idle_timeout_s,
                max_payload=MAX_WELCOME_BYTES,
            )
            if header.kind != Kind.REGROUP:
                raise PeerError(f"{ch.peer} sent {header.kind.name} while forming its new group, expected REGROUP")

    def _setup(self, ch: Channel, header: Header, raw: bytes, limit: int) -> None:
        """Join the transport WELCOME (or, elastic gloo/nccl, REGROUP) describes, once its MAC checks out."""
        what = header.kind.name
        if not auth.check_tag(ch.key, what.encode(), raw, header.digest):
            raise IntegrityError(f"{ch.peer}'s {what} is not bound to this session (its MAC is wrong); not trusted")
        welcome = parse_json(raw, what)
        ch.set_timeout(self.settings.timeout_s)
        rank, capacity, info = welcome.get("rank"), welcome.get("capacity"), welcome.get("info")
        beat = welcome.get("heartbeat_s")
        if isinstance(beat, (int, float)) and not isinstance(beat, bool) and 0 < beat < 3600:
            # Never call a live sender dead for beating slower than this side's own timeout allows.
            self._idle_timeout_s = max(self.settings.timeout_s, 3 * float(beat))
        name = welcome.get("transport")
        if isinstance(name, str) and name != self.rendezvous.get("transport"):  # the sender fell back
            self._transport_cls = transports.get(name)
            self.device = transports.default_device(name)
        if not (
            isinstance(rank, int) and isinstance(capacity, int) and 0 < capacity <= limit and isinstance(info, dict)
        ):
            raise IntegrityError(f"WELCOME is malformed or asks for more than this side's limit ({limit} bytes)")
        if info.get("capacity", capacity) != capacity:
            raise IntegrityError(
                f"WELCOME's transport setup sizes buffers of {info.get('capacity')!r:.40}, not {capacity}"
            )
        self._regroups = welcome.get("elastic") is True and self._transport_cls.uses_store
        token = str(self.rendezvous.get("token") or "")
        store = {"store": AuthenticatedStores(token, self.settings)} if self._transport_cls.uses_store else {}
        self.transport = self._transport_cls.join(info, rank=rank, device=self.device, settings=self.settings, **store)
        self.rank = rank

    def _authenticate(self, ch: Channel, limit: int) -> None:
        """Both sides prove the token (refit.protocol.auth); nothing else is read from the sender before its proof."""
        token = str(self.rendezvous.get("token") or "")
        mine = auth.nonce()
        ch.send(Header(Kind.HELLO), {"protocol": auth.PROTOCOL_VERSION, "nonce": mine.hex(), "capacity": limit})
        try:
            msg = read_auth(ch, "authentication")
        except PeerError as e:
            if "wrong token" not in str(e):
                raise
            raise PeerError(
                f"{e}; a sender that refuses before authenticating runs an older refit (protocol version before "
                f"{auth.PROTOCOL_VERSION}): install the same refit version on the trainer and engine hosts"
            ) from None
        if msg.get("protocol") != auth.PROTOCOL_VERSION:
            raise PeerError(
                f"protocol version mismatch: the sender speaks {str(msg.get('protocol'))[:40]}, this receiver speaks "
                f"{auth.PROTOCOL_VERSION}; install the same refit version on the trainer and engine hosts"
            )
        theirs = auth.parse_nonce(msg.get("nonce"))
        if theirs is None or not auth.verify(token, auth.SENDER, mine, theirs, msg.get("proof")):
            raise PeerError(
                f"{ch.peer} did not prove it knows the token: wrong token on this side (pass the token from "
                "Sender.rendezvous()), or it is not this session's sender; nothing it names was used"
            )
        ch.send(Header(Kind.AUTH), {"proof": auth.proof(token, auth.RECEIVER, mine, theirs)})
        ch.key = auth.session_key(token, mine, theirs)

    def receive(self) -> RefitStats | None:
        """Handle messages until one refit is committed (returns its stats) or the sender closes (None).

        Raises HandshakeError or RefitError for a refused manifest or a failed refit (the session goes
        on: the sender may retry), PeerError when the sender is gone or broke the protocol (it is over).
        """
        if self._broken:
            raise PeerError(f"this session broke earlier ({self._broken}); connect a new Receiver")
        try:
            stats = self._receive()
        except PeerError as e:
            self._broken = str(e)
            self._abort_staged(str(e))
            raise
        except BaseException as e:
            self._abort_staged(f"the receive side stopped: {type(e).__name__}: {e}")
            raise
        if stats is None:
            self._ended = True
        else:
            self._committed(stats.version)
        return stats

    def _committed(self, version: int) -> None:
        """Every worker's verdict is in: a staged version becomes ready, an unstaged one is live."""
        if self.staging is not None:
            self.staging.publish(version)
        elif self.on_commit is not None:
            self.on_commit(version)

    def _abort_staged(self, reason: str) -> None:
        """A refit under way when the receive side stopped is failed, so a paused engine loop is let go."""
        if self.staging is not None:
            self.staging.abort(reason)

    def apply_staged(self) -> bool:
        """Between generation steps: load the staged version (if one is ready) into the live engine and commit
        it there; returns whether one was. Without one, or unstaged, a no-op costing well under a microsecond.
        Partial staging (`staging_bytes`): when a refit needs the pause, stays until that refit ends, and raises
        RefitError if it failed (after writing into the live engine, which then reads `failed`, or before, with
        the live weights untouched). Raises RefitError, applying nothing, when the live engine's tensors changed
        since the version was staged (it stays staged)."""
        version = None if self.staging is None else self.staging.apply()
        if version is None:
            return False
        if self.on_commit is not None:
            self.on_commit(version)
        return True

    def _receive(self) -> RefitStats | None:
        self.connect()
        assert self.channel is not None
        while True:
            header, payload = self.channel.recv(
                "waiting for the next refit (no heartbeat from the sender: "
                "is its process alive and its host reachable?)",
                idle=True,
                timeout_s=self._idle_timeout_s,
            )
            if header.kind == Kind.MANIFEST:
                self._handshake(header, payload)
            elif header.kind == Kind.SOURCES:
                assert self._path is not None
                self._path.open_sources(payload)
            elif header.kind == Kind.BEGIN:
                return self._refit(header)
            elif header.kind == Kind.REGROUP:
                self._regroup(header, payload)
            elif header.kind == Kind.CLOSE:
                return None
            else:
                raise PeerError(f"sender sent {header.kind.name} between refits")

    def _after_broken_group(self, version: int, error: PeerError) -> RefitStats | None:
        """Elastic gloo/nccl: the group broke mid-refit (a member died). The sender forms a new group and retries
        the version: wait for its REGROUP (skipping what is left of the broken refit), join it and go on."""
        ch = self.channel
        assert ch is not None
        stray, ch.stray = ch.stray, None
        stage = f"the sender's new group (refit {version} broke: {error})"
        header, payload = stray if stray is not None else ch.recv(stage)
        while header.kind in (Kind.BUCKET, Kind.VERIFY, Kind.COMMIT):
            header, payload = ch.recv(stage)
        if header.kind == Kind.CLOSE:
            return None
        if header.kind != Kind.REGROUP:
            raise PeerError(f"{ch.peer} sent {header.kind.name} after refit {version} broke, expected REGROUP")
        log.warning(
            "refit %d broke in the %s group (%s); joining the sender's new group",
            version,
            self._transport_cls.name,
            error,
        )
        self._regroup(header, payload)
        return self._receive()

    def _regroup(self, header: Header, payload: bytes) -> None:
        """Elastic gloo/nccl: the sender formed a new group (someone joined or left): leave the old one, join
        the new one, say READY; the new epoch's manifest follows (this side's receive path was on the old group)."""
        assert self.channel is not None
        old, self.transport = self.transport, None
        if old is not None:
            # Closing a group that a dead member broke waits until its pending receives time out (gloo joins its
            # worker threads): closed aside, so that this receiver joins the new group within the sender's window.
            leave = getattr(old, "abort", old.close)
            threading.Thread(target=leave, name="refit-old-group", daemon=True).start()
        release = getattr(self.engine, "release_buffers", None)
        if callable(release):
            release()
        self.manifest, self._path = None, None
        limit = bucket_capacity(
            bucket_bytes=self.settings.bucket_bytes, ratio=self.settings.ratio, free=free_bytes(self.device)
        )
        self._join_group(self.channel, header, payload, limit)
        self.channel.send(Header(Kind.READY), self.statement)
        log.info("joined the sender's new group")

    def serve(self) -> int:
        """Receive refits until the sender closes; returns how many were committed."""
        n = 0
        while self.receive() is not None:
            n += 1
        return n

    def _handshake(self, header: Header, payload: bytes) -> None:
        assert self.channel is not None and self.transport is not None
        self.manifest, self._path = None, None
        try:
            manifest = Manifest.from_json(payload)
        except (ValueError, RecursionError) as e:
            self.channel.send(Header(Kind.ERROR), {"message": f"receiver {self.rank} rejected the manifest: {e}"})
            raise IntegrityError(f"sender's manifest is malformed: {e}") from None
        binding = auth.manifest_binding(manifest.epoch, manifest.digest)
        if not auth.check_tag(self.channel.key, b"MANIFEST", binding, header.digest):
            msg = "manifest is not bound to this session (its MAC under the session key is wrong)"
            self.channel.send(Header(Kind.ERROR), {"message": f"receiver {self.rank} rejected the manifest: {msg}"})
            raise IntegrityError(msg)
        if manifest.capacity != len(self.transport.buffers[0]):
            msg = f"manifest capacity {manifest.capacity} differs from the agreed {len(self.transport.buffers[0])}"
            self.channel.send(Header(Kind.ERROR), {"message": f"receiver {self.rank}: {msg}"})
            raise IntegrityError(msg)
        prepare = getattr(self.engine, "prepare", None)  # M:N (refit.engines.pieces): check the pair's pieces
        if callable(prepare):
            try:
                prepare(manifest)
            except ValueError as e:
                self.channel.send(Header(Kind.ERROR), {"message": f"receiver {self.rank} rejected the manifest: {e}"})
                raise IntegrityError(f"sender's M:N pieces do not fit this worker: {e}") from None
        layout = self.engine.specs()
        report = validate(
            [p.spec for p in manifest.entries],  # with aliases: which names share one source
            layout,
            exact_shapes=self.engine.exact_shapes,
            optional=self.engine.optional_names,
        )
        self.staging_split = self.staging.split(manifest) if report.ok and self.staging is not None else None
        regions = engine_regions(manifest, self.engine) if Offer.FINGERPRINT & header.status and report.ok else {}
        self.channel.send(Header(Kind.REPORT), {**report.to_json(), "regions": regions})
        if not report.ok:
            raise HandshakeError(report.message())
        log.info(
            "handshake: epoch %d, digest %s, %d tensors, %d bucket(s)",
            manifest.epoch,
            manifest.digest.hex()[:12],
            len(manifest.entries),
            manifest.num_buckets,
        )
        if self.staging_split is not None and self.staging_split.num_direct:
            log.info("staged refit, epoch %d: %s", manifest.epoch, self.staging_split.describe())
        self.manifest, self._layout = manifest, layout
        self._path = ReceivePath(
            self.engine,
            manifest,
            self.transport,
            self.channel,
            settings=self.settings,
            device=self.device,
            rank=self.rank,
            fingerprint=bool(Offer.FINGERPRINT & header.status),
            delta=bool(Offer.DELTA & header.status),
        )
        self._path._warned_unverified = not self.warn_unverified

    def _refit(self, begin: Header) -> RefitStats:
        m, ch = self.manifest, self.channel
        assert ch is not None
        if m is None or begin.epoch != m.epoch or begin.digest != m.digest:
            msg = "refit started for a manifest this receiver has not validated (epoch or digest differs)"
            ch.send(Header(Kind.ERROR), {"message": msg})
            raise IntegrityError(msg)
        t0, version = time.perf_counter(), begin.version
        stats = RefitStats(version=version, epoch=m.epoch, num_buckets=m.num_buckets, nbytes=m.nbytes)
        stats.full_bytes, stats.delta = sum(m.bucket_nbytes), bool(Begin.DELTA & begin.status)
        ctrl0 = ch.bytes_sent + ch.bytes_received
        self.engine.begin(version)
        done: dict = {}
        try:
            assert self._path is not None
            refused = self._relayout(m, version) or self._delta_base(begin)
            if self.staging_split is not None:  # as split for this refit (a followed relayout splits again)
                stats.staged_bytes = self.staging_split.staged_nbytes
                stats.direct_bytes = self.staging_split.direct_wire_nbytes
            failure = self._path.take(begin, stats, refused)
            header, payload = ch.recv(f"commit of version {version}")
            if header.kind == Kind.VERIFY:
                failure = failure or self._path.check_fingerprints(payload, stats, done)
                header, payload = ch.recv(f"commit of version {version}")
            if header.kind != Kind.COMMIT:
                raise PeerError(
                    f"{ch.peer} sent {header.kind.name} during commit of version {version}, expected COMMIT"
                )
        except RefitError as e:
            self.engine.fail(version, str(e))
            # a broken group is formed again; the sender's ERROR (PeerFailed) says it gave up: no REGROUP follows
            if isinstance(e, PeerError) and not isinstance(e, PeerFailed) and self._regroups:
                return self._after_broken_group(version, e)
            raise
        t = time.perf_counter()
        self._flush(version)
        two_phase = bool(Begin.TWO_PHASE & begin.status)  # a vote across ranks, or strict: committed once told
        failure = failure or self._finalize(version, two_phase)
        if failure is not None:
            self.engine.fail(version, str(failure))
            log.error("refit of version %d failed: %s", version, failure)
            ch.send(Header(Kind.DONE, status=1, version=version), {"message": f"receiver {self.rank}: {failure}"})
            raise failure
        ch.send(Header(Kind.DONE, version=version), done or None)
        if two_phase:
            self._await_verdict(version)
        if self._path is not None and self._path.image is not None:
            self._path.image.version = version  # the base a later delta may name
        log.info("committed version %d (%d bytes, %d bucket(s))", version, m.nbytes, m.num_buckets)
        stats.add("commit", time.perf_counter() - t)
        stats.control_bytes = ch.bytes_sent + ch.bytes_received - ctrl0
        stats.seconds["total"] = time.perf_counter() - t0
        return stats

    def _delta_base(self, begin: Header) -> RefitError | None:
        """A delta refit must name the version this receiver's wire image holds; from here until this refit
        commits the image is being rewritten, so it stands for no version."""
        image = self._path.image if self._path is not None else None
        held = image.version if image is not None else None
        if image is not None:
            image.version = None
        if not Begin.DELTA & begin.status or (held is not None and held == begin.checksum):
            return None
        holds = "no delta image this epoch" if image is None else f"an image of version {held}"
        return IntegrityError(
            f"refused a delta refit of version {begin.version} against base version {begin.checksum}: this receiver "
            f"holds {holds} (it joined, failed or missed a version); nothing of it was loaded. The sender's next "
            "refit goes full"
        )

    def _relayout(self, m: Manifest, version: int) -> RefitError | None:
        """The engine's tensors changed since this epoch's manifest was validated (recast, reshaped): validate
        it again here. A layout it still fits goes on (staging follows it); one it no longer fits refuses the
        refit before any byte is loaded, naming the tensor."""
        try:
            now = self.engine.layout()
            if now is self._layout or now == self._layout:
                return None
            now = self.engine.specs()  # staging re-reads the live engine's dtypes here
            report = validate(
                [p.spec for p in m.entries],
                now,
                exact_shapes=self.engine.exact_shapes,
                optional=self.engine.optional_names,
            )
        except Exception as e:  # noqa: BLE001 - any engine error fails the refit, reported to the sender
            return RefitError(f"engine failed to state its tensors for refit {version}: {type(e).__name__}: {e}")
        changed = changes(self._layout, now)
        if not report.ok:
            self._layout = None  # validated again at every refit, until a layout fits
            return HandshakeError(
                f"the engine's tensors changed since the handshake of epoch {m.epoch} ({changed}) and no longer fit "
                f"the trainer's manifest: {report.message()}; nothing of refit {version} was loaded. Put them back, "
                "or change the trainer's tensors (wire dtype or shape) so that the next refit starts a new epoch"
            )
        log.info(
            "refit %d: the engine's tensors changed since the handshake (%s); the manifest still fits", version, changed
        )
        self._layout = now
        if self.staging is not None:
            self.staging_split = self.staging.split(m)
            self.staging.follow()
        return None

    def _await_verdict(self, version: int) -> None:
        """The engine stays 'updating' until every worker committed; any error or silence here fails it."""
        assert self.channel is not None
        try:
            header, payload = self.channel.expect(Kind.COMMIT, f"every worker's commit of version {version}")
            if header.status:
                reason = str(parse_json(payload, "COMMIT").get("message", "")) or "another worker failed"
                raise RefitError(
                    f"version {version} loaded here but failed on another worker or the sender's check: {reason}"
                )
        except BaseException as e:
            self.engine.fail(version, f"not every worker committed version {version}: {e}")
            raise
        self.engine.versions.commit(version)  # the state only: the engine's own commit ran

    def _flush(self, version: int) -> None:
        """Wait for every transfer; a transport failure is the peer's (PeerError), never the engine's."""
        assert self.transport is not None and self.channel is not None
        try:
            self.transport.flush()
        except Exception as e:  # noqa: BLE001 - CUDA/NCCL raise RuntimeError subclasses; all end the session
            msg = f"receiver {self.rank}: {self.transport.name} transfer failed before commit of version {version}: {e}"
            self.engine.fail(version, msg)
            with contextlib.suppress(PeerError):
                self.channel.send(Header(Kind.ERROR), {"message": msg})
            raise PeerError(msg) from None

    def _finalize(self, version: int, two_phase: bool) -> RefitError | None:
        """Commit the engine; one that fails here still answers the sender. In a two-phase refit the
        engine goes back to 'updating' (the state only, none of its own begin work) until the verdict."""
        last = self.engine.versions.weights.version  # updating since BEGIN: the last committed version
        try:
            self.engine.commit(version)
            if two_phase:
                self.engine.versions.await_verdict(version, last)
        except Exception as e:  # noqa: BLE001 - any engine error fails the commit, reported to the sender
            return RefitError(f"engine failed to commit version {version}: {type(e).__name__}: {e}")
        return None

    def leave(self, reason: str = "the engine is shutting down") -> None:
        """Leave the session on purpose, between refits: the sender is told LEAVE with `reason` (an elastic
        sender drops this receiver and names it in `RefitStats.departed`; any other fails its next refit
        saying so), then everything is closed as by `close`."""
        self._say_leave(reason)
        self.close()

    def _say_leave(self, reason: str) -> None:
        """LEAVE with `reason`, once, unless the session is over already (CLOSE came, or it broke)."""
        if self.channel is not None and not self._broken and not self._ended:
            self._ended = True
            with contextlib.suppress(PeerError):
                self.channel.send(Header(Kind.LEAVE), {"reason": str(reason)[:MAX_REASON_CHARS]})

    def close(self) -> None:
        """End the session: tell the sender (LEAVE, "the receiver closed", so that it does not read this as a
        crash), close the channel and transport, and drop every view into the receive buffers (the engine's
        copy plans, the receive path), so no mapping of them outlives the session."""
        self._say_leave("the receiver closed")
        self._abort_staged("the receiver closed")
        if self.channel is not None:
            self.channel.close()
            self.channel = None
        release = getattr(self.engine, "release_buffers", None)
        if callable(release):
            release()
        self._path = None
        if self.transport is not None:
            self.transport.close()
            self.transport = None

    def __enter__(self) -> Receiver:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: object) -> None:
        if error is not None:  # the sender is told why this side closed, not only that it did
            self._say_leave(f"the receiver closed after {type(error).__name__}: {error}")
        self.close()


def _staging(
    engine: Engine, device: torch.device, *, staged: bool, limit: int | None, settings: Settings
) -> Staging | None:
    if limit is not None and limit < 0:
        raise ValueError(f"staging_bytes ({limit}) must be at least 0, or None for no bound")
    if not staged:
        return None
    # Half the timeout: the pause's error must reach the sender before its own wait for this bucket runs out.
    return Staging(engine, device=device, limit=limit, timeout_s=settings.timeout_s / 2)
