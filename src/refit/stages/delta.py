"""The delta stage: only the wire units changed since the version every receiver committed move.

A delta session keeps, on each side, one copy of every bucket's wire bytes as last committed (the "image",
padded to whole units). The sender packs a bucket as for a full refit, compares it unit by unit (2 bytes: one
bf16 or fp16 value, half of a wider one) with its image, and, when few enough units changed, rewrites the slot
as a delta payload (docs/PROTOCOL.md, Delta refits): the count, per block of 65536 units how many changed, each
changed unit's 16-bit offset in its block, then the changed units. The receiver scatters them into its image
and loads the whole bucket from there, so its engine is written as by a full refit. On CUDA with Triton the
sender's scan and the receiver's scatter run as kernels (refit.layout.delta_kernel) that give the PyTorch
path's bytes and choices here, with one host sync per bucket.

`DeltaStage` holds both halves: the trainer's names the base version at BEGIN and encodes each bucket; the
engine's checks the base and decodes. Each side's image version is written here alone.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping

import torch

from refit.errors import IntegrityError, RefitError
from refit.layout import delta_kernel
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


DECAY = 0.8
"""Weight each earlier measurement keeps per new one, so that the costs follow the link and the machine's load."""
GATED = 0.25
"""A bucket's acknowledgement that came within this fraction of its service time after the next bucket was ready
was held up by the trainer itself (a receiver acknowledges a bucket once the next one's header is in): its link
time is not seen in the pipeline, and the time of its own send and wait stands for it."""
REPROBE = 16
"""While every bucket goes full by choice the scan is not timed; the REPROBE-th delta refit since one was
scans its first kept bucket anyway, so that a cheaper scan (or a slower link) is seen."""


class Costs:
    """What this session measured, to choose per bucket between a delta and a full send: the link's seconds per
    byte (from full buckets: `Stage.sent`) and the scan's time, fitted as `per_op + nbytes * per_byte`. Each is
    a running least-squares fit whose older points fade by DECAY; None until measured. `frozen`: keep the
    values as set (tests; a caller who knows its link)."""

    def __init__(self, *, link: float | None = None, per_op: float = 0.0, per_byte: float | None = None) -> None:
        self.frozen = False
        self._link = [0.0, 0.0]  # decayed sums of seconds and bytes
        self._scan = [0.0] * 5  # decayed n, sum x, sum y, sum xx, sum xy
        self._after = [0.0, 0.0]  # decayed sums of a delta's seconds beyond its bytes' link time, and full bytes
        self._fixed = (link, per_op, per_byte)

    @classmethod
    def known(cls, *, link: float, per_op: float, per_byte: float) -> Costs:
        """Costs set once and kept (`frozen`): the link's seconds per byte and the scan's fit."""
        return cls().set(link=link, per_op=per_op, per_byte=per_byte)

    def set(self, *, link: float, per_op: float, per_byte: float) -> Costs:
        """Keep these costs from now on (`frozen`), whatever is measured."""
        self._fixed, self.frozen = (link, per_op, per_byte), True
        return self

    def moved(self, nbytes: int, seconds: float) -> None:
        if not self.frozen and nbytes > 0:
            self._link = [self._link[0] * DECAY + seconds, self._link[1] * DECAY + nbytes]

    def scanned(self, nbytes: int, seconds: float) -> None:
        if not self.frozen:
            n, sx, sy, sxx, sxy = (v * DECAY for v in self._scan)
            self._scan = [n + 1, sx + nbytes, sy + seconds, sxx + nbytes * nbytes, sxy + nbytes * seconds]

    def decoded(self, nbytes: int, seconds: float) -> None:
        """A delta bucket of `nbytes` (full) waited `seconds` beyond its payload's link time: the receiver's
        scatter into its image, which a full bucket does not need."""
        if not self.frozen and nbytes > 0:
            self._after = [self._after[0] * DECAY + max(0.0, seconds), self._after[1] * DECAY + nbytes]

    def after(self, nbytes: int) -> float:
        """Predicted seconds a delta of a bucket of `nbytes` costs after its bytes moved (0 until measured)."""
        return nbytes * self._after[0] / self._after[1] if self._after[1] else 0.0

    @property
    def link(self) -> float | None:
        """Seconds per byte the link costs the sender."""
        if self.frozen:
            return self._fixed[0]
        return self._link[0] / self._link[1] if self._link[1] else None

    def scan(self, nbytes: int) -> float | None:
        """Predicted seconds of a scan of `nbytes`."""
        if self.frozen:
            per_op, per_byte = self._fixed[1], self._fixed[2]
            return None if per_byte is None else per_op + nbytes * per_byte
        n, sx, sy, sxx, sxy = self._scan
        if not n or not sx:
            return None
        var = sxx / n - (sx / n) ** 2
        slope = (sxy / n - sx * sy / n / n) / var if var > 1e-6 * (sx / n) ** 2 else -1.0
        if slope <= 0:  # one bucket size (or noise): all of it per byte
            return nbytes * sy / sx
        per_op = max(0.0, sy / n - slope * sx / n)
        return per_op + nbytes * slope


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
        self._scratches: dict[str, torch.Tensor] = {}
        """Scratch tensors of the compare, reused by every bucket (`_scratch`)."""
        self.reason = ""
        """How `encode` sent its last bucket: delta, full-dense-sample, full-dense-scan, full-unkept, full-reprime."""

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

    def drop(self, b: int) -> None:
        """Bucket `b` goes full and is no longer kept (the REPRIME-th refit on, `encode` keeps it again)."""
        self.kept[b], self._stale[b] = False, 0

    def encode(self, b: int, buf: torch.Tensor, *, threshold: float = DELTA_THRESHOLD) -> tuple[int | None, bool]:
        """Bucket `b`, packed in `buf`, against the image. Returns the nbytes of the delta payload now in `buf`, or
        None when it goes full (`buf` untouched), and whether the images keep it (a delta: always; a full bucket:
        unless it is found dense, or still stale since it was)."""
        nb = self.manifest.bucket_nbytes[b]
        if not self.kept[b]:
            self._stale[b] += 1
            if self._stale[b] < REPRIME:
                self.reason = "full-unkept"
                return None, False
            self._stale[b] = 0
            self.absorb(b, buf)
            self.reason = "full-reprime"
            return None, True
        if delta_kernel.scans(buf, self.images[b], nb):
            return self._encode_by_kernel(b, buf, threshold)
        if self._surely_dense(b, buf, threshold):
            self.drop(b)
            self.reason = "full-dense-sample"
            return None, False
        changed = self._changed_words(b, buf)
        # every changed word holds at least one changed unit: a payload over the threshold already
        if payload_nbytes(nb, int(changed.numel())) > min(threshold * nb, buf.numel()):
            self.absorb(b, buf)
            self.reason = "full-dense-scan"
            return None, True
        idx, values = self._changed_units(b, buf, changed)
        count = int(idx.numel())
        size = payload_nbytes(nb, count)
        if size > threshold * nb or size > buf.numel():
            self.absorb(b, buf)
            self.reason = "full-dense-scan"
            return None, True
        self._write(nb, buf, idx, values)
        self.reason = "delta"
        return size, True

    def _encode_by_kernel(self, b: int, buf: torch.Tensor, threshold: float) -> tuple[int | None, bool]:
        """`encode` of a kept bucket by the Triton kernels (refit.layout.delta_kernel): the same choices and
        bytes as the PyTorch path, with one host sync."""
        nb = self.manifest.bucket_nbytes[b]
        at = self._sample_at(b, buf)
        bound = 0.0 if at is None else _dense_bound(threshold, at.numel())
        counted = delta_kernel.count(
            buf, self.images[b], nb, at=at, limit=_most_not_dense(bound), scratch=self._scratch
        )
        if at is not None and counted.sampled > bound:
            self.drop(b)
            self.reason = "full-dense-sample"
            return None, False
        size = payload_nbytes(nb, counted.count)
        if size > threshold * nb or size > buf.numel():
            self.absorb(b, buf)
            self.reason = "full-dense-scan"
            return None, True
        head = table_nbytes(nb, counted.count)
        if counted.count:
            delta_kernel.write(counted, buf, self.images[b], head=head, block=BLOCK, scratch=self._scratch)
        else:
            buf[:head].zero_()
        self.reason = "delta"
        return size, True

    def _scratch(self, name: str, n: int, dtype: torch.dtype) -> torch.Tensor:
        """`n` elements of a scratch tensor kept for the epoch (grown as needed): a fresh one of megabytes would be
        paged in on every use, which costs more than the compare itself."""
        have = self._scratches.get(name)
        if have is None or have.numel() < n:
            have = self._scratches[name] = torch.empty(max(n, 1024), dtype=dtype, device=self.images[0].device)
        return have[:n]

    def _nonzero(self, name: str, mask: torch.Tensor) -> torch.Tensor:
        """The indices of `mask`'s set elements (int64, increasing), into scratch `name`."""
        count = int(torch.count_nonzero(mask))
        out = self._scratch(name, count, torch.int64)
        if count:
            torch.nonzero(mask, out=out.view(count, 1))
        return out

    def _changed_words(self, b: int, buf: torch.Tensor) -> torch.Tensor:
        """The 8-byte words of bucket `b`'s whole words that differ from the image's (their indices, increasing).
        One compare at memory speed into a reused mask (1 byte per 8)."""
        words = self.manifest.bucket_nbytes[b] // 8
        mask = self._scratch("mask", words, torch.bool)
        torch.ne(buf[: words * 8].view(torch.int64), self.images[b][: words * 8].view(torch.int64), out=mask)
        return self._nonzero("words", mask)

    def _changed_units(self, b: int, buf: torch.Tensor, changed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Of the `changed` words (and the bytes after the last whole word): the changed units' indices, increasing,
        and their new bytes (int16); the image takes them."""
        nb = self.manifest.bucket_nbytes[b]
        words, n = nb // 8, changed.numel()
        image = self.images[b][: words * 8].view(torch.int64)
        new = torch.index_select(
            buf[: words * 8].view(torch.int64), 0, changed, out=self._scratch("new", n, torch.int64)
        )
        old = torch.index_select(image, 0, changed, out=self._scratch("old", n, torch.int64))
        mask = torch.ne(new.view(torch.int16), old.view(torch.int16), out=self._scratch("units", 4 * n, torch.bool))
        flat = self._nonzero("flat", mask)
        count = flat.numel()
        rows = torch.bitwise_right_shift(flat, 2, out=self._scratch("rows", count, torch.int64))
        idx = torch.index_select(changed, 0, rows, out=self._scratch("idx", count, torch.int64)).mul_(4)
        idx.add_(torch.bitwise_and(flat, 3, out=rows))
        values = torch.index_select(new.view(torch.int16), 0, flat, out=self._scratch("values", count, torch.int16))
        image.index_copy_(0, changed, new)
        tail = nb - words * 8
        if tail:  # under 8 bytes after the last whole word (an odd last byte compared with the image's zero pad)
            units = self.images[b][words * 8 :].view(torch.int16)
            now = torch.zeros(units.numel() * UNIT, dtype=torch.uint8, device=buf.device)
            now[:tail] = buf[words * 8 : nb]
            at = torch.nonzero(torch.ne(now.view(torch.int16), units)).view(-1)
            idx = torch.cat([idx, at + words * 4])
            values = torch.cat([values, now.view(torch.int16).index_select(0, at)])
            units.copy_(now.view(torch.int16))
        return idx, values

    def _write(self, nb: int, buf: torch.Tensor, idx: torch.Tensor, values: torch.Tensor) -> None:
        """The delta payload of the changed units `idx` (increasing) and their `values` into `buf`."""
        count, blocks = int(idx.numel()), num_blocks(nb)
        head = table_nbytes(nb, count)
        bounds = torch.arange(blocks + 1, device=idx.device) * BLOCK
        per_block = torch.diff(torch.searchsorted(idx, bounds))
        buf[:8].view(torch.int64).fill_(count)
        buf[8 : 8 + 4 * blocks].view(torch.int32).copy_(per_block)
        at = 8 + 4 * blocks
        offsets = torch.bitwise_and(idx, BLOCK - 1, out=self._scratch("rows", count, torch.int64))
        buf[at : at + 2 * count].view(torch.int16).copy_(offsets)  # wraps to int16: read back as unsigned
        buf[at + 2 * count : head].zero_()
        buf[head : head + UNIT * count].view(torch.int16).copy_(values)

    def _surely_dense(self, b: int, buf: torch.Tensor, threshold: float) -> bool:
        """A sample of the units says a delta of bucket `b` would be well over `threshold` of its bytes."""
        at = self._sample_at(b, buf)
        if at is None:
            return False
        whole = self.manifest.bucket_nbytes[b] // UNIT
        new = buf[: whole * UNIT].view(torch.int16).index_select(0, at)
        old = self.images[b][: whole * UNIT].view(torch.int16).index_select(0, at)
        return int(torch.count_nonzero(torch.ne(new, old))) > _dense_bound(threshold, new.numel())

    def _sample_at(self, b: int, buf: torch.Tensor) -> torch.Tensor | None:
        """The units of bucket `b` its sample compares (drawn once per epoch), on `buf`'s device; None for a
        bucket too small to sample."""
        whole = self.manifest.bucket_nbytes[b] // UNIT
        if whole < 64 * SAMPLE:
            return None
        at = self._samples.get(b)
        if at is None:
            runs = whole // SAMPLE
            jitter = torch.randint(0, SAMPLE, (runs,), generator=torch.Generator().manual_seed(b))
            at = self._samples[b] = (torch.arange(runs) * SAMPLE + jitter).to(buf.device)
        return at

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
        head = table_nbytes(nb, count)
        if delta_kernel.scatters(buf, self.images[b]):
            wrong = delta_kernel.scatter(
                buf, self.images[b], units=n, count=count, head=head, block=BLOCK, scratch=self._scratch
            )
            if wrong is not None:
                raise _malformed(b, count, n, wrong)
            return count
        counts = buf[8 : 8 + 4 * blocks].view(torch.int32).to(torch.int64)
        at = 8 + 4 * blocks
        offsets = buf[at : at + 2 * count].view(torch.int16).to(torch.int64) & 0xFFFF
        if int(counts.min()) < 0 or int(counts.sum()) != count:
            raise _malformed(b, count, n, "sum")
        idx = torch.repeat_interleave(torch.arange(blocks, device=buf.device) * BLOCK, counts) + offsets
        if int(idx[-1]) >= n or (count > 1 and not bool((idx[1:] > idx[:-1]).all())):
            raise _malformed(b, count, n, "order")
        self.images[b].view(torch.int16).index_copy_(0, idx, buf[head:nbytes].view(torch.int16))
        return count


def _malformed(b: int, count: int, n: int, wrong: str) -> IntegrityError:
    """The error for a payload whose block counts do not add up to `count` ("sum") or whose units do not
    increase within the bucket's `n` ("order")."""
    if wrong == "sum":
        return IntegrityError(f"delta bucket {b}: its per-block counts do not add up to {count}")
    return IntegrityError(f"delta bucket {b}: changed units are not increasing within 0..{n - 1}")


def _dense_bound(threshold: float, sampled: int) -> float:
    """The most changed units a sample of `sampled` units may hold before its bucket is surely dense: a payload
    costs 2 * UNIT bytes per changed unit, so a delta goes over `threshold` of the bucket's bytes at a changed
    fraction of threshold / 2; the sample must exceed that by 1.5x."""
    return 1.5 * (threshold / 2) * sampled


def _most_not_dense(bound: float) -> int:
    """The most changed units a sample may hold and not be dense (`count > bound`), as an int32 (NaN: any)."""
    if math.isnan(bound):
        return delta_kernel.INT32_MAX
    return math.floor(max(min(bound, delta_kernel.INT32_MAX), -1))


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
        self.costs = Costs()
        """The trainer's: the link's and the scan's measured costs, by which each bucket goes as a delta or full."""
        self._delta = False
        """The trainer's: this refit goes as a delta (its BEGIN named a base)."""
        self._saw = [0] * manifest.num_buckets
        """The trainer's, per bucket: the payload of its last scan (its full bytes when over the threshold)."""
        self._full = [False] * manifest.num_buckets
        """The trainer's, per bucket: it went full in this refit (its send times the link)."""
        self._counts: dict[str, int] = {}
        self._since_scan = 0
        self._by_link: dict[int, int] = {}
        """The trainer's, per bucket not kept because the link was faster than its scan: refits left until it
        is kept again, so that the scan is timed anew."""
        self._ready = [0.0] * manifest.num_buckets
        """The trainer's, per bucket: when its bytes were ready to send (this refit's, once it went out)."""
        self._acked: float | None = None
        """The trainer's: when this refit's last bucket was acknowledged by every receiver (None: none yet)."""

    def configure(self, session: Mapping[str, object]) -> None:
        threshold, costs = session.get("delta_threshold"), session.get("delta_costs")
        if isinstance(threshold, (int, float)) and not isinstance(threshold, bool):
            self.threshold = float(threshold)
        if isinstance(costs, Costs):
            self.costs = costs  # the session's: what it measured outlives an epoch

    def base(self, version: int, ranks: list[int]) -> int | None:
        base = self.image.base_for(ranks)
        self._delta = base is not None
        self._counts, self._acked = {}, None
        if self._delta:
            self._since_scan += 1
        return base

    def outgoing(self, b: int, buf: torch.Tensor, nbytes: int) -> tuple[int, Bucket]:
        went = self._outgoing(b, buf, nbytes)
        self._ready[b] = time.perf_counter()
        return went

    def _outgoing(self, b: int, buf: torch.Tensor, nbytes: int) -> tuple[int, Bucket]:
        way = self._way(b)
        if way == "full-link":  # nor kept: no image copy on either side while the link stays fast
            self.image.drop(b)
            self._went(b, way, full=True)
            return nbytes, Bucket(0)
        if way is not None:  # full, uncompared, and kept: the images take its bytes
            self.image.absorb(b, buf)
            self._went(b, way, full=True)
            return nbytes, Bucket.KEPT
        t = time.perf_counter()
        size, kept = self.image.encode(b, buf, threshold=self.threshold)
        way = self.image.reason
        if way in ("delta", "full-dense-scan"):
            self.costs.scanned(nbytes, time.perf_counter() - t)
            self._saw[b] = nbytes if size is None else size
            self._since_scan = 0
        self._went(b, way, full=size is None)
        flags = Bucket.KEPT if kept else Bucket(0)
        return (nbytes, flags) if size is None else (size, flags | Bucket.DELTA)

    def _way(self, b: int) -> str | None:
        """Bucket `b` goes full, uncompared: why. 'full-base' (kept): a full refit primes every bucket.
        'full-link' (not kept): the scan and the receiver's scatter are predicted to cost more than the link time
        its bytes would save. 'full-reprime' (kept again): the link turned slow, or the scan is due to be timed
        again. None: encode."""
        if not self._delta:
            self._by_link.pop(b, None)
            return "full-base"
        left = self._by_link.get(b)
        if left is not None:
            if left <= 0 or self._pays(b):
                del self._by_link[b]
                return "full-reprime"
            self._by_link[b] = left - 1
            return "full-link"
        if not self.image.kept[b]:
            return None  # encode counts it stale (or primes it again)
        if self._pays(b) is False:
            self._by_link[b] = REPROBE - 2
            return "full-link"
        return None

    def _pays(self, b: int) -> bool | None:
        """A delta of bucket `b` is predicted to save time; None: not measured yet (or not for long)."""
        nb = self.manifest.bucket_nbytes[b]
        link, scan = self.costs.link, self.costs.scan(nb)
        if link is None or scan is None or self._since_scan >= REPROBE:
            return None
        return scan + self.costs.after(nb) <= link * (nb - self._saw[b])

    def _went(self, b: int, way: str, *, full: bool) -> None:
        self._counts[way] = self._counts.get(way, 0) + 1
        self._full[b] = full

    def sent(self, b: int, nbytes: int, seconds: float) -> None:
        if not self.trainer:
            return
        now, since = time.perf_counter(), self._acked
        self._acked = now
        if since is None and self.manifest.num_buckets > 1:
            return  # the first bucket also waits for the receivers to begin the refit: no cost per byte
        took = self._took(b, now, 0.0 if since is None else since, seconds)
        if self._full[b]:
            self.costs.moved(nbytes, took)
        elif (link := self.costs.link) is not None:
            self.costs.decoded(self.manifest.bucket_nbytes[b], took - link * nbytes)

    def _took(self, b: int, now: float, since: float, seconds: float) -> float:
        """Bucket `b`'s time on the link, acknowledged `now`: from when it was ready, or the bucket before was
        acknowledged if later (the link was busy until then). A send returns once its bytes are in a socket buffer,
        so only this pipeline time sees the link's real cost; `seconds` (its send and wait) where the trainer held
        the acknowledgement up itself, preparing the next bucket (GATED)."""
        start = max(since, self._ready[b])
        took = now - start
        later = self._ready[b + 1] if b + 1 < len(self._ready) else 0.0
        if later > start and now - later < GATED * took:
            return seconds
        return took

    def buckets(self) -> dict[str, int]:
        return dict(self._counts)

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
