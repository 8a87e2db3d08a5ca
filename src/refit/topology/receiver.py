"""Receiver: the engine side's session (connect and join, handshake per epoch, commit and the per-rank
verdict, close). Each refit's buckets go through the epoch's data path, `refit.topology.receive_path`."""

from __future__ import annotations

import contextlib
import dataclasses
import socket
import threading
from collections.abc import Callable

import torch

from refit import stages
from refit.engines.base import Engine
from refit.engines.staging import Split, Staging
from refit.errors import PeerError
from refit.layout import tensor_guard
from refit.layout.manifest import Manifest
from refit.layout.spec import TensorSpec
from refit.log import get_logger
from refit.protocol.wire import (
    MAX_REASON_CHARS,
    Channel,
    Header,
    Kind,
    Offer,
)
from refit.settings import Settings, check_bucket_bytes
from refit.topology.joining import Joiner
from refit.topology.landing import landing
from refit.topology.receive_handshake import answer, prepare_stages, read_manifest
from refit.topology.receive_path import ReceivePath
from refit.topology.receive_round import ReceiveRound
from refit.topology.stats import RefitStats
from refit.transports.base import Transport

log = get_logger("receiver")


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
        site: str | None = None,
    ) -> None:
        """`rendezvous` is what `Sender.rendezvous()` returned (host, port, token, transport).

        `staged`: refits land in staging memory while the engine keeps generating with its current version;
        `apply_staged()` moves a verified, committed version into the live engine (refit.engines.staging).
        `staging_bytes` bounds that memory: the tensors first in bucket order that fit are staged; the rest is
        received during the pause, straight into the live engine (`staging_split` says what the pause covers).
        `on_commit(version)` is called each time the live engine commits a version (staged: in `apply_staged`).
        `site`: where this replica sits, the replicas behind one link (transport 'relay': a bucket once per site)."""
        self.engine = engine
        self.settings = settings or Settings()
        self.settings = self.settings if site is None else dataclasses.replace(self.settings, site=site)
        check_bucket_bytes(self.settings.bucket_bytes)  # Settings is mutable: checked again before any socket
        self.rendezvous = rendezvous
        self.joiner = Joiner(rendezvous, self.settings, device)
        """How this side joins the sender's transport (and, elastic gloo/nccl, each group it forms anew)."""
        self.channel: Channel | None = None
        self.transport: Transport | None = None
        self.manifest: Manifest | None = None
        self.path: ReceivePath | None = None
        self.layout: list[TensorSpec] | None = None
        """The engine's specs this epoch's manifest was validated against (`_relayout` checks them per refit)."""
        self._broken = ""
        self._ended = False
        """The sender ended the session (CLOSE), or this side already said LEAVE: nothing more to tell it."""
        self.warn_unverified = True
        """Log the tensors the fingerprint cannot read back (once per epoch); M:N logs it for one pair only."""
        self.statement: dict | None = None
        """M:N: what this worker keeps (refit.topology.mesh), sent with READY for the trainer's plan."""
        self.landing = landing(engine, self.device, staged=staged, limit=staging_bytes, settings=self.settings)
        """Where refits land: the live engine, or staging memory in front of it (`engine` is what they drive)."""
        self.landing.on_commit = on_commit
        self.engine = self.landing.engine

    @property
    def device(self) -> torch.device:
        return self.joiner.device

    @property
    def rank(self) -> int:
        return self.joiner.rank

    @property
    def regroups(self) -> bool:
        return self.joiner.regroups

    @property
    def staging(self) -> Staging | None:
        """The staged refit's side (None: refits load the live engine directly); the protocol drives it."""
        return self.landing.staging

    @property
    def staging_split(self) -> Split | None:
        """Staged: how this epoch's tensors divide between staging memory and the pause."""
        return self.landing.split

    def connect(self) -> None:
        """Connect to the sender, present the token and join the transport. On failure the sender is
        told why and the socket is closed."""
        if self.channel is not None:
            return
        tensor_guard.prepare()  # the layout check's one-time build, before the trainer waits on us
        ready = self._statement()  # a format the engine misstates fails here, before the trainer waits on us
        host, port = self.rendezvous.get("host"), self.rendezvous.get("port")
        try:
            sock = socket.create_connection((host, port), timeout=self.settings.timeout_s)
        except OSError as e:
            raise PeerError(f"cannot connect to the sender at {host}:{port}: {e}; is it running?") from None
        ch = Channel(sock, peer=f"sender ({host}:{port})", timeout_s=self.settings.timeout_s)
        try:
            self.transport = self.joiner.first(ch, str(self.rendezvous.get("token") or ""))
        except BaseException as e:
            if not isinstance(e, PeerError) or "failed:" not in str(e):  # the sender already knows when it refused us
                with contextlib.suppress(PeerError):
                    ch.send(Header(Kind.ERROR), {"message": f"receiver could not join: {e}"})
            ch.close()
            raise
        self.channel = ch
        ch.send(Header(Kind.READY), ready)
        log.info("joined as receiver %d over %s", self.rank, self.joiner.cls.name)

    def _statement(self) -> dict | None:
        """What READY tells the trainer: M:N shards, then what the engine and each handler state (refit.stages)."""
        stated = stages.engine_statement(self.engine)
        return {**(self.statement or {}), **stated} if stated else self.statement

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
            self.landing.abort(str(e))
            raise
        except BaseException as e:
            self.landing.abort(f"the receive side stopped: {type(e).__name__}: {e}")
            raise
        if stats is None:
            self._ended = True
        else:
            self.landing.committed(stats.version)  # every worker's verdict is in
        return stats

    def apply_staged(self) -> bool:
        """Between generation steps: load the staged version (if one is ready) into the live engine and commit
        it there; returns whether one was. Without one, or unstaged, a no-op costing well under a microsecond.
        Partial staging (`staging_bytes`): when a refit needs the pause, stays until that refit ends, and raises
        RefitError if it failed (after writing into the live engine, which then reads `failed`, or before, with
        the live weights untouched). Raises RefitError, applying nothing, when the live engine's tensors changed
        since the version was staged (it stays staged)."""
        return self.landing.apply()

    def _receive(self) -> RefitStats | None:
        self.connect()
        assert self.channel is not None
        while True:
            header, payload = self.channel.recv(
                "waiting for the next refit (no heartbeat from the sender: "
                "is its process alive and its host reachable?)",
                idle=True,
                timeout_s=self.joiner.idle_timeout_s,
            )
            if header.kind == Kind.MANIFEST:
                self._handshake(header, payload)
            elif header.kind == Kind.SOURCES:
                if self.path is None:
                    raise PeerError("sender sent SOURCES before a manifest this receiver accepted")
                self.path.open_sources(payload)
            elif header.kind == Kind.BEGIN:
                return ReceiveRound(self, header).run()
            elif header.kind == Kind.REGROUP:
                self._regroup(header, payload)
            elif header.kind == Kind.CLOSE:
                return None
            else:
                raise PeerError(f"sender sent {header.kind.name} between refits")

    def after_broken_group(self, version: int, error: PeerError) -> RefitStats | None:
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
            self.joiner.cls.name,
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
            threading.Thread(target=old.abort, name="refit-old-group", daemon=True).start()
        self.engine.release_buffers()
        self.manifest, self.path = None, None
        self.transport = self.joiner.group(self.channel, header, payload)
        self.channel.send(Header(Kind.READY), self._statement())
        log.info("joined the sender's new group")

    def serve(self) -> int:
        """Receive refits until the sender closes; returns how many were committed."""
        n = 0
        while self.receive() is not None:
            n += 1
        return n

    def _handshake(self, header: Header, payload: bytes) -> None:
        assert self.channel is not None and self.transport is not None
        self.manifest, self.path = None, None
        capacity = len(self.transport.buffers[0])
        manifest = read_manifest(self.channel, header, payload, capacity=capacity, rank=self.rank, engine=self.engine)
        fingerprint = bool(Offer.FINGERPRINT & header.status)
        made = prepare_stages(self.channel, manifest, self.device, rank=self.rank)  # before REPORT says yes
        layout = answer(self.channel, manifest, self.engine, self.landing, fingerprint=fingerprint)
        log.info(
            "handshake: epoch %d, %d tensors, %d bucket(s)", manifest.epoch, len(manifest.entries), manifest.num_buckets
        )
        self.path = ReceivePath(
            self.engine,
            manifest,
            self.transport,
            self.channel,
            settings=self.settings,
            device=self.device,
            rank=self.rank,
            fingerprint=fingerprint,
            stages=made,
            warn_unverified=self.warn_unverified,
        )
        self.manifest, self.layout = manifest, layout

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
        self.landing.abort("the receiver closed")
        if self.channel is not None:
            self.channel.close()
            self.channel = None
        self.engine.release_buffers()
        self.path = None
        if self.transport is not None:
            self.transport.close()
            self.transport = None

    def __enter__(self) -> Receiver:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: object) -> None:
        if error is not None:  # the sender is told why this side closed, not only that it did
            self._say_leave(f"the receiver closed after {type(error).__name__}: {error}")
        self.close()
