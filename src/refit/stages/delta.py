"""The delta stage: only the wire units changed since the version every receiver committed move.

A delta session keeps, on each side, one copy of every bucket's wire bytes as last committed (the "image",
padded to whole units). The sender packs a bucket as for a full refit, compares it unit by unit (2 bytes: one
bf16 or fp16 value, half of a wider one) with its image, and, when few enough units changed, rewrites the slot
as a delta payload (docs/PROTOCOL.md, Delta refits): the count, per block of 65536 units how many changed, each
changed unit's 16-bit offset in its block, then the changed units. The receiver scatters them into its image
and loads the whole bucket from there, so its engine is written as by a full refit.

`DeltaStage` holds both halves: the trainer's names the base version at BEGIN and encodes each bucket; the
engine's checks the base and decodes. Each side's image version is written here alone.
"""

from __future__ import annotations

import torch

from refit.errors import IntegrityError, RefitError
from refit.layout.manifest import Manifest
from refit.protocol.wire import Bucket
from refit.stages.base import Stage

UNIT = 2
"""Bytes per compared unit: one bf16/fp16 value. Measured (BENCHMARKS.md, Delta refits): after one AdamW step at
lr 1e-6 a few percent of bf16 wire values change, scattered, so nearly every chunk of 64 KiB changes somewhere
(wire bytes = full) and a quarter of 8-byte words do; per value, a delta costs 4 bytes per changed value."""
BLOCK = 1 << 16
"""Units per block: an offset in a block fits 16 bits."""
DELTA_THRESHOLD = 0.25
"""A bucket goes as a delta only when its payload is at most this fraction of its full bytes (an eighth of its
values changed). Measured over gloo (BENCHMARKS.md): the delta's own work grows with the changed values (134 ms
at 4 % of values, 305 ms at 21 %, against 62 and 66 ms for a full refit of the same 50 MB), so beyond this the bytes
it saves cannot pay for it on any link we have measured."""
SAMPLE = 64
"""One unit in each run of SAMPLE units, at a random place fixed per epoch, is compared first: a bucket that changed
well beyond the threshold goes full without the whole comparison, so a refit in which everything changed costs
close to a full one. A fixed stride would alias with tensors whose size divides it (only the first value of each
changing); the jitter keeps the sample's changed fraction an unbiased estimate. A wrong guess only ever sends a
bucket full, never wrong bytes."""
REPRIME = 4
"""A bucket found dense is no longer kept in the images (neither side copies it; it goes full, uncompared);
the REPRIME-th refit after, it is kept again, so that a return to sparse changes is seen."""


def num_units(nbytes: int) -> int:
    return -(-nbytes // UNIT)


def num_blocks(nbytes: int) -> int:
    return -(-num_units(nbytes) // BLOCK)


def table_nbytes(nbytes: int, count: int) -> int:
    """Bytes before the values of a delta payload of `count` units for a bucket of `nbytes`: the int64 count,
    an int32 count per block, an int16 offset per unit, padded to 8 bytes."""
    return -(-(8 + 4 * num_blocks(nbytes) + 2 * count) // 8) * 8


def payload_nbytes(nbytes: int, count: int) -> int:
    return table_nbytes(nbytes, count) + UNIT * count


class WireImage:
    """Per bucket, the wire bytes every holder last committed (`version`; None while a refit rewrites it or
    after one failed: no delta may be sent against it, or accepted)."""

    def __init__(self, manifest: Manifest, device: torch.device) -> None:
        self.manifest = manifest
        self.images = [
            torch.zeros(num_units(nb) * UNIT, dtype=torch.uint8, device=device) for nb in manifest.bucket_nbytes
        ]
        self.version: int | None = None
        self.kept = [False] * len(manifest.bucket_nbytes)
        """Per bucket: the image holds its bytes (a delta of it may be sent, or taken)."""
        self._stale = [0] * len(manifest.bucket_nbytes)
        """Per bucket not kept: refits since it was found dense."""
        self.holders: set[int] = set()
        """The ranks of the receivers that committed `version`."""
        self._samples: dict[int, torch.Tensor] = {}
        """Per bucket compared by a sample: the units sampled (one per run of SAMPLE units, drawn once)."""

    def base_for(self, ranks: list[int]) -> int | None:
        """The version a refit to `ranks` may be sent as a delta against: the image's, when each of them committed
        it (never a delta against what a joiner or a failed receiver lacks); None sends it full. The image then
        reads as being rewritten until `committed`."""
        base = self.version if all(r in self.holders for r in ranks) else None
        self.version = None
        return base

    def committed(self, version: int, ranks: list[int]) -> None:
        """A refit committed on `ranks` (every receiver of it): the image now stands for `version`."""
        self.version, self.holders = version, set(ranks)

    @property
    def nbytes(self) -> int:
        """Memory the image takes: the model in its wire dtype (each bucket padded to whole units)."""
        return sum(int(t.numel()) for t in self.images)

    def absorb(self, b: int, buf: torch.Tensor) -> None:
        """Bucket `b` went full: its bytes in `buf` become the image's."""
        nb = self.manifest.bucket_nbytes[b]
        self.images[b][:nb].copy_(buf[:nb])
        self.kept[b] = True

    def _changed(self, b: int, buf: torch.Tensor) -> torch.Tensor:
        """Per unit of bucket `b`: whether its bytes in `buf` differ from the image's (bool)."""
        nb = self.manifest.bucket_nbytes[b]
        whole = nb // UNIT
        img = self.images[b]
        ne = torch.ne(buf[: whole * UNIT].view(torch.int16), img[: whole * UNIT].view(torch.int16))
        if nb > whole * UNIT:  # an odd last byte
            ne = torch.cat([ne, torch.ne(buf[nb - 1 : nb], img[nb - 1 : nb])])
        return ne

    def encode(self, b: int, buf: torch.Tensor, *, threshold: float = DELTA_THRESHOLD) -> tuple[int | None, bool]:
        """Bucket `b`, packed in `buf`, against the image. Returns the nbytes of the delta payload now in `buf`, or
        None when it goes full (`buf` untouched), and whether the images keep it (a delta: always; a full bucket:
        unless it is found dense, or still stale since it was)."""
        nb = self.manifest.bucket_nbytes[b]
        if not self.kept[b]:
            self._stale[b] += 1
            if self._stale[b] < REPRIME:
                return None, False
            self._stale[b] = 0
            self.absorb(b, buf)
            return None, True
        if self._surely_dense(b, buf, threshold):
            self.kept[b], self._stale[b] = False, 0
            return None, False
        ne = self._changed(b, buf)
        count = int(torch.count_nonzero(ne))
        size = payload_nbytes(nb, count)
        if size > threshold * nb or size > buf.numel():
            self.absorb(b, buf)
            return None, True
        idx = torch.nonzero(ne).view(-1)
        units = self.images[b].view(torch.int16)
        if count:
            if nb % UNIT:  # the odd last byte goes through the image's padded unit
                self.images[b][nb - 1 : nb].copy_(buf[nb - 1 : nb])
                whole = idx[idx < nb // UNIT]
            else:
                whole = idx
            units.index_copy_(0, whole, buf[: (nb // UNIT) * UNIT].view(torch.int16).index_select(0, whole))
        blocks = num_blocks(nb)
        head = table_nbytes(nb, count)
        buf[:8].view(torch.int64).fill_(count)
        buf[8 : 8 + 4 * blocks].view(torch.int32).copy_(torch.bincount(idx // BLOCK, minlength=blocks))
        at = 8 + 4 * blocks
        buf[at : at + 2 * count].view(torch.int16).copy_(idx % BLOCK)  # wraps to int16: read back as unsigned
        torch.index_select(units, 0, idx, out=buf[head:size].view(torch.int16))
        return size, True

    def _surely_dense(self, b: int, buf: torch.Tensor, threshold: float) -> bool:
        """A sample of the units says a delta of bucket `b` would be well over `threshold` of its bytes."""
        whole = self.manifest.bucket_nbytes[b] // UNIT
        if whole < 64 * SAMPLE:
            return False
        at = self._samples.get(b)
        if at is None:
            runs = whole // SAMPLE
            jitter = torch.randint(0, SAMPLE, (runs,), generator=torch.Generator().manual_seed(b))
            at = self._samples[b] = (torch.arange(runs) * SAMPLE + jitter).to(buf.device)
        new = buf[: whole * UNIT].view(torch.int16).index_select(0, at)
        old = self.images[b][: whole * UNIT].view(torch.int16).index_select(0, at)
        # a payload costs 2 * UNIT bytes per changed unit: over `threshold` beyond 1.5x the changed fraction
        return int(torch.count_nonzero(torch.ne(new, old))) > 1.5 * (threshold / 2) * new.numel()

    def decode(self, b: int, buf: torch.Tensor, nbytes: int) -> int:
        """Scatter the delta payload of bucket `b` (`nbytes` in `buf`) into the image; returns its unit count.
        Everything is checked before a byte is written: IntegrityError for a malformed payload."""
        nb = self.manifest.bucket_nbytes[b]
        n, blocks = num_units(nb), num_blocks(nb)
        if not self.kept[b]:
            raise IntegrityError(f"delta bucket {b}: this receiver's image does not keep that bucket (sent full last)")
        if nbytes < 8 or nbytes > buf.numel():
            raise IntegrityError(f"delta bucket {b}: {nbytes} bytes is no delta payload")
        count = int(buf[:8].view(torch.int64)[0])
        if not 0 <= count <= n or payload_nbytes(nb, count) != nbytes:
            raise IntegrityError(
                f"delta bucket {b}: {count} changed unit(s) in {nbytes} bytes disagree (the bucket has {n} units)"
            )
        if not count:
            return 0
        counts = buf[8 : 8 + 4 * blocks].view(torch.int32).to(torch.int64)
        at = 8 + 4 * blocks
        offsets = buf[at : at + 2 * count].view(torch.int16).to(torch.int64) & 0xFFFF
        if int(counts.min()) < 0 or int(counts.sum()) != count:
            raise IntegrityError(f"delta bucket {b}: its per-block counts do not add up to {count}")
        idx = torch.repeat_interleave(torch.arange(blocks, device=buf.device) * BLOCK, counts) + offsets
        if int(idx[-1]) >= n or (count > 1 and not bool((idx[1:] > idx[:-1]).all())):
            raise IntegrityError(f"delta bucket {b}: changed units are not increasing within 0..{n - 1}")
        head = table_nbytes(nb, count)
        self.images[b].view(torch.int16).index_copy_(0, idx, buf[head:nbytes].view(torch.int16))
        return count


class DeltaStage(Stage):
    """Delta refits (`Sender(delta=True)`): each side keeps the epoch's committed wire image."""

    name = "delta"
    flags = Bucket.DELTA | Bucket.KEPT
    resizing = Bucket.DELTA

    def __init__(self, manifest: Manifest, device: torch.device, *, trainer: bool) -> None:
        super().__init__(manifest, device, trainer=trainer)
        self.image = WireImage(manifest, device)
        self.threshold = DELTA_THRESHOLD
        """The trainer's: a bucket goes as a delta only when its payload is at most this fraction of it."""
        self._delta = False
        """The trainer's: this refit goes as a delta (its BEGIN named a base)."""

    def base(self, version: int, ranks: list[int]) -> int | None:
        base = self.image.base_for(ranks)
        self._delta = base is not None
        return base

    def outgoing(self, b: int, buf: torch.Tensor, nbytes: int) -> tuple[int, Bucket]:
        if not self._delta:  # a full refit primes every bucket
            self.image.absorb(b, buf)
            return nbytes, Bucket.KEPT
        size, kept = self.image.encode(b, buf, threshold=self.threshold)
        flags = Bucket.KEPT if kept else Bucket(0)
        return (nbytes, flags) if size is None else (size, flags | Bucket.DELTA)

    def accept(self, version: int, base: int | None) -> RefitError | None:
        """From here until this refit commits the image is being rewritten, so it stands for no version."""
        held, self.image.version = self.image.version, None
        self._delta = base is not None
        if base is None or held == base:
            return None
        holds = "no committed image" if held is None else f"an image of version {held}"
        return IntegrityError(
            f"refused a delta refit of version {version} against base version {base}: this receiver holds {holds} "
            "(it joined, failed or missed a version); nothing of it was loaded. The sender's next refit goes full"
        )

    def incoming(self, b: int, buf: torch.Tensor, nbytes: int, flags: Bucket) -> torch.Tensor | None:
        if not self.flags & flags:  # sent full and not kept: no delta of it may follow until it is again
            self.image.kept[b] = False
            return None
        if Bucket.DELTA & flags:
            if not self._delta:
                raise IntegrityError(f"bucket {b} is a delta payload in a refit whose BEGIN named no base version")
            self.image.decode(b, buf, nbytes)
        else:
            self.image.absorb(b, buf)
        return self.image.images[b]

    def buffers(self) -> list[torch.Tensor]:
        return self.image.images

    def committed(self, version: int, ranks: list[int]) -> None:
        if self.trainer:
            self.image.committed(version, ranks)
        else:
            self.image.version = version  # the base a later delta may name

    @property
    def nbytes(self) -> int:
        return self.image.nbytes
