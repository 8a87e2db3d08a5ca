"""Manifest: the refit info prepared once per epoch (tensor placements in buckets), its digest and JSON form."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from functools import cached_property
from typing import NamedTuple

from refit.spec import TensorSpec, dtype_from_name, dtype_name

FORMAT = "refit.manifest/1"
MAX_TENSORS = 1_000_000
MAX_NAME_CHARS = 1024
MAX_DIMS = 16
MAX_BUCKETS = 1 << 24
MAX_ALIASES = 64
MAX_BYTES = 1 << 56
"""Largest capacity, tensor or offset accepted from a peer (64 PiB): keeps every sum far from overflow."""


class Placement(NamedTuple):
    """Where one tensor's bytes sit: from `offset` of `bucket` on, continuing into the next buckets if larger.
    (Tuples, not dataclasses: a manifest holds up to a million and is parsed in one go.)"""

    spec: TensorSpec
    bucket: int
    offset: int

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def nbytes(self) -> int:
        return self.spec.nbytes


class Segment(NamedTuple):
    """A byte range of one tensor inside one bucket: tensor bytes [lo, hi) live at bucket offset `at`."""

    entry: int
    lo: int
    hi: int
    at: int


@dataclass(frozen=True)
class Manifest:
    """Ordered placements plus the bucket geometry; everything a refit needs that does not change per refit."""

    capacity: int
    """Bytes per bucket buffer."""
    alignment: int
    """Every tensor starts at a multiple of this many bytes."""
    entries: tuple[Placement, ...]
    """Placements in wire order (sorted by name)."""
    bucket_nbytes: tuple[int, ...]
    """Bytes used in each bucket, rounded up to the alignment: what is moved per bucket."""
    epoch: int = 0
    """Bumped by the sender whenever a dtype or shape changes; not part of the digest."""
    _index: dict[str, int] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._index.update((n, i) for i, p in enumerate(self.entries) for n in p.spec.names)
        if len(self._index) != sum(len(p.spec.names) for p in self.entries):
            raise ValueError("manifest has duplicate tensor names (aliases included)")

    @property
    def num_buckets(self) -> int:
        return len(self.bucket_nbytes)

    @cached_property
    def nbytes(self) -> int:
        """Bytes of tensor data (without padding)."""
        return sum(p.nbytes for p in self.entries)

    def entry(self, name: str) -> Placement:
        """The placement carrying `name` (a primary name or an alias)."""
        return self.entries[self._index[name]]

    @cached_property
    def names(self) -> list[str]:
        """Every name the receivers load, aliases included."""
        return [n for p in self.entries for n in p.spec.names]

    @cached_property
    def segments(self) -> tuple[tuple[Segment, ...], ...]:
        """Per bucket, the tensor byte ranges it carries, in order."""
        out: list[list[Segment]] = [[] for _ in range(self.num_buckets)]
        for i, p in enumerate(self.entries):
            lo, bucket, at = 0, p.bucket, p.offset
            while True:
                hi = min(p.nbytes, lo + self.capacity - at)
                out[bucket].append(Segment(i, lo, hi, at))
                if hi >= p.nbytes:
                    break
                lo, bucket, at = hi, bucket + 1, 0
        return tuple(tuple(s) for s in out)

    @cached_property
    def last_bucket(self) -> tuple[int, ...]:
        """Per entry, the bucket holding its final bytes: where it is complete and can be loaded."""
        last = [0] * len(self.entries)
        for b, segs in enumerate(self.segments):
            for s in segs:
                last[s.entry] = b
        return tuple(last)

    @property
    def max_split_nbytes(self) -> int:
        """Largest tensor that spans buckets (needs a staging tensor on the receiver), 0 if none."""
        return max((p.nbytes for p in self.entries if p.nbytes > self.capacity - p.offset), default=0)

    def canonical(self) -> dict:
        return {
            "format": FORMAT,
            "capacity": self.capacity,
            "alignment": self.alignment,
            "bucket_nbytes": list(self.bucket_nbytes),
            "tensors": [_entry(p) for p in self.entries],
        }

    @cached_property
    def _canonical_json(self) -> bytes:
        return _dumps(self.canonical())

    @cached_property
    def digest(self) -> bytes:
        """16 bytes of SHA-256 over the canonical JSON (layout only; the epoch is not in it)."""
        return hashlib.sha256(self._canonical_json).digest()[:16]

    def to_json(self) -> bytes:
        """The canonical JSON with the epoch: keys sort as ...capacity, epoch, format..., so the epoch goes
        in just before the top-level "format" key (the first one: tensor names come after it)."""
        head, sep, tail = self._canonical_json.partition(b',"format":')
        return head + b',"epoch":%d' % self.epoch + sep + tail

    @classmethod
    def from_json(cls, data: bytes) -> Manifest:
        """Parse and check a manifest; raises ValueError naming the first thing wrong."""
        try:
            obj = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"manifest is not valid JSON: {e}") from None
        m = _parse(obj)
        # The digest covers the bytes that were parsed, less the epoch: no need to re-encode 100k entries.
        # Bytes not in canonical form get another digest than the sender's, which BEGIN then rejects.
        head, sep, tail = data.partition(b',"format":')
        epoch = b',"epoch":%d' % m.epoch
        if sep and head.endswith(epoch):
            m.__dict__["_canonical_json"] = head[: -len(epoch)] + sep + tail
        return m


def _entry(p: Placement) -> list:
    spec = p.spec
    row = [spec.name, list(spec.shape), dtype_name(spec.dtype), p.bucket, p.offset, spec.nbytes]
    if spec.aliases:
        row.append(list(spec.aliases))
    return row


def _dumps(obj: dict) -> bytes:
    return json.dumps(obj, separators=(",", ":"), sort_keys=True).encode()


def _int(obj: dict, key: str, lo: int = 0) -> int:
    v = obj.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or v < lo:
        raise ValueError(f"manifest field {key!r} must be an integer >= {lo}, got {v!r}")
    return v


def _parse(obj: object) -> Manifest:
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        raise ValueError(f"not a refit manifest: expected format {FORMAT!r}")
    capacity, alignment = _int(obj, "capacity", 1), _int(obj, "alignment", 1)
    if capacity > MAX_BYTES or alignment > capacity:
        raise ValueError(f"manifest capacity {capacity} or alignment {alignment} is out of range")
    tensors, sizes = obj.get("tensors"), obj.get("bucket_nbytes")
    if not isinstance(tensors, list) or len(tensors) > MAX_TENSORS:
        raise ValueError(f"manifest 'tensors' must be a list of at most {MAX_TENSORS} entries")
    if not isinstance(sizes, list) or len(sizes) > MAX_BUCKETS or not all(_is_int(n, 0, capacity) for n in sizes):
        raise ValueError(
            f"manifest 'bucket_nbytes' must be a list of at most {MAX_BUCKETS} integers in [0, {capacity}]"
        )
    entries = tuple(_parse_entry(t) for t in tensors)
    for a, b in zip(entries, entries[1:]):
        if a.name >= b.name:
            raise ValueError(f"manifest tensors must be sorted by name without repeats ({a.name!r} before {b.name!r})")
    m = Manifest(capacity, alignment, entries, tuple(sizes), epoch=_int(obj, "epoch"))
    spans = 0
    for p in m.entries:
        last = p.bucket + (p.offset + max(p.nbytes, 1) - 1) // capacity
        if p.offset % alignment or p.offset >= capacity or last >= m.num_buckets:
            raise ValueError(f"manifest places {p.name!r} outside its buckets")
        spans += last - p.bucket + 1
    if spans > len(m.entries) + m.num_buckets:  # non-overlapping ranges cannot span more; bounds the work below
        raise ValueError("manifest tensors overlap: they span more bucket ranges than the buckets hold")
    _check_segments(m)
    return m


def _check_segments(m: Manifest) -> None:
    """Every byte range lies inside its bucket's used bytes, and no two ranges overlap."""
    for b, segs in enumerate(m.segments):
        end = 0
        for s in sorted(segs, key=lambda s: s.at):
            if s.at < end:
                raise ValueError(f"manifest tensors {m.entries[s.entry].name!r} and another overlap in bucket {b}")
            end = s.at + s.hi - s.lo
            if end > m.bucket_nbytes[b]:
                raise ValueError(
                    f"manifest places {m.entries[s.entry].name!r} past the {m.bucket_nbytes[b]} "
                    f"bytes bucket {b} carries"
                )


def _is_int(v: object, lo: int, hi: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


def _ints(values: list) -> bool:
    """Every value a plain int in [0, MAX_BYTES] (bools excluded); one pass in C for the common case."""
    if not values:
        return True
    return set(map(type, values)) == {int} and min(values) >= 0 and max(values) <= MAX_BYTES


def _name(v: object) -> str:
    if type(v) is not str or not 0 < len(v) <= MAX_NAME_CHARS:
        raise ValueError(f"manifest tensor names must be non-empty strings of at most {MAX_NAME_CHARS} characters")
    return v


def _parse_entry(t: object) -> Placement:
    if not (type(t) is list and len(t) in (6, 7)):
        raise ValueError(
            f"manifest tensor entry must be [name, shape, dtype, bucket, offset, nbytes(, aliases)], got {t!r:.200}"
        )
    name, shape, dtype, bucket, offset, nbytes = t[:6]
    name = _name(name)
    aliases: tuple[str, ...] = ()
    if len(t) == 7:
        raw = t[6]
        if not (type(raw) is list and 0 < len(raw) <= MAX_ALIASES):
            raise ValueError(f"manifest aliases of {name!r} must be a non-empty list of at most {MAX_ALIASES} names")
        aliases = tuple(_name(a) for a in raw)
        if list(aliases) != sorted(set(aliases)) or name in aliases:
            raise ValueError(f"manifest aliases of {name!r} must be sorted, distinct and differ from the name")
    if not (type(shape) is list and len(shape) <= MAX_DIMS and _ints(shape)):
        raise ValueError(f"manifest shape of {name!r} must be a list of at most {MAX_DIMS} integers >= 0")
    if not (
        type(bucket) is int
        and type(offset) is int
        and type(nbytes) is int
        and 0 <= bucket <= MAX_BYTES
        and 0 <= offset <= MAX_BYTES
        and 0 <= nbytes <= MAX_BYTES
    ):
        raise ValueError(f"manifest bucket/offset/nbytes of {name!r} must be integers in [0, {MAX_BYTES}]")
    if type(dtype) is not str:
        raise ValueError(f"manifest dtype of {name!r} must be a string")
    spec = TensorSpec(name, tuple(shape), dtype_from_name(dtype), aliases)
    if spec.nbytes != nbytes:
        raise ValueError(f"manifest nbytes of {name!r} is {nbytes}, but shape and dtype give {spec.nbytes}")
    return Placement(spec, bucket, offset)
