"""Sender: the trainer side of the protocol (rendezvous, handshake per epoch, pipelined refits)."""

from __future__ import annotations

import atexit
import hmac
import socket
import threading
import time
import warnings
from collections.abc import Hashable

import torch

from refit import transports
from refit.budget import NUM_SLOTS, bucket_capacity, free_bytes
from refit.errors import HandshakeError, PeerError, RefitError
from refit.integrity import checksum
from refit.manifest import Manifest
from refit.packing import Packer
from refit.planner import forecast, plan
from refit.settings import Settings
from refit.source import Source
from refit.stats import RefitStats
from refit.transports.base import Pending, Transport
from refit.validation import Report
from refit.wire import Channel, Header, Kind, parse_json


class Sender:
    """Pushes a Source's weights to `num_receivers` Receivers over one transport, set up once.

    Call `rendezvous()` for what receivers need to connect, `connect()` (or let the first `refit` do
    it), then `refit(version)` after every optimizer step.
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
        num_slots: int = NUM_SLOTS,
        zero_copy: bool = False,
        port: int = 0,
    ) -> None:
        """`zero_copy` (cuda-ipc only): receivers copy straight from the source tensors, whose IPC handles
        are exported once per epoch; the source must hold contiguous device tensors in their wire dtype."""
        if num_receivers < 1:
            raise ValueError(f"num_receivers ({num_receivers}) must be >= 1")
        if num_slots < 1:
            raise ValueError(f"num_slots ({num_slots}) must be >= 1 (2 overlaps packing with transfer)")
        self.num_slots = num_slots
        if zero_copy and (transport != "cuda-ipc" or not source.stable_tensors):
            raise ValueError(f"zero_copy needs the cuda-ipc transport ({transport!r} given) and a source whose "
                             "tensors persist between refits (not a gathering one)")  # fmt: skip
        self.zero_copy = zero_copy
        self._broken = ""
        self._refuser: threading.Thread | None = None
        self._stopping = threading.Event()
        self.source = source
        self.transport_name = transport
        self._transport_cls = transports.get(transport)
        self.num_receivers = num_receivers
        self.settings = settings or Settings()
        self.device = device or transports.default_device(transport)
        self.verify_checksum = verify_checksum
        self._listener = socket.create_server((self.settings.host, port), backlog=num_receivers + 8)
        self._listener.settimeout(self.settings.timeout_s)
        self.channels: list[Channel] = []
        self.transport: Transport | None = None
        self.capacity = 0
        self.manifest: Manifest | None = None
        self._signature: Hashable = None
        self._packer: Packer | None = None
        self._bucket_names: list[list[str]] = []
        self._epoch = 0

    def rendezvous(self) -> dict:
        """JSON-able info a Receiver needs: address, token and transport."""
        host, port = self._listener.getsockname()[:2]
        return {"host": host, "port": port, "token": self.settings.token, "transport": self.transport_name}

    # -- session setup ---------------------------------------------------------------------------

    def connect(self) -> None:
        """Accept every receiver, agree on the bucket capacity, and set up the transport."""
        if self.transport is not None:
            return
        self._fall_back_if_needed()
        limits = [self._accept(rank) for rank in range(1, self.num_receivers + 1)]
        own = bucket_capacity(bucket_bytes=self.settings.bucket_bytes, ratio=self.settings.ratio,
                              free=free_bytes(self.device), num_slots=self.num_slots)  # fmt: skip
        self.capacity = min([own, *limits])
        self.transport, info = self._transport_cls.offer(
            capacity=self.capacity, num_slots=self.num_slots, num_receivers=self.num_receivers,
            device=self.device, settings=self.settings,
        )  # fmt: skip
        for rank, ch in enumerate(self.channels, start=1):
            ch.send(Header(Kind.WELCOME), {"rank": rank, "capacity": self.capacity, "transport": self.transport_name,
                                           "info": info})  # fmt: skip
        self.transport.establish()
        for ch in self.channels:
            ch.expect(Kind.READY, "transport setup")
        self.transport.joined()
        self._refuser = threading.Thread(target=self._refuse_late, name="refit-refuse-late", daemon=True)
        self._refuser.start()
        # A daemon thread still inside a socket call when the interpreter finalises can abort the
        # process ("terminate called without an active exception"): stop it at exit if close() was not called.
        atexit.register(self._stop_refuser)

    def _refuse_late(self) -> None:
        """After setup, answer any further connection at once (wrong token or session full), never leave it hanging."""
        self._listener.settimeout(0.5)
        while not self._stopping.is_set():
            try:
                sock, addr = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            if self._stopping.is_set():
                sock.close()
                return
            ch = Channel(sock, peer=f"late peer ({addr[0]}:{addr[1]})", timeout_s=5.0)
            try:
                hello = parse_json(ch.expect(Kind.HELLO, "rendezvous")[1], "HELLO")
                ok = hmac.compare_digest(str(hello.get("token", "")).encode(), self.settings.token.encode())
                msg = (f"this sender already has its {self.num_receivers} receiver(s); start another Sender"
                       if ok else "wrong token: this sender expects another REFIT_TOKEN; pass the token from "
                       "Sender.rendezvous()")  # fmt: skip
                ch.send(Header(Kind.ERROR), {"message": msg})
            except RefitError:
                pass
            finally:
                ch.close()

    def _fall_back_if_needed(self) -> None:
        """cuda-ipc where CUDA IPC cannot work: stage through pinned host shared memory, and say why."""
        if self.transport_name != "cuda-ipc" or self.zero_copy:
            return
        from refit.transports.cuda_ipc import blocker

        reason = blocker(self.device, self.settings)
        if reason:
            warnings.warn(f"cuda-ipc cannot be used ({reason}); staging through pinned host shared memory "
                          "(transport 'shm') instead, which is slower", RuntimeWarning, stacklevel=3)  # fmt: skip
            self.transport_name, self._transport_cls, self.device = "shm", transports.get("shm"), torch.device("cpu")

    def _accept(self, rank: int) -> int:
        """Accept one receiver with the right token; return its capacity limit. Wrong tokens are refused."""
        deadline = time.monotonic() + self.settings.timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise PeerError(
                    f"receiver {rank} of {self.num_receivers} did not connect within {self.settings.timeout_s:g}s; "
                    f"check it was given {self.rendezvous()['host']}:{self.rendezvous()['port']} and the token"
                )
            self._listener.settimeout(remaining)
            try:
                sock, addr = self._listener.accept()
            except TimeoutError:
                continue
            # A peer that connects but says nothing must not hold up the real receivers for long.
            ch = Channel(sock, peer=f"receiver {rank} ({addr[0]}:{addr[1]})", timeout_s=min(self.settings.timeout_s, 10.0))
            try:
                hello = parse_json(ch.expect(Kind.HELLO, "rendezvous")[1], "HELLO")
            except RefitError:
                ch.close()
                continue
            ch.set_timeout(self.settings.timeout_s)
            if not hmac.compare_digest(str(hello.get("token", "")).encode(), self.settings.token.encode()):
                ch.send(Header(Kind.ERROR), {"message": "wrong token: this sender expects another REFIT_TOKEN; "
                                                        "pass the token from Sender.rendezvous()"})  # fmt: skip
                ch.close()
                continue
            limit = hello.get("capacity")
            if not isinstance(limit, int) or limit <= 0:
                raise PeerError(f"receiver {rank} sent an invalid capacity limit {limit!r}")
            self.channels.append(ch)
            return limit

    # -- handshake -------------------------------------------------------------------------------

    def _handshake(self) -> None:
        self._epoch += 1
        manifest = plan(self.source.specs(), capacity=self.capacity, epoch=self._epoch)
        payload = manifest.to_json()
        for ch in self.channels:
            ch.send(Header(Kind.MANIFEST, epoch=manifest.epoch, digest=manifest.digest), payload)
        failures = []
        for rank, ch in enumerate(self.channels, start=1):
            report = Report.from_json(parse_json(ch.expect(Kind.REPORT, "handshake")[1], "REPORT"))
            if not report.ok:
                failures.append(f"receiver {rank}: {report.message()}")
        if failures:
            self.manifest, self._signature = None, None
            raise HandshakeError(" | ".join(failures))
        if self.zero_copy:
            self._share_sources(manifest)
        self.manifest = manifest
        assert self.transport is not None
        self._packer = Packer(manifest, self.transport.buffers)
        self._bucket_names = [[manifest.entries[s.entry].name for s in segs] for segs in manifest.segments]

    def _share_sources(self, manifest: Manifest) -> None:
        """Export every source tensor's IPC handle once per epoch (zero-copy mode)."""
        from refit.transports.cuda_ipc import export

        tensors = self.source.tensors([p.name for p in manifest.entries])
        bad = [p.name for p, t in zip(manifest.entries, tensors)
               if not (t.is_cuda and t.is_contiguous() and t.dtype == p.spec.dtype)]  # fmt: skip
        if bad:
            raise ValueError(f"zero_copy needs contiguous CUDA tensors already in their wire dtype; not so: {bad[:5]}. "
                             "Use zero_copy=False (packing casts on the way).")  # fmt: skip
        payload = {"tensors": [export(t) for t in tensors]}
        for ch in self.channels:
            ch.send(Header(Kind.SOURCES, epoch=manifest.epoch, digest=manifest.digest), payload)
        for ch in self.channels:
            ch.expect(Kind.READY, "opening the source tensors' IPC handles")

    def _changed(self) -> bool:
        """The cheap signature moved: does that need a new epoch? Yes if any spec changed, and in
        zero-copy mode also when only storage moved (the exported handles point at the old memory)."""
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
            raise PeerError(f"this session broke earlier ({self._broken}); close() it and start a new Sender")
        try:
            return self._refit(version)
        except PeerError as e:
            self._broken = str(e)
            raise

    def _refit(self, version: int) -> RefitStats:
        t_connect = time.perf_counter()
        self.connect()
        t0 = time.perf_counter()
        signature = self.source.signature()
        handshake = self.manifest is None or (signature != self._signature and self._changed())
        if handshake:
            self._handshake()
        self._signature = signature
        m = self.manifest
        assert m is not None
        stats = RefitStats(version=version, epoch=m.epoch, handshake=handshake, num_buckets=m.num_buckets,
                           nbytes=m.nbytes)  # fmt: skip
        stats.add("connect", t0 - t_connect)
        stats.add("handshake", time.perf_counter() - t0)
        ctrl0 = self._control_bytes()
        begin = Header(Kind.BEGIN, epoch=m.epoch, version=version, digest=m.digest, index=m.num_buckets,
                       status=int(self.zero_copy))  # fmt: skip
        if self.zero_copy:  # the optimizer's writes must be done before receivers read the tensors
            torch.cuda.current_stream(self.device).synchronize()
        for ch in self.channels:
            ch.send(begin)
        errors = [] if self.zero_copy else self._stream(m, version, stats)
        self._commit(m, version, stats, errors)
        stats.control_bytes = self._control_bytes() - ctrl0
        stats.seconds["total"] = time.perf_counter() - t0
        return stats

    def _stream(self, m: Manifest, version: int, stats: RefitStats) -> list[str]:
        """Pack and send every bucket, `num_slots` in flight; returns receivers' per-bucket errors."""
        assert self.transport is not None and self._packer is not None
        slots = self.num_slots
        inflight: list[Pending | None] = [None] * slots
        errors: list[str] = []
        for b in range(m.num_buckets):
            slot = b % slots
            if b >= slots:
                self._retire(b - slots, inflight[slot], version, stats, errors)
            t = time.perf_counter()
            self._packer.pack(b, slot, self.source.tensors(self._bucket_names[b]), cache=self.source.stable_tensors)
            nbytes = m.bucket_nbytes[b]
            crc = checksum(self.transport.buffers[slot][:nbytes]) if self.verify_checksum else 0
            self.transport.before_send(slot)
            stats.add("pack", time.perf_counter() - t)
            t = time.perf_counter()
            header = Header(Kind.BUCKET, slot=slot, epoch=m.epoch, index=b, version=version, digest=m.digest,
                            nbytes=nbytes, checksum=crc, status=int(self.verify_checksum))  # fmt: skip
            for ch in self.channels:
                ch.send(header)
            inflight[slot] = self.transport.send(slot, nbytes)
            stats.add("send", time.perf_counter() - t)
        for b in range(max(0, m.num_buckets - slots), m.num_buckets):
            self._retire(b, inflight[b % slots], version, stats, errors)
        return errors

    def _retire(self, b: int, pending: Pending | None, version: int, stats: RefitStats, errors: list[str]) -> None:
        """Wait until bucket `b` is off the wire and every receiver has consumed it."""
        t = time.perf_counter()
        stage = f"refit {version}, bucket {b}"
        if pending is not None:
            pending.wait(self.settings.timeout_s)
        for ch in self.channels:
            header, _ = ch.expect(Kind.ACK, stage)
            if header.index != b:
                raise PeerError(f"{ch.peer} acknowledged bucket {header.index} during {stage}")
            if header.status:
                errors.append(f"{ch.peer} failed at bucket {b}")
        stats.add("wait", time.perf_counter() - t)

    def _commit(self, m: Manifest, version: int, stats: RefitStats, errors: list[str]) -> None:
        t = time.perf_counter()
        for ch in self.channels:
            ch.send(Header(Kind.COMMIT, epoch=m.epoch, version=version, digest=m.digest))
        failures = []
        for ch in self.channels:
            header, payload = ch.expect(Kind.DONE, f"commit of version {version}")
            if header.status:
                failures.append(f"{ch.peer}: {parse_json(payload, 'DONE').get('message', 'unknown error')}")
        stats.add("commit", time.perf_counter() - t)
        if failures or errors:
            raise RefitError(f"refit of version {version} failed; receivers keep their last committed weights "
                             f"and report state 'failed': {'; '.join(failures or errors)}")  # fmt: skip

    def _control_bytes(self) -> int:
        return sum(ch.bytes_sent + ch.bytes_received for ch in self.channels)

    def predicted_memory(self) -> dict[str, int]:
        """Predicted peak extra bytes per side for the current manifest."""
        if self.manifest is None:
            raise ValueError("no manifest yet: call refit() (or connect and handshake) first")
        f = forecast(self.manifest, num_slots=self.num_slots)
        return {"sender": f.sender_bytes, "receiver": f.receiver_bytes}

    def _stop_refuser(self) -> None:
        self._stopping.set()
        if self._refuser is not None:
            self._refuser.join()
            self._refuser = None
        atexit.unregister(self._stop_refuser)

    def close(self) -> None:
        """End the session: tell receivers, release the transport and sockets."""
        self._stop_refuser()
        for ch in self.channels:
            try:
                ch.send(Header(Kind.CLOSE))
            except PeerError:
                pass
            ch.close()
        self.channels = []
        if self.transport is not None:
            self.transport.close()
            self.transport = None
        self._listener.close()

    def __enter__(self) -> Sender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
