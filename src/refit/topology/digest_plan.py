"""Digests: the end-to-end check that the engine holds what the trainer holds (`verify="fingerprint"`, the default).

The sender digests each tensor's wire bytes as it packs them into the bucket (`refit.checks.copy_digest`: the
copy and the digest are one pass); a region, or a tensor split across buckets, is digested from the live
tensor after the wire cast. Each receiver's engine digests what its copy writes where it can prove that
copy is the only write to those bytes (`Engine.load_digested`); every other name is read back after the
last load (`Engine.held`, in the wire dtype) and digested. A receiver that holds a shard of a tensor
(tensor parallelism) names the region at the handshake, and the sender digests that region of its live
tensor. Per refit, digests sit in one int64 vector: no per-name Python beyond what a region needs.

That vector is moved with index_select, index_copy_ and masked_select, never `t[idx]`, `t[idx] = v` or `t[mask]`:
those enter an OpenMP parallel region from a few thousand elements on, whose idle threads then spin, and with the
sender and a receiver on one host each one's spinning pool takes the cores the other's refit runs on
(BENCHMARKS.md: 10,000 small tensors, 54 ms a verified refit against 15 ms with OMP_WAIT_POLICY=PASSIVE).
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence

import torch

from refit.checks.copy_digest import prepared_digests
from refit.checks.manifest_check import waived
from refit.checks.tensor_digest import Pending, prepared
from refit.engines.base import Engine, Region
from refit.errors import IntegrityError, PeerError
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
        self._key_slots: torch.Tensor | None = None
        """The slots of `_keys`, when they are the zero-copy views' (held with them in `_all`)."""
        self._all: tuple[int, list[torch.Tensor], list[Target], torch.Tensor, Callable | None] | None = None
        """Zero-copy: (generation, every target's view of its live tensor, the targets, their slots, and on CUDA
        their digest planned once)."""
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
        self._key_slots = None
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
            self._known.append((slots, packed.index_select(0, index)))  # read back at `payloads`: no synchronisation
        if rest:
            self._digest([(target, tensors[k], wire) for k, targets, wire in rest for target in targets])  # type: ignore[index]

    def take_all(self, source: Source, generation: int) -> None:
        """Digest every tensor now (zero-copy mode, where nothing was packed). The targets' views are kept while
        `generation` (the session's layout guard: it moves whenever a tensor may have been replaced, moved,
        reshaped or recast) stays, when every view is the live tensor's own memory (no cast)."""
        held = self._all
        if held is None or held[0] != generation:
            m = self.manifest
            live = dict(zip((p.name for p in m.entries), source.tensors([p.name for p in m.entries])))
            plans = [*self._by_bucket.values(), *self._whole.values()]
            targets = [(t, wire) for b in plans for _, ts, wire in b for t in ts]
            items = [(target, live[m.entry(target[0]).name], wire) for target, wire in targets]
            with torch.no_grad():
                views = [_cut(t, region).to(wire) for (_, region), t, wire in items]
            keys = [target for target, _, _ in items]
            aliases = all(
                v.untyped_storage().data_ptr() == t.untyped_storage().data_ptr() for v, (_, t, _) in zip(views, items)
            )
            slots = torch.tensor([self._slot[k] for k in keys], dtype=torch.int64)
            held = (generation, views, keys, slots, _planned(views) if aliases else None)
            self._all = held if aliases else None
        if held[4] is not None:
            self._pending.add_digests(held[4]())
        else:
            self._pending.add(held[1])
        self._keys, self._key_slots = held[2], held[3]

    def _digest(self, items: list[tuple[Target, torch.Tensor, torch.dtype]]) -> None:
        """Digest each target's region of its live tensor, cast to the wire dtype (no synchronisation)."""
        with torch.no_grad():
            views = [_cut(t, region).to(wire) for (_, region), t, wire in items]
            _add(self._pending, views)
        self._keys = [*self._keys, *(target for target, _, _ in items)]
        self._key_slots = None

    def forget(self, rank: int) -> None:
        """Receiver `rank` left: no payload for it (the others' are unchanged)."""
        self.regions.pop(rank, None)
        self._orders.pop(rank, None)

    def payloads(self) -> dict[int, list[str]]:
        """Per receiver rank, the hex digest of every name it loads, in `Manifest.names` order."""
        values = torch.zeros(len(self._slot), dtype=torch.int64)
        for slots, got in self._known:
            values.index_copy_(0, slots, got.cpu())
        if self._keys:
            slots = self._key_slots
            if slots is None:
                slots = torch.tensor([self._slot[k] for k in self._keys], dtype=torch.int64)
            values.index_copy_(0, slots, self._pending.values())
        return {rank: to_hex(values.index_select(0, order)) for rank, order in self._orders.items()}


def to_hex(values: torch.Tensor) -> list[str]:
    """Each int64 as the 16 hex digits of its 64 bits (big-endian), for many at once."""
    if not values.numel():
        return []
    raw = _byteswap(values.contiguous().view(-1))
    text = ctypes.string_at(raw.data_ptr(), raw.numel() * 8).hex()
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
    if len(raw) != 8 * len(digests):  # fromhex skips whitespace: a digest holding some is not 16 hex digits
        return None
    return _byteswap(torch.frombuffer(raw, dtype=torch.int64))


def _byteswap(words: torch.Tensor) -> torch.Tensor:
    """Each int64's bytes in the other order, on whole words: a flip of the (n, 8) bytes is one op over 8n
    elements, which from a few thousand words on runs on torch's whole thread pool and costs milliseconds."""
    out = torch.zeros_like(words)
    for k in range(8):
        byte = (words >> (8 * k)) & 0xFF
        out |= byte << (8 * (7 - k))
    return out


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
        raise IntegrityError(f"VERIFY must list one digest (16 hex digits) per name ({len(names)})")
    covered = torch.zeros(len(names), dtype=torch.bool)
    differ: list[int] = []
    for where, got in loaded:
        covered.index_fill_(0, where, True)
        differ.extend(torch.masked_select(where, want.index_select(0, where) != got.cpu()).tolist())
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
            _add(pending, [t.to(wire) for _, t, wire in group])
        lossy = {name for name, t, wire in held if t.dtype != wire and not _exact(t, wire)}
    got_hex = pending.hexes()
    bad = {name for (name, _, _), g, w in zip(held, got_hex, wanted) if g != w.lower()}
    return sorted(bad | lossy | {names[i] for i in differ}), unreadable


def _planned(views: list[torch.Tensor]) -> Callable[[], torch.Tensor] | None:
    """The digests of `views` planned once: the CUDA kernel's table, or on CPU the fused kernel's (else None)."""
    if views and all(t.device.type == "cpu" for t in views):
        return prepared_digests(views)
    return prepared(views)


def _add(pending: Pending, tensors: list[torch.Tensor]) -> None:
    """Digest `tensors` into `pending`: on CPU by the fused kernel reading each once (no copy), else by torch."""
    run = prepared_digests(tensors) if tensors and all(t.device.type == "cpu" for t in tensors) else None
    if run is not None:
        pending.add_digests(run())
    else:
        pending.add(tensors)


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


_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _exact(t: torch.Tensor, wire: torch.dtype) -> bool:
    """The engine's wider tensor holds only values the wire dtype has (else it holds something not sent);
    compared as whole elements, bit for bit (bytes one at a time take twice as long)."""
    if t.dtype == torch.float32 and wire == torch.bfloat16 and sys.byteorder == "little":
        # bf16 is fp32's upper half: a float32 is a bfloat16 exactly when its lower 16 bits are zero
        return not bool(t.contiguous().view(-1).view(torch.int16)[0::2].any())
    word = _WORDS.get(t.element_size(), torch.uint8)
    return torch.equal(t.to(wire).to(t.dtype).reshape(-1).view(word), t.contiguous().reshape(-1).view(word))
