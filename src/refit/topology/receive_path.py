"""Receive path: the engine side's data path for one epoch (one manifest).

Takes every bucket in order, checks its header against the manifest (and its checksum when the sender
sent one), unpacks it and loads it into the engine, then acknowledges it; with two slots, bucket i is
loaded while bucket i+1 arrives. After a failure it keeps draining (so the sender never hangs) but loads
nothing. In a zero-copy epoch no bucket comes: the sender's tensors, opened once per epoch
(refit.topology.shared), are copied or READ straight into the engine.
The fingerprint check (`verify="fingerprint"`) compares what the engine now holds with the sender's digests.
"""

from __future__ import annotations

import contextlib
import time
from functools import partial

import torch

from refit.checks.bucket_checksum import checksum
from refit.checks.root import verified_root
from refit.engines.base import Engine
from refit.errors import IntegrityError, PeerError, RefitError
from refit.layout.manifest import Manifest
from refit.layout.packing import Unpacker, copy_share
from refit.log import get_logger
from refit.protocol.wire import Begin, Bucket, Channel, Header, Kind, parse_json
from refit.settings import Settings
from refit.stages import Stage
from refit.topology.digest_plan import compare
from refit.topology.membership import readable
from refit.topology.shared import Sources, opened
from refit.topology.stats import RefitStats
from refit.transports.base import Interrupted, Pending, Transport

AFTER_BEGIN = frozenset({Kind.VERIFY, Kind.COMMIT})
"""What a zero-copy refit's sender sends right after BEGIN, while the receivers still copy or READ."""
log = get_logger("receiver")


class ReceivePath:
    """Loads one epoch's buckets (or the shared source tensors) from a Transport into an Engine."""

    def __init__(
        self,
        engine: Engine,
        manifest: Manifest,
        transport: Transport,
        channel: Channel,
        *,
        settings: Settings,
        device: torch.device,
        rank: int,
        fingerprint: bool = False,
        stages: list[Stage] | None = None,
        warn_unverified: bool = True,
    ) -> None:
        """`fingerprint`: the sender will check digests (MANIFEST status 1), so loads digest what they write.
        `stages`: the engine's half of each stage the manifest lists (refit.stages), undone in reverse order.
        `warn_unverified`: log once per epoch the tensors the fingerprint cannot read back (M:N: one pair does)."""
        self.engine = engine
        self.manifest = manifest
        self.transport = transport
        self.channel = channel
        self.settings = settings
        self.rank = rank
        self.device = device
        self.unpacker = Unpacker(manifest, transport.buffers, device=device)
        self._warned_unverified = not warn_unverified
        self.fingerprint = fingerprint
        self._digested: list[tuple[torch.Tensor, torch.Tensor]] = []
        """This refit's digests taken by the engine's loads (`Engine.load_digested`): (positions in
        `manifest.names`, digests)."""
        self._positions: dict[int, tuple[list[str], torch.Tensor]] = {}
        """Per names list an engine returned (its plans return the same list every refit): their positions."""
        self._where: dict[str, int] | None = None
        self.stages = stages or []
        self.wrong: tuple[list[str], list[str], RefitError] | None = None
        """The last failed fingerprint check: (names, VERIFY's digests, its error)."""
        self._flags, self._resizing = Bucket.CHECKSUM, Bucket(0)
        for stage in self.stages:
            self._flags |= stage.flags
            self._resizing |= stage.resizing
        held = next((b for b in (stage.buffers() for stage in self.stages) if b is not None), None)
        self._held = held
        self._from_held = Unpacker(manifest, held, device=device, share=self.unpacker) if held else None
        """Unpacks a bucket a stage holds in its own buffers (delta: its image); a spanning tensor is gathered in
        `unpacker`'s staging whichever way each of its buckets came."""
        self.sources: Sources | None = None
        """A zero-copy epoch: the sender's tensors, opened once per epoch (`open_sources`)."""

    def take(self, begin: Header, stats: RefitStats, refused: RefitError | None = None) -> RefitError | None:
        """One refit's weights into the engine: the buckets, or (zero-copy) the shared tensors. `refused`: the
        refit failed before it began (the buckets are drained, nothing is loaded)."""
        self._digested = []
        if refused is not None and Begin.ZERO_COPY & begin.status:
            return refused
        with copy_share(self.transport.name):
            if Begin.ZERO_COPY & begin.status:
                return self._copy_sources(begin.version, stats)
            return self._stream(begin, stats, refused)

    def open_sources(self, payload: bytes) -> None:
        """A zero-copy epoch: open the sender's tensors once (how depends on the transport)."""
        self.sources = None  # whatever an earlier SOURCES opened is let go first
        try:
            self.sources = opened(self.transport.name, payload, self.manifest, self.engine, self.device)
        except RefitError as e:
            self.channel.send(Header(Kind.ERROR), {"message": f"receiver {self.rank}: {e}"})
            raise
        self.channel.send(Header(Kind.READY))

    def _copy_sources(self, version: int, stats: RefitStats) -> RefitError | None:
        """Zero-copy refit: every shared tensor copied or READ straight into the engine. A sender gone meanwhile
        ends the session (PeerError); anything else fails the refit."""
        if self.sources is None:
            return IntegrityError("zero-copy refit before the sender shared its tensors (no SOURCES this epoch)")
        t = time.perf_counter()
        try:
            wait = partial(self._wait, may_arrive=AFTER_BEGIN)
            self.sources.take(self._engine_load, wait, f"refit {version}, the shared tensors")
        except PeerError:
            raise
        except Exception as e:  # noqa: BLE001 - any engine error fails the refit, reported to the sender
            return _engine_error(f"engine failed to load the shared tensors: {type(e).__name__}: {e}", e)
        stats.add("load", time.perf_counter() - t)
        return None

    def _stream(self, begin: Header, stats: RefitStats, failure: RefitError | None) -> RefitError | None:
        """Take every bucket; after a failure keep draining (so the sender never hangs) but load nothing."""
        m, transport = self.manifest, self.transport
        pending: tuple[int, Pending, Header] | None = None
        for b in range(m.num_buckets):
            t = time.perf_counter()
            header, _ = self.channel.expect(Kind.BUCKET, f"refit {begin.version}, bucket {b}")
            failure = failure or _check_header(header, m, begin, b, resized=bool(self._resizing & header.status))
            nbytes = self._wire_nbytes(header, b)
            stats.wire_bytes += nbytes
            handle = transport.recv(b % len(transport.buffers), nbytes)
            stats.add("recv", time.perf_counter() - t)
            if pending is not None:
                failure = self._finish(*pending, stats, failure)
                pending = None
            if handle.ready or len(transport.buffers) == 1:
                failure = self._finish(b, handle, header, stats, failure)
            else:
                pending = (b, handle, header)
        if pending is not None:
            failure = self._finish(*pending, stats, failure)
        return failure

    def _wire_nbytes(self, header: Header, b: int) -> int:
        """The bytes bucket `b` moves: the manifest's, or (an epoch with stages) what the stages made of them,
        at most one buffer."""
        stray = header.status & ~int(self._flags)
        capacity = len(self.transport.buffers[0])
        resized = bool(self._resizing & header.status)
        if stray or (resized and not 0 < header.nbytes <= capacity):
            msg = (
                f"bucket {b} moves {header.nbytes} bytes with status bits {header.status:#x}, but this epoch's "
                f"stages ({', '.join(s.name for s in self.stages) or 'none'}) set only {int(self._flags):#x} and its "
                f"buffers hold {capacity} bytes; the sender is not speaking this protocol"
            )
            with contextlib.suppress(PeerError):  # the sender is told at once, never left waiting for an ACK
                self.channel.send(Header(Kind.ERROR), {"message": f"receiver {self.rank}: {msg}"})
            raise IntegrityError(msg)
        return header.nbytes if resized else self.manifest.bucket_nbytes[b]

    def _finish(
        self, b: int, handle: Pending, header: Header, stats: RefitStats, failure: RefitError | None
    ) -> RefitError | None:
        """Wait for bucket `b`, verify and load it, then acknowledge it (with status 1 after a failure)."""
        t = time.perf_counter()
        self._wait(handle, f"refit {header.version}, bucket {b}")
        stats.add("recv", time.perf_counter() - t)
        slot = b % len(self.transport.buffers)
        if failure is None:
            failure = self._load(b, slot, header, stats)
        self.transport.release(slot)
        self.channel.send(Header(Kind.ACK, status=int(failure is not None), slot=slot, index=b, version=header.version))
        return failure

    def _wait(self, handle: Pending, stage: str, may_arrive: frozenset[Kind] = frozenset()) -> None:
        """Wait for a transfer, broken off when the sender speaks meanwhile (it gave up) or is gone; a message
        of `may_arrive` is kept for later instead (Watch)."""
        watch = Watch(self.channel, stage, may_arrive)
        try:
            handle.wait(self.settings.timeout_s, watch)
        except Interrupted:
            raise watch.broken_off() from None
        except PeerError as e:
            raise PeerError(f"{e} (during {stage})") from None

    def _load(self, b: int, slot: int, header: Header, stats: RefitStats) -> RefitError | None:
        """Check bucket `b`'s checksum (when sent), unpack it from `slot` and load it into the engine."""
        t = time.perf_counter()
        try:
            buf = self.transport.buffers[slot]
            if Bucket.CHECKSUM & header.status:
                _verify(buf[: header.nbytes], header, b)
            stats.add("verify", time.perf_counter() - t)
            t = time.perf_counter()
            tensors = self._unpack(b, slot, buf, header)
            if tensors:
                self._engine_load(tensors)
            stats.add("load", time.perf_counter() - t)
        except RefitError as e:
            return e
        except Exception as e:  # noqa: BLE001 - the engine's own error, reported to the sender by message
            return _engine_error(f"engine failed to load bucket {b}: {type(e).__name__}: {e}", e)
        return None

    def _unpack(self, b: int, slot: int, buf: torch.Tensor, header: Header) -> list[tuple[str, torch.Tensor]]:
        """Bucket `b`'s tensors, once every stage undid its step (in reverse order): views of its slot, or of
        the buffer a stage holds it in (delta: its image)."""
        held = buf
        for stage in reversed(self.stages):
            got = stage.incoming(b, held, header.nbytes, Bucket(header.status))
            if got is not None:
                if self._held is None or got is not self._held[b]:
                    raise IntegrityError(
                        f"stage {stage.name} returned bucket {b} in memory it did not list in buffers()"
                    )
                held = got
        if held is buf:
            return self.unpacker.unpack(b, slot)
        assert self._from_held is not None  # set whenever _held is
        return self._from_held.unpack(b, b)

    def _engine_load(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Load into the engine; in fingerprint mode keep the digests its copy took of what it wrote."""
        if not self.fingerprint:
            self.engine.load(tensors)
            return
        got = self.engine.load_digested(tensors)
        if got is None or not got[0]:
            return
        names, values = got
        hit = self._positions.get(id(names))
        if hit is None or hit[0] is not names:
            if self._where is None:
                self._where = {n: i for i, n in enumerate(self.manifest.names)}
            where = torch.tensor([self._where[n] for n in names], dtype=torch.int64)
            hit = self._positions[id(names)] = (names, where)
        self._digested.append((hit[1], values))

    def unverified(self, version: int) -> RefitError | None:
        """COMMIT came without VERIFY: refused where this epoch's manifest has the fingerprint check on."""
        if not self.fingerprint:
            return None
        return IntegrityError(
            f"refused to commit version {version}: this epoch's manifest has the fingerprint check on, but the "
            "sender sent COMMIT without the digests (VERIFY) of what it sent; nothing unverified is committed"
        )

    def check_fingerprints(self, payload: bytes, stats: RefitStats, done: dict) -> RefitError | None:
        """Fingerprint mode: compare what the engine now holds with the digests of the trainer's live tensors."""
        m = self.manifest
        t = time.perf_counter()
        try:
            self.transport.flush()
            digests = parse_json(payload, "VERIFY").get("digests")
            bad, unreadable = compare(m, self.engine, digests, loaded=self._digested)
        except RefitError as e:
            return e
        except Exception as e:  # noqa: BLE001 - any read-back error fails the check, reported to the sender
            return _engine_error(f"engine could not be read back for the fingerprint check: {type(e).__name__}: {e}", e)
        finally:
            stats.add("verify", time.perf_counter() - t)
        stats.unverified = done["unverified"] = len(unreadable)
        stats.unverified_names = done["unverified_names"] = sorted(unreadable)
        if unreadable and not self._warned_unverified:  # once per epoch: every refit of it has the same names
            self._warned_unverified = True
            log.warning(
                "fingerprint check: the engine loads %d tensor(s) it cannot read back as sent, so they are not "
                "verified (verify='strict' fails such refits): %s",
                len(unreadable),
                ", ".join(sorted(unreadable)[:20])
                + (f", ... and {len(unreadable) - 20} more" if len(unreadable) > 20 else ""),
            )
        if not bad:
            stats.root = verified_root(m.names, digests, unreadable, self.engine.optional_names)
        if bad:
            shown = ", ".join(bad[:20]) + (f", ... and {len(bad) - 20} more" if len(bad) > 20 else "")
            err = IntegrityError(
                f"fingerprint check failed: the engine does not hold what the trainer holds for "
                f"{len(bad)} tensor(s): {shown}"
            )
            self.wrong = (bad, digests, err)  # what refit.topology.repair may fetch again
            return err
        return None


def _engine_error(message: str, cause: BaseException) -> RefitError:
    """The engine's error as the RefitError the sender is told, keeping the original as its cause."""
    err = RefitError(message)
    err.__cause__ = cause
    return err


def _check_header(h: Header, m: Manifest, begin: Header, b: int, *, resized: bool) -> IntegrityError | None:
    """`resized`: the epoch's stages may change the bytes a bucket moves (checked against the buffer already)."""
    if h.epoch != m.epoch or h.digest != m.digest:
        return IntegrityError(f"bucket {b} header is for another manifest (epoch {h.epoch}, expected {m.epoch})")
    moved = h.nbytes if resized else m.bucket_nbytes[b]
    if h.version != begin.version or h.index != b or h.nbytes != moved:
        return IntegrityError(
            f"bucket {b} header disagrees with the manifest (version {h.version}, index {h.index}, "
            f"nbytes {h.nbytes}; expected {begin.version}, {b}, {m.bucket_nbytes[b]})"
        )
    return None


def _verify(buf: torch.Tensor, header: Header, b: int) -> None:
    got = checksum(buf)
    if got != header.checksum:
        raise IntegrityError(
            f"bucket {b} is corrupted: checksum {got:#018x}, sender computed {header.checksum:#018x}; "
            "the bytes changed in transit or the buffer was overwritten"
        )


class Watch:
    """While a bucket is in flight the sender says nothing on the control channel until its ACK, unless it
    gave up on the refit (REGROUP, ERROR, CLOSE). Called between waits: whether it spoke (heartbeats aside).
    `may_arrive`: kinds the protocol lets the sender send meanwhile (a zero-copy refit's VERIFY and COMMIT
    follow BEGIN at once); each is kept once, in order, for the next `recv` (`Channel.ahead`), and reading goes
    on past them, so that a sender that dies after sending them is seen at once (its connection's end)."""

    def __init__(self, channel: Channel, stage: str, may_arrive: frozenset[Kind] = frozenset()) -> None:
        self.channel, self.stage, self.may_arrive = channel, stage, may_arrive
        self.error: RefitError | None = None
        """What reading its message raised: its ERROR (PeerFailed), or the connection's end."""

    def __call__(self) -> bool:
        ch = self.channel
        while readable(ch):
            try:
                header, payload = ch.recv(self.stage, heartbeats=True, wire=True)
            except RefitError as e:
                self.error = e
                return True
            kept = [m[0].kind for m in ([ch.ahead] if ch.ahead else []) + ch.later]
            if header.kind in self.may_arrive and header.kind not in kept:  # each once: what is kept stays bounded
                if ch.ahead is None:
                    ch.ahead = (header, payload)
                else:
                    ch.later.append((header, payload))
            elif header.kind != Kind.HEARTBEAT:
                ch.stray = (header, payload)  # for the caller that handles it (a REGROUP, a CLOSE)
                return True
        return False

    def broken_off(self) -> RefitError:
        """The error to stop the refit with, once the sender spoke while the bucket was in flight."""
        if self.error is not None:
            return self.error
        assert self.channel.stray is not None
        kind = self.channel.stray[0].kind.name
        return PeerError(f"{self.channel.peer} sent {kind} during {self.stage}, while its bytes were in flight")
