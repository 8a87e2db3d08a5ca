"""Digests: the end-to-end check that the engine holds what the trainer holds (`verify="fingerprint"`, the default).

The sender digests each tensor's wire bytes as it packs them into the bucket (`refit.checks.copy_digest`: the
copy and the digest are one pass); a region, or a tensor split across buckets, is digested from the live
tensor after the wire cast. Each receiver's engine digests what its copy writes where it can prove that
copy is the only write to those bytes (`Engine.load_digested`); every other name is read back after the
last load (`Engine.held`, in the wire dtype) and digested. A receiver that holds a shard of a tensor
(tensor parallelism) names the region at the handshake, and the sender digests that region of its live
tensor. Per refit, digests sit in one int64 vector: no per-name Python beyond what a region needs.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator, Mapping, Sequence

import torch

from refit.checks.manifest_check import waived
from refit.checks.tensor_digest import Pending
from refit.engines.base import Engine, Region
from refit.errors import PeerError
from refit.layout.manifest import Manifest
from refit.sources.base import Source

Target = tuple[str, Region | None]


def parse_regions(raw: object, m: Manifest) -> dict[str, Region]:
    """The shards a receiver holds, as sent in its REPORT, checked against the manifest's shapes."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise PeerError("REPORT 'regions' must be an object of name: [dim, start, stop]")
    names = set(m.names)
    out: dict[str, Region] = {}
    for name, r in raw.items():
        ok = isinstance(r, list) and len(r) == 3 and all(isinstance(v, int) and not isinstance(v, bool) for v in r)
        shape = m.entry(name).spec.shape if ok and name in names else ()
        if not (ok and 0 <= r[0] < len(shape) and 0 <= r[1] <= r[2] <= shape[r[0]]):
            raise PeerError(f"REPORT names an impossible region {r!r} of {name!r}")
        out[name] = (r[0], r[1], r[2])
    return out


class DigestPlan:
    """The sender's digests: which (name, region) to digest in which bucket, planned once per epoch (it
    depends on the manifest and the receivers' regions only, never on tensors), and one refit's results
    (`reset` before each refit). Each target has a slot in one int64 vector of results; per refit the
    packed digests land there by one indexed copy per bucket, and each receiver's payload is one gather."""

    def __init__(self, m: Manifest, regions: Mapping[int, dict[str, Region]]) -> None:
        """`regions`: per receiver, by its session rank (never by its place in a list, which a departure
        shifts), the regions it named at its handshake."""
        self.manifest = m
        self.regions = dict(regions)
        self._pending = Pending()
        self._keys: list[Target] = []
        self._known: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._slot: dict[Target, int] = {}
        self._by_bucket: dict[int, list[tuple[int, list[Target], torch.dtype]]] = {}
        self._whole: dict[int, list[tuple[int, list[Target], torch.dtype]]] = {}
        self._packed: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        """Per bucket: the slots of targets whose digest is their whole segment's as packed, and those segments."""
        for b, segs in enumerate(m.segments):
            slots, index = [], []
            for k, s in enumerate(segs):
                if m.last_bucket[s.entry] != b:
                    continue
                spec = m.entries[s.entry].spec
                every = list(self.regions.values()) or [{}]
                targets = list(dict.fromkeys((n, r.get(n)) for n in spec.names for r in every))
                base = len(self._slot)
                self._slot.update((t, base + i) for i, t in enumerate(targets))
                whole = s.lo == 0 and s.hi == spec.nbytes
                packed = [t for t in targets if whole and t[1] is None]
                rest = [t for t in targets if not (whole and t[1] is None)]
                slots.extend(self._slot[t] for t in packed)
                index.extend(k for _ in packed)
                if packed:
                    self._whole.setdefault(b, []).append((k, packed, spec.dtype))
                if rest:
                    self._by_bucket.setdefault(b, []).append((k, rest, spec.dtype))
            if slots:
                self._packed[b] = (torch.tensor(slots, dtype=torch.int64), torch.tensor(index, dtype=torch.int64))
        names = m.names
        self._orders = {
            rank: torch.tensor([self._slot[(n, r.get(n))] for n in names], dtype=torch.int64)
            for rank, r in self.regions.items()
        }

    def reset(self) -> None:
        """Forget the last refit's digests (the plan itself stays: it holds no tensor)."""
        self._pending = Pending()
        self._keys = []
        self._known = []

    def needs_tensors(self, bucket: int) -> bool:
        """Whether `take` of `bucket` reads live tensors (a region or a split tensor), beyond the packed digests."""
        return bucket in self._by_bucket

    def take(self, bucket: int, tensors: Sequence[torch.Tensor] | None, packed: torch.Tensor | None) -> None:
        """The digests of the tensors whose last bytes are in `bucket`: a whole tensor sent whole is its
        segment's digest, taken while packing (`packed`, one per segment, the wire bytes as written);
        regions and split tensors are digested from `tensors` (as packed, one per segment)."""
        rest = self._by_bucket.get(bucket, [])
        if packed is None:
            rest = [*rest, *self._whole.get(bucket, [])]
        elif bucket in self._packed:
            slots, index = self._packed[bucket]
            if index.device != packed.device:
                index = index.to(packed.device)
                self._packed[bucket] = (slots, index)
            self._known.append((slots, packed[index]))  # read back at `payloads`: no synchronisation here
        if rest:
            self._digest([(target, tensors[k], wire) for k, targets, wire in rest for target in targets])  # type: ignore[index]

    def take_all(self, source: Source) -> None:
        """Digest every tensor now (zero-copy mode, where nothing was packed)."""
        m = self.manifest
        live = dict(zip((p.name for p in m.entries), source.tensors([p.name for p in m.entries])))
        plans = [*self._by_bucket.values(), *self._whole.values()]
        targets = [(t, wire) for b in plans for _, ts, wire in b for t in ts]
        self._digest([(target, live[m.entry(target[0]).name], wire) for target, wire in targets])

    def _digest(self, items: list[tuple[Target, torch.Tensor, torch.dtype]]) -> None:
        """Digest each target's region of its live tensor, cast to the wire dtype (no synchronisation)."""
        with torch.no_grad():
            views = [_cut(t, region).to(wire) for (_, region), t, wire in items]
            self._pending.add(views)
        self._keys.extend(target for target, _, _ in items)

    def forget(self, rank: int) -> None:
        """Receiver `rank` left: no payload for it (the others' are unchanged)."""
        self.regions.pop(rank, None)
        self._orders.pop(rank, None)

    def payloads(self) -> dict[int, list[str]]:
        """Per receiver rank, the hex digest of every name it loads, in `Manifest.names` order."""
        values = torch.zeros(len(self._slot), dtype=torch.int64)
        for slots, got in self._known:
            values[slots] = got.cpu()
        if self._keys:
            late = [int(h, 16) for h in self._pending.hexes()]
            values[[self._slot[k] for k in self._keys]] = torch.tensor([v - (v >> 63 << 64) for v in late])
        return {rank: to_hex(values[order]) for rank, order in self._orders.items()}


def to_hex(values: torch.Tensor) -> list[str]:
    """Each int64 as the 16 hex digits of its 64 bits (big-endian), for many at once."""
    if not values.numel():
        return []
    raw = values.contiguous().view(torch.uint8).view(-1, 8).flip(1).contiguous()  # little-endian words
    text = ctypes.string_at(raw.data_ptr(), raw.numel()).hex()
    return [text[i : i + 16] for i in range(0, len(text), 16)]


def from_hex(digests: list[str]) -> torch.Tensor | None:
    """`to_hex` undone, as int64; None unless every item is 16 hex digits."""
    if not digests:
        return torch.zeros(0, dtype=torch.int64)
    if set(map(type, digests)) != {str} or set(map(len, digests)) != {16}:
        return None
    try:
        raw = bytearray(bytes.fromhex("".join(digests)))
    except ValueError:
        return None
    return torch.frombuffer(raw, dtype=torch.uint8).view(-1, 8).flip(1).contiguous().view(torch.int64).view(-1)


def _cut(t: torch.Tensor, region: Region | None) -> torch.Tensor:
    return t if region is None else t.narrow(region[0], region[1], region[2] - region[1])


def engine_regions(m: Manifest, engine: Engine) -> dict[str, list[int]]:
    """The receiver's REPORT part: the regions its engine holds, for names held as shards."""
    out = {}
    for name in m.names:
        held = engine.held(name)
        if held is not None and held[1] is not None:
            out[name] = list(held[1])
    return out


def compare(
    m: Manifest,
    engine: Engine,
    digests: object,
    *,
    loaded: Sequence[tuple[torch.Tensor, torch.Tensor]] = (),
) -> tuple[list[str], list[str]]:
    """(names whose engine tensor differs from the trainer's, names the engine loads but cannot read back).
    Names the user waived (`ignore=`, never loaded) are in neither list: validation reported them.
    `loaded`: (positions in `m.names`, digests) the engine's own copies took of what it now holds
    (`Engine.load_digested`), compared all at once; every other name is read back and digested here."""
    names = m.names
    want = from_hex(digests) if isinstance(digests, list) else None
    if want is None or len(want) != len(names):
        raise PeerError(f"VERIFY must list one digest (16 hex digits) per name ({len(names)})")
    covered = torch.zeros(len(names), dtype=torch.bool)
    differ: list[int] = []
    for where, got in loaded:
        covered[where] = True
        differ.extend(where[want[where] != got.cpu()].tolist())
    held, wanted, unreadable = [], [], []
    rest = range(len(names)) if not loaded else torch.nonzero(~covered).view(-1).tolist()
    for i in rest:
        name = names[i]
        if engine.optional_names and waived(name, engine.optional_names):
            continue
        got = engine.held(name)
        if got is None:
            unreadable.append(name)
            continue
        held.append((name, got[0], m.entry(name).spec.dtype))
        wanted.append(digests[i])  # type: ignore[index]
    pending = Pending()
    with torch.no_grad():
        for group in _groups(held):  # casts of a bounded number of bytes alive at once
            pending.add([t.to(wire) for _, t, wire in group])
        lossy = {name for name, t, wire in held if t.dtype != wire and not _exact(t, wire)}
    got_hex = pending.hexes()
    bad = {name for (name, _, _), g, w in zip(held, got_hex, wanted) if g != w.lower()}
    return sorted(bad | lossy | {names[i] for i in differ}), unreadable


def _groups(held: list[tuple[str, torch.Tensor, torch.dtype]], limit: int = 256 << 20) -> Iterator[list]:
    """Runs of `held` whose casts to the wire dtype take at most about `limit` bytes at once. A tensor already
    in its wire dtype is digested as it is (no copy), so it counts for nothing: without casts, one run."""
    group, size = [], 0
    for item in held:
        group.append(item)
        size += item[1].numel() * item[2].itemsize if item[1].dtype != item[2] else 0
        if size >= limit:
            yield group
            group, size = [], 0
    if group:
        yield group


def _exact(t: torch.Tensor, wire: torch.dtype) -> bool:
    """The engine's wider tensor holds only values the wire dtype has (else it holds something not sent)."""
    return torch.equal(t.to(wire).to(t.dtype).view(-1).view(torch.uint8), t.contiguous().view(-1).view(torch.uint8))
