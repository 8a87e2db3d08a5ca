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
from refit.topology.send_path import SendPath, share_sources
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

    def __init__(self, channels: list[Channel], interval_s: float) -> None:
        self.channels = channels
        self.lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(interval_s,), name="refit-heartbeat", daemon=True)
        self._thread.start()

    def _run(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            if not self.lock.acquire(blocking=False):
                continue
            try:
                for ch in self.channels:
                    if ch.unsent_bytes() < UNREAD_LIMIT:
                        ch.send(Header(Kind.HEARTBEAT))
            except PeerError:
                pass  # the next refit reports the dead peer with its stage
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
    ) -> None:
        """`verify="fingerprint"` (the default; `verify=None` turns it off): after the last bucket, each
        receiver compares a digest of what its engine now holds with a digest of the trainer's live
        tensors (after the wire cast), and the refit fails, naming the tensors that differ, unless all
        agree; tensors an engine cannot read back are reported (`RefitStats.unverified_names`) but
        accepted. `verify="strict"` verifies the same way and fails the refit (committed on no receiver)
        when any tensor went unverified.
        `zero_copy` (cuda-ipc only): receivers copy straight from the source tensors, whose IPC handles
        are exported once per epoch; the source must hold contiguous device tensors in their wire dtype."""
        if num_receivers < 1:
            raise ValueError(f"num_receivers ({num_receivers}) must be >= 1")
        if num_slots < 1:
            raise ValueError(f"num_slots ({num_slots}) must be >= 1 (2 overlaps packing with transfer)")
        if verify not in VERIFY_MODES:
            raise ValueError(f"verify must be one of {VERIFY_MODES}, got {verify!r}")
        if zero_copy and (transport != "cuda-ipc" or not source.stable_tensors):
            raise ValueError(
                f"zero_copy needs the cuda-ipc transport ({transport!r} given) and a source whose "
                "tensors persist between refits (not a gathering one)"
            )
        self.num_slots = num_slots
        self.zero_copy = zero_copy
        self.verify = verify
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
        self._regions: list[dict[str, list[int]]] = []
        self._digests: DigestPlan | None = None
        self._signature: Hashable = None
        self._path: SendPath | None = None
        self._epoch = 0
        self._generation = 0
        self._begun = False
        self.statements: list[bytes] = []
        """What each receiver sent with READY: M:N shard statements (JSON; refit.topology.mesh), else empty."""
        self.verdict: Callable[[str], str] | None = None
        """Set by a per-rank driver (refit.topology.ranked): given this Sender's failure ('' when its receivers
        committed), returns the failure across every trainer rank ('' when every worker committed).
        When set, receivers hold their commit open until they are told this verdict."""

    @property
    def channels(self) -> list[Channel]:
        return self._session.channels

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
            }
            data = json.dumps(welcome).encode()
            ch.send(Header(Kind.WELCOME, digest=auth.tag(ch.key, b"WELCOME", data)), data)
        transport.establish()
        self.statements = [ch.expect(Kind.READY, "transport setup")[1] for ch in self.channels]
        transport.joined()
        self._session.lobby.refuse_late(self.num_receivers)
        self._session.pulse = _Pulse(self._session.channels, interval)
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
            ch.key = a.key
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
        payload = manifest.to_json()
        for ch in self.channels:  # each receiver's copy is bound to its session: digest is a MAC under its key
            binding = auth.tag(ch.key, b"MANIFEST", manifest_binding(manifest.epoch, manifest.digest))
            ch.send(Header(Kind.MANIFEST, epoch=manifest.epoch, digest=binding, status=int(bool(self.verify))), payload)
        failures, regions = [], []
        for rank, ch in enumerate(self.channels, start=1):
            obj = parse_json(ch.expect(Kind.REPORT, "handshake")[1], "REPORT")
            report = Report.from_json(obj)
            regions.append(parse_regions(obj.get("regions"), manifest) if self.verify else {})
            if not report.ok:
                failures.append(f"receiver {rank}: {report.message()}")
        if failures:
            self.manifest, self._signature = None, None
            raise HandshakeError(" | ".join(failures))
        if self.zero_copy:
            share_sources(self.source, manifest, self.channels)
        self.manifest, self._regions = manifest, regions
        self._digests = DigestPlan(manifest, regions) if self.verify else None
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
        t0 = time.perf_counter()
        signature = self.source.signature()
        moved = signature != self._signature
        handshake = self.manifest is None or (moved and self._changed())
        if handshake:
            self._handshake()
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
        for ch in self.channels:
            ch.send(begin)
        self._begun = True
        assert self._path is not None
        errors = self._path.send(self.source, version, stats, self._generation, verify_checksum=self.verify_checksum)
        self._commit(m, version, stats, errors)
        stats.control_bytes = self._control_bytes() - ctrl0
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
        for ch in self.channels:
            ch.send(Header(Kind.COMMIT, epoch=m.epoch, version=version, digest=m.digest))
        failures, committed, names = [], [], set()
        for ch in self.channels:  # every DONE is read, whatever it says, so the next refit starts in step
            header, payload = ch.expect(Kind.DONE, f"commit of version {version}")
            try:
                done = parse_json(payload, "DONE") if payload else {}
            except IntegrityError as e:
                failures.append(f"{ch.peer}: {e}")
                continue
            if header.status:
                failures.append(f"{ch.peer}: {done.get('message', 'unknown error')}")
            else:
                committed.append(ch)
            unverified = done.get("unverified")
            if isinstance(unverified, int) and not isinstance(unverified, bool):
                stats.unverified = max(stats.unverified, unverified)
            listed = done.get("unverified_names")
            if isinstance(listed, list):
                names.update(str(n) for n in listed[:100_000])
        stats.add("commit", time.perf_counter() - t)
        _set_unverified_names(stats, sorted(names))
        if self.verify == "strict" and names and not failures and not errors:
            failures.append(_strict_failure(sorted(names)))
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

    def _two_phase(self) -> bool:
        """Receivers hold their commit open until told the verdict: per-rank refits, and strict
        verification (whose verdict needs every receiver's list of unverified tensors)."""
        return self.verdict is not None or self.verify == "strict"

    def _decide(self, m: Manifest, version: int, own: str, committed: list[Channel]) -> str:
        """Agree with the other trainer ranks (per-rank refit), then tell the receivers that committed."""
        verdict = self.verdict(own) if self.verdict is not None else own
        for ch in committed:
            ch.send(
                Header(Kind.COMMIT, epoch=m.epoch, version=version, digest=m.digest, status=int(bool(verdict))),
                {"message": verdict},
            )
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
