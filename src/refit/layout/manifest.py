"""Manifest: the refit info prepared once per epoch (tensor placements in buckets), its digest and JSON form."""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import math
import operator
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cached_property, partial
from itertools import chain, count, islice, repeat
from typing import NamedTuple

from refit.dtypes import DTYPES, dtype_from_name
from refit.layout.spec import TensorSpec

FORMAT = "refit.manifest/1"
MAX_TENSORS = 1_000_000
MAX_NAME_CHARS = 1024
MAX_DIMS = 16
MAX_BUCKETS = 1 << 24
MAX_ALIASES = 64
MAX_BYTES = 1 << 56
"""Largest capacity, tensor or offset accepted from a peer (64 PiB): keeps every sum far from overflow."""
MAX_STAGES = 16
_STAGE = re.compile(r"[a-z][a-z0-9_-]{0,31}")
"""A stage name, as refit.stages.register accepts it."""


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """No garbage collection while a manifest's 100k small objects are made or parsed in one go (none of
    them in cycles): collections triggered mid-way would walk every live object, for nothing."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


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


_PLACEMENT = partial(tuple.__new__, Placement)
"""Placement(*fields) from a tuple of fields without a Python call per entry."""
_WIRE = DTYPES
_DTYPE_NAMES = {d: n for n, d in DTYPES.items()}
_SPEC, _BUCKET, _OFFSET = (operator.itemgetter(i) for i in range(3))
_NAME, _ALIASES = operator.attrgetter("spec.name"), operator.attrgetter("spec.aliases")
_SHAPE, _DTYPE, _NBYTES = operator.attrgetter("shape"), operator.attrgetter("dtype"), operator.attrgetter("nbytes")
_ITEMSIZE = {d: d.itemsize for d in DTYPES.values()}


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
    stages: tuple[str, ...] = ()
    """The stages (refit.stages) every refit of this epoch passes through, in the trainer's order."""
    _index: dict[str, int] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        entries = self.entries
        if any(map(_ALIASES, entries)):
            self._index.update((n, i) for i, p in enumerate(entries) for n in p.spec.names)
            total = sum(len(p.spec.names) for p in entries)
        else:  # the usual case: one name per entry, indexed in one C pass
            self._index.update(zip(map(_NAME, entries), count()))
            total = len(entries)
        if len(self._index) != total:
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
    def specs(self) -> list[TensorSpec]:
        """One alias-free spec per name the receivers load (what an engine validates against)."""
        if not any(map(_ALIASES, self.entries)):
            return list(map(_SPEC, self.entries))
        return [x for p in self.entries for x in p.spec.expanded()]

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
            "tensors": _rows(self.entries),
        } | ({"stages": list(self.stages)} if self.stages else {})

    @cached_property
    def _canonical_json(self) -> bytes:
        with gc_paused():
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
        with gc_paused():
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


def _rows(entries: tuple[Placement, ...]) -> list[list]:
    """Every entry as its JSON row, column by column (rows with aliases get them appended)."""
    specs = list(map(_SPEC, entries))
    rows = list(
        map(
            list,
            zip(
                map(_NAME, entries),
                map(list, map(_SHAPE, specs)),
                map(_DTYPE_NAMES.__getitem__, map(_DTYPE, specs)),
                map(_BUCKET, entries),
                map(_OFFSET, entries),
                map(_NBYTES, specs),
            ),
        )
    )
    for row, spec in zip(rows, specs):
        if spec.aliases:
            row.append(list(spec.aliases))
    return rows


def _dumps(obj: dict) -> bytes:
    return json.dumps(obj, separators=(",", ":"), sort_keys=True).encode()


def _int(obj: dict, key: str, lo: int = 0) -> int:
    v = obj.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or v < lo:
        raise ValueError(f"manifest field {key!r} must be an integer >= {lo}, got {v!r}")
    return v


def _stages(obj: dict) -> tuple[str, ...]:
    stages = obj.get("stages", [])
    if not (
        isinstance(stages, list)
        and len(stages) <= MAX_STAGES
        and all(isinstance(n, str) and _STAGE.fullmatch(n) for n in stages)
        and len(set(stages)) == len(stages)
    ):
        raise ValueError(f"manifest 'stages' must be a list of at most {MAX_STAGES} distinct stage names")
    return tuple(stages)


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
    entries = _parse_columns(tensors)
    if entries is None:  # something unusual (aliases, a bad field): entry by entry, naming what is wrong
        entries = tuple(_parse_entry(t) for t in tensors)
    names = [p.spec.name for p in entries]
    if not all(map(operator.lt, names, islice(names, 1, None))):
        a, b = next((a, b) for a, b in zip(names, names[1:]) if a >= b)
        raise ValueError(f"manifest tensors must be sorted by name without repeats ({a!r} before {b!r})")
    m = Manifest(capacity, alignment, entries, tuple(sizes), epoch=_int(obj, "epoch"), stages=_stages(obj))
    if _packed_in_order(m):
        return m
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


def _packed_in_order(m: Manifest) -> bool:
    """The layout a planner emits, checked in a few C passes: every tensor inside one bucket at an aligned
    offset, within the bytes that bucket moves, each one starting at or after the end of the one before.
    False sends the manifest through the general checks (which accept any other valid layout)."""
    entries, cap, sizes = m.entries, m.capacity, m.bucket_nbytes
    if not entries:
        return True
    buckets, offsets = [p.bucket for p in entries], [p.offset for p in entries]
    nbytes = [p.spec.nbytes for p in entries]
    ends = list(map(operator.add, offsets, nbytes))
    if max(buckets) >= len(sizes) or max(offsets) >= cap or any(map(operator.mod, offsets, repeat(m.alignment))):
        return False
    if not all(map(operator.le, ends, map(sizes.__getitem__, buckets))):
        return False
    starts = list(map(operator.add, map(operator.mul, buckets, repeat(cap)), offsets))
    stops = map(operator.add, map(operator.mul, buckets, repeat(cap)), ends)
    return all(map(operator.le, stops, islice(starts, 1, None)))


def _parse_columns(rows: list) -> tuple[Placement, ...] | None:
    """Every row parsed column by column in a few C passes when all are plain 6-field entries with valid
    fields; None when any is not (the caller then parses row by row, which names the first fault)."""
    if not rows:
        return ()
    if set(map(type, rows)) != {list} or set(map(len, rows)) != {6}:
        return None
    names, shapes, dtypes, buckets, offsets, nbytes = map(list, zip(*rows))
    if set(map(type, names)) != {str} or not 0 < min(map(len, names)) <= max(map(len, names)) <= MAX_NAME_CHARS:
        return None
    if set(map(type, shapes)) != {list} or max(map(len, shapes)) > MAX_DIMS or not _ints(list(chain(*shapes))):
        return None
    if set(map(type, dtypes)) != {str} or not set(dtypes) <= _WIRE.keys():
        return None
    if not (_ints(buckets) and _ints(offsets) and _ints(nbytes)):
        return None
    wire = list(map(_WIRE.__getitem__, dtypes))
    shapes = list(map(tuple, shapes))
    sizes = map(operator.mul, map(math.prod, shapes), map(_ITEMSIZE.__getitem__, wire))
    if not all(map(operator.eq, sizes, nbytes)):
        return None
    specs = map(TensorSpec.checked, names, shapes, wire, nbytes)
    return tuple(map(_PLACEMENT, zip(specs, buckets, offsets)))


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
