"""Delta buckets: the committed wire image of one epoch, and the chunked payload a delta refit sends.

A delta session keeps, on each side, one copy of every bucket's wire bytes as last committed (the "image",
padded to whole chunks). The sender packs a bucket as for a full refit, compares it chunk by chunk with its
image, and, when few enough chunks changed, rewrites the slot as a delta payload (docs/PROTOCOL.md, Delta
refits): the count, the changed chunk indices, then those chunks. The receiver scatters them into its image
and loads the whole bucket from there, so its engine is written as by a full refit.
"""

from __future__ import annotations

import torch

from refit.errors import IntegrityError
from refit.layout.manifest import Manifest

CHUNK_BYTES = 64 << 10
"""Bytes per delta chunk (of a bucket's wire bytes); a multiple of 8 so chunks compare as int64 words."""
DELTA_THRESHOLD = 0.5
"""A bucket goes as a delta only when its payload is at most this fraction of its full bytes."""
_ALIGN = 256


def table_nbytes(count: int) -> int:
    """Bytes before the chunks of a delta payload of `count` chunks: count and indices, aligned to 256."""
    return -(-(8 + 8 * count) // _ALIGN) * _ALIGN


def payload_nbytes(count: int, chunk: int = CHUNK_BYTES) -> int:
    return table_nbytes(count) + count * chunk


class WireImage:
    """Per bucket, the wire bytes every holder last committed (`version`; None while a refit rewrites it or
    after one failed: no delta may be sent against it, or accepted)."""

    def __init__(self, manifest: Manifest, device: torch.device, *, chunk: int = CHUNK_BYTES) -> None:
        if chunk <= 0 or chunk % 8:
            raise ValueError(f"delta chunk size ({chunk}) must be a positive multiple of 8 bytes")
        self.manifest, self.chunk = manifest, chunk
        self.num_chunks = [-(-nb // chunk) for nb in manifest.bucket_nbytes]
        self.images = [torch.zeros(n * chunk, dtype=torch.uint8, device=device) for n in self.num_chunks]
        self.version: int | None = None

    @property
    def nbytes(self) -> int:
        """Memory the image takes (the model in its wire dtype, padded to whole chunks per bucket)."""
        return sum(n * self.chunk for n in self.num_chunks)

    def absorb(self, b: int, buf: torch.Tensor) -> None:
        """Bucket `b` went full: its bytes in `buf` become the image's."""
        nb = self.manifest.bucket_nbytes[b]
        self.images[b][:nb].copy_(buf[:nb])

    def changed(self, b: int, buf: torch.Tensor) -> torch.Tensor:
        """Indices (int64) of the chunks of bucket `b` whose bytes in `buf` differ from the image's."""
        nb, c = self.manifest.bucket_nbytes[b], self.chunk
        img, whole = self.images[b], nb // c
        parts = []
        if whole:
            new = buf[: whole * c].view(torch.int64).view(whole, c // 8)
            parts.append(torch.ne(new, img[: whole * c].view(torch.int64).view(whole, c // 8)).any(dim=1))
        if nb > whole * c:  # the last, partial chunk
            parts.append(torch.ne(buf[whole * c : nb], img[whole * c : nb]).any().view(1))
        return torch.nonzero(torch.cat(parts)).view(-1) if parts else torch.zeros(0, dtype=torch.int64)

    def encode(self, b: int, buf: torch.Tensor, *, threshold: float = DELTA_THRESHOLD) -> int | None:
        """Bucket `b`, packed in `buf`, against the image: updates the image to it, and returns the nbytes of
        the delta payload now in `buf`, or None when a delta would not pay (`buf` still holds the full bucket)."""
        nb, c = self.manifest.bucket_nbytes[b], self.chunk
        idx = self.changed(b, buf)
        count = int(idx.numel())
        size = payload_nbytes(count, c)
        if size > threshold * nb or size > buf.numel():
            self.absorb(b, buf)
            return None
        if count:
            self._take(b, buf, idx)
            head = table_nbytes(count)
            table = buf[:head].view(torch.int64)
            table[0] = count
            table[1 : 1 + count] = idx
            out = buf[head:size].view(count, c)
            torch.index_select(self.images[b].view(-1, c), 0, idx, out=out)
        else:
            buf[:8].view(torch.int64)[0] = 0
        return size

    def _take(self, b: int, buf: torch.Tensor, idx: torch.Tensor) -> None:
        """The changed chunks `idx` of `buf` into the image (the others are equal already)."""
        nb, c = self.manifest.bucket_nbytes[b], self.chunk
        whole, img = nb // c, self.images[b]
        full = idx[idx < whole]
        if full.numel():
            img.view(-1, c).index_copy_(0, full, buf[: whole * c].view(whole, c).index_select(0, full))
        if full.numel() < idx.numel():  # the last, partial chunk changed
            img[whole * c : nb].copy_(buf[whole * c : nb])

    def decode(self, b: int, buf: torch.Tensor, nbytes: int) -> int:
        """Scatter the delta payload of bucket `b` (`nbytes` in `buf`) into the image; returns its chunk count.
        Everything is checked before a byte is written: IntegrityError for a malformed payload."""
        c, n = self.chunk, self.num_chunks[b]
        if nbytes < 8 or nbytes > buf.numel():
            raise IntegrityError(f"delta bucket {b}: {nbytes} bytes is no delta payload")
        count = int(buf[:8].view(torch.int64)[0])
        if not 0 <= count <= n or payload_nbytes(count, c) != nbytes:
            raise IntegrityError(
                f"delta bucket {b}: {count} chunk(s) in {nbytes} bytes disagree (the bucket has {n} chunks of {c} B)"
            )
        if not count:
            return 0
        head = table_nbytes(count)
        idx = buf[8 : 8 + 8 * count].view(torch.int64).clone()
        if int(idx[0]) < 0 or int(idx[-1]) >= n or (count > 1 and not bool((idx[1:] > idx[:-1]).all())):
            raise IntegrityError(f"delta bucket {b}: chunk indices are not increasing within 0..{n - 1}")
        self.images[b].view(-1, c).index_copy_(0, idx, buf[head:nbytes].view(count, c))
        return count
