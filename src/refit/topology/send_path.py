"""Send path: the trainer side's data path for one epoch (one manifest).

Buckets go out in order, `num_slots` in flight: bucket i+1 is packed while bucket i is on the wire, and a
slot is reused only once every receiver acknowledged the bucket it held (retired). Packing replays the
cached copy plan of a bucket when the session's generation vouches for its tensors' layout. Verification
(`DigestPlan`, owned by the session) is a step this path calls: it digests each tensor as it is packed, and
sends the digests after the last bucket. The zero-copy path (refit.topology.zero_copy) is the other data path
an epoch may take: it shares the source tensors once and moves no bucket.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from refit.checks.bucket_checksum import checksum
from refit.checks.copy_digest import FusedCopy
from refit.checks.root import roots
from refit.errors import IntegrityError, PeerError
from refit.layout.manifest import Manifest
from refit.layout.packing import Packer, copy_share
from refit.log import get_logger
from refit.protocol.wire import Begin, Bucket, Channel, Header, Kind
from refit.settings import Settings
from refit.sources.base import Source
from refit.stages import Stage
from refit.topology.digest_plan import DigestPlan
from refit.topology.stats import RefitStats
from refit.transports.base import Pending, Transport

log = get_logger("sender")
Lost = Callable[[Channel, Exception], None]
"""What an elastic session does with a receiver lost mid-refit (drops it); None: the loss fails the refit."""


def each(channels: list[Channel], step: Callable[[Channel], None], on_lost: Lost | None) -> None:
    """`step` for every channel; a peer lost on the way goes to `on_lost` (elastic), else its error is raised."""
    for ch in list(channels):
        try:
            step(ch)
        except (PeerError, IntegrityError) as e:
            if on_lost is None:
                raise
            on_lost(ch, e)


class SendPath:
    """Streams one epoch's buckets through a Transport to every receiver's channel. The source and the
    checksum switch come with each refit (`send`): a Sender's may change between refits without a new epoch.

    The packed path; a Sender picks its data path class once (`ZeroCopyPath` reads the source in place), and
    a round asks the path, never the mode: `flags` for BEGIN, `ready` before it, `send`."""

    flags = Begin(0)
    """What BEGIN tells the receivers of this path (none: buckets follow)."""
    in_place = False
    """Whether receivers read the source's own memory (so the transport may never be swapped for another)."""
    restarts_on_move = False
    """Whether a source tensor that only moved (storage, strides: no spec changed) needs a new epoch."""

    def __init__(
        self,
        manifest: Manifest,
        transport: Transport,
        channels: list[Channel],
        *,
        settings: Settings,
        num_slots: int,
        digests: DigestPlan | None,
        stages: list[Stage] | None = None,
    ) -> None:
        """`stages`: what each bucket passes through after its pack (refit.stages), in order."""
        self.manifest = manifest
        self.transport = transport
        self.channels = channels
        self.settings = settings
        self.num_slots = num_slots
        self.digests = digests
        self.packer = Packer(manifest, transport.buffers, digesting=FusedCopy if digests is not None else None)
        self.bucket_names = [[manifest.entries[s.entry].name for s in segs] for segs in manifest.segments]
        self.on_lost: Lost | None = None
        self.stages = stages or []
        self._moved: list[tuple[int, float]] = []
        """Per slot in flight: the bytes its bucket moves and the seconds its send took (for `Stage.sent`)."""

    @classmethod
    def check(cls, source: Source) -> None:
        """Raise ValueError, saying why, when this path cannot send from `source` (any source can be packed)."""

    @classmethod
    def changed(cls, source: Source, manifest: Manifest) -> bool:
        """The source's cheap signature moved since `manifest`: does that need a new epoch? Yes if any spec or
        alias changed, and on a path that reads the source in place also when only storage or layout moved (what
        it shared is the old memory)."""
        if cls.restarts_on_move:
            return True
        return sorted(source.specs(), key=lambda s: s.name) != [p.spec for p in manifest.entries]

    def share(self, source: Source) -> None:
        """Once per epoch, after the handshake: give the receivers what this path's refits read (packed: nothing)."""

    def ready(self, device: torch.device) -> None:
        """Before BEGIN: what must be done before receivers may read (packed: nothing, the pack orders it)."""

    def buffer(self, b: int) -> torch.Tensor:
        """The slot buffer bucket `b` is packed into."""
        return self.transport.buffers[b % self.num_slots]

    def send(
        self,
        source: Source,
        version: int,
        stats: RefitStats,
        generation: int,
        *,
        verify_checksum: bool,
        on_lost: Lost | None = None,
    ) -> list[str]:
        """`source`'s tensors as `version`: every bucket (each with its checksum when `verify_checksum`), then
        the digests; returns receivers' per-bucket errors. A receiver lost on the
        way goes to `on_lost` (elastic: dropped, the rest go on), or its error is raised."""
        self.on_lost = on_lost
        try:
            digests = self.digests
            if digests is not None:
                digests.reset()
            with copy_share(self.transport.name):
                errors = self._carry(source, version, stats, generation, verify_checksum)
            if digests is not None:  # after another's failure too: a receiver never commits without them
                self._send_digests(source, version, stats, digests, generation)
            return errors
        finally:
            self.on_lost = None  # it refers to the Sender: holding it would keep an unclosed one alive

    def _carry(
        self, source: Source, version: int, stats: RefitStats, generation: int, verify_checksum: bool
    ) -> list[str]:
        """Pack and send every bucket, `num_slots` in flight."""
        m, slots = self.manifest, self.num_slots
        stats.full_bytes = sum(m.bucket_nbytes)
        inflight: list[Pending | None] = [None] * slots
        self._moved = [(0, 0.0)] * slots
        errors: list[str] = []
        for b in range(m.num_buckets):
            slot = b % slots
            if b >= slots:
                self._retire(b - slots, inflight[slot], version, stats, errors)
            t = time.perf_counter()
            self.transport.before_pack(slot)
            self._pack(source, b, slot, generation)
            nbytes, flags = self._outgoing(b, slot)
            crc = checksum(self.transport.buffers[slot][:nbytes]) if verify_checksum else 0
            flags |= Bucket.CHECKSUM if verify_checksum else Bucket(0)
            stats.wire_bytes += nbytes
            self.transport.before_send(slot)
            stats.add("pack", time.perf_counter() - t)
            t = time.perf_counter()
            header = Header(
                Kind.BUCKET,
                slot=slot,
                epoch=m.epoch,
                index=b,
                version=version,
                digest=m.digest,
                nbytes=nbytes,
                checksum=crc,
                status=flags,
            )
            each(self.channels, lambda ch, h=header: ch.send(h), self.on_lost)
            inflight[slot] = self.transport.send(slot, nbytes)
            self._moved[slot] = (nbytes, time.perf_counter() - t)
            stats.add("send", time.perf_counter() - t)
            log.debug("bucket %d of %d (%d bytes) sent from slot %d", b, m.num_buckets, nbytes, slot)
        for b in range(max(0, m.num_buckets - slots), m.num_buckets):
            self._retire(b, inflight[b % slots], version, stats, errors)
        for stage in self.stages:
            stats.count_buckets(stage.buckets())
        return errors

    def _outgoing(self, b: int, slot: int) -> tuple[int, Bucket]:
        """Bucket `b`, packed in `slot`, through every stage: the bytes to move and the stages' header flags."""
        nbytes, flags = self.manifest.bucket_nbytes[b], Bucket(0)
        buf = self.transport.buffers[slot]
        for stage in self.stages:
            before = nbytes
            nbytes, more = stage.outgoing(b, buf, nbytes)
            flags |= more
            if not 0 < nbytes <= len(buf) or (nbytes != before and not stage.resizing & more):
                raise ValueError(
                    f"stage {stage.name} made bucket {b} {nbytes} bytes without a resizing flag (or beyond its buffer)"
                )
        return nbytes, flags

    def _pack(self, source: Source, b: int, slot: int, generation: int) -> None:
        """Fill `slot` with bucket `b`: replay its cached plan when `generation` vouches for it (without
        even looking the tensors up), else look them up and pack (planning anew where their layout moved)."""
        digests = self.digests
        stable = source.stable_tensors
        needs = digests is not None and digests.needs_tensors(b)
        if stable and not needs and source.lookup_only and self.packer.replay(b, slot, generation):
            if digests is not None:
                digests.take(b, None, self.packer.digests)
            return
        tensors = source.tensors(self.bucket_names[b])
        self.packer.pack(b, slot, tensors, cache=stable, generation=generation)
        if digests is not None:
            digests.take(b, tensors, self.packer.digests)

    def _retire(self, b: int, pending: Pending | None, version: int, stats: RefitStats, errors: list[str]) -> None:
        """Wait until bucket `b` is off the wire and every receiver has consumed it."""
        t = time.perf_counter()
        stage = f"refit {version}, bucket {b}"
        if pending is not None:
            pending.wait(self.settings.timeout_s)

        def ack(ch: Channel) -> None:
            header, _ = ch.expect(Kind.ACK, stage)
            if header.index != b:
                raise PeerError(f"{ch.peer} acknowledged bucket {header.index} during {stage}")
            if header.status:
                errors.append(f"{ch.peer} failed at bucket {b}")

        each(self.channels, ack, self.on_lost)
        waited = time.perf_counter() - t
        stats.add("wait", waited)
        nbytes, sending = self._moved[b % self.num_slots]
        for stage in self.stages:
            stage.sent(b, nbytes, sending + waited)

    def _send_digests(
        self, source: Source, version: int, stats: RefitStats, digests: DigestPlan, generation: int
    ) -> None:
        """Fingerprint mode: each receiver gets the digests of the live tensors it loaded (its own shards)."""
        t = time.perf_counter()
        m = self.manifest
        self._digest_all(source, digests, generation)
        verify = Header(Kind.VERIFY, epoch=m.epoch, version=version, digest=m.digest)
        sends = digests.payloads()
        each(self.channels, lambda ch: ch.send(verify, {"digests": sends[ch.rank]}), self.on_lost)
        stats.roots = roots(sends)
        stats.root = next(iter(stats.roots.values())) if len(set(stats.roots.values())) == 1 else ""
        stats.add("verify", time.perf_counter() - t)

    def _digest_all(self, source: Source, digests: DigestPlan, generation: int) -> None:
        """Digests not taken on the way (packed: every tensor was digested as it was packed)."""
