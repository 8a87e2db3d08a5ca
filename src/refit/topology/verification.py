"""Digests: the end-to-end check that the engine holds what the trainer holds (`verify="fingerprint"`).

The sender digests each live source tensor after the wire cast, in the same pass that packs it (so a
gathered tensor is read once). Each receiver, after its last load, digests what its engine now
holds under every name (read back through `Engine.held`, in the wire dtype) and compares. A receiver
that holds a shard of a tensor (tensor parallelism) names the region at the handshake, and the
sender digests that region of its live tensor.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

import torch

from refit.checks.digest import Pending
from refit.checks.validation import waived
from refit.engines.base import Engine, Region
from refit.errors import PeerError
from refit.layout.manifest import Manifest
from refit.sources.base import Source

Target = tuple[str, Region | None]
_MASK = (1 << 64) - 1


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
    (`reset` before each refit)."""

    def __init__(self, m: Manifest, regions: Sequence[dict[str, Region]]) -> None:
        self.manifest = m
        self.regions = list(regions)
        self._pending = Pending()
        self._keys: list[Target] = []
        self._known: list[tuple[list[Target], torch.Tensor]] = []
        self._by_bucket: dict[int, list[tuple[int, list[Target], torch.dtype]]] = {}
        self._packed: dict[int, tuple[list[Target], torch.Tensor]] = {}
        """Per bucket: the targets whose digest is their whole segment's, as packed, and those segments."""
        for b, segs in enumerate(m.segments):
            packed: list[tuple[Target, int]] = []
            for k, s in enumerate(segs):
                if m.last_bucket[s.entry] != b:
                    continue
                spec = m.entries[s.entry].spec
                targets = list(dict.fromkeys((n, r.get(n)) for n in spec.names for r in self.regions or [{}]))
                whole = s.lo == 0 and s.hi == spec.nbytes
                rest = [t for t in targets if not (whole and t[1] is None)]
                packed.extend((t, k) for t in targets if whole and t[1] is None)
                if rest:
                    self._by_bucket.setdefault(b, []).append((k, rest, spec.dtype))
            if packed:
                self._packed[b] = ([t for t, _ in packed], torch.tensor([k for _, k in packed], dtype=torch.int64))

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
        if packed is None:
            plans = [*self._by_bucket.get(bucket, []), *self._whole(bucket).get(bucket, [])]
            self._digest([(t, tensors[k], wire) for k, ts, wire in plans for t in ts])  # type: ignore[index]
            return
        if bucket in self._packed:
            targets, index = self._packed[bucket]
            if index.device != packed.device:
                index = index.to(packed.device)
                self._packed[bucket] = (targets, index)
            self._known.append((targets, packed[index]))  # read back at `payloads`: no synchronisation here
        rest = self._by_bucket.get(bucket, [])
        if rest:
            self._digest([(target, tensors[k], wire) for k, targets, wire in rest for target in targets])  # type: ignore[index]

    def _whole(self, bucket: int) -> dict[int, list[tuple[int, list[Target], torch.dtype]]]:
        """The packed targets of `bucket` in `_by_bucket`'s form (when packing took no digests)."""
        if bucket not in self._packed:
            return {}
        targets, index = self._packed[bucket]
        m, segs = self.manifest, self.manifest.segments[bucket]
        return {bucket: [(k, [t], m.entries[segs[k].entry].spec.dtype) for t, k in zip(targets, index.cpu().tolist())]}

    def take_all(self, source: Source) -> None:
        """Digest every tensor now (zero-copy mode, where nothing was packed)."""
        m = self.manifest
        live = dict(zip((p.name for p in m.entries), source.tensors([p.name for p in m.entries])))
        whole = [self._whole(b).get(b, []) for b in self._packed]
        targets = [(t, wire) for b in [*self._by_bucket.values(), *whole] for _, ts, wire in b for t in ts]
        self._digest([(target, live[m.entry(target[0]).name], wire) for target, wire in targets])

    def _digest(self, items: list[tuple[Target, torch.Tensor, torch.dtype]]) -> None:
        """Digest each target's region of its live tensor, cast to the wire dtype (no synchronisation)."""
        with torch.no_grad():
            views = [_cut(t, region).to(wire) for (_, region), t, wire in items]
            self._pending.add(views)
        self._keys.extend(target for target, _, _ in items)

    def payloads(self) -> list[list[str]]:
        """Per receiver, the hex digest of every name it loads, in `Manifest.names` order."""
        done = dict(zip(self._keys, self._pending.hexes()))
        for targets, values in self._known:
            done.update((k, f"{v & _MASK:016x}") for k, v in zip(targets, values.tolist()))
        names = self.manifest.names
        return [[done[(n, r.get(n))] for n in names] for r in self.regions or [{}]]


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
    m: Manifest, engine: Engine, digests: object, *, loaded: Mapping[str, int] | None = None
) -> tuple[list[str], list[str]]:
    """(names whose engine tensor differs from the trainer's, names the engine loads but cannot read back).
    Names the user waived (`ignore=`, never loaded) are in neither list: validation reported them.
    `loaded`: digests the engine's own copy took of what it now holds (`Engine.load_digested`), compared
    as they are; every other name is read back and digested here."""
    names = m.names
    if not (isinstance(digests, list) and len(digests) == len(names) and all(isinstance(d, str) for d in digests)):
        raise PeerError(f"VERIFY must list one digest per name ({len(names)})")
    held, wanted, unreadable, differ = [], [], [], []
    loaded = loaded or {}
    for name, want in zip(names, digests):
        got_loaded = loaded.get(name)
        if got_loaded is not None:
            if f"{got_loaded & _MASK:016x}" != want:
                differ.append(name)
            continue
        if engine.optional_names and waived(name, engine.optional_names):
            continue
        got = engine.held(name)
        if got is None:
            unreadable.append(name)
            continue
        held.append((name, got[0], m.entry(name).spec.dtype))
        wanted.append(want)
    pending = Pending()
    with torch.no_grad():
        for group in _groups(held):  # casts of a bounded number of bytes alive at once
            pending.add([t.to(wire) for _, t, wire in group])
        lossy = {name for name, t, wire in held if t.dtype != wire and not _exact(t, wire)}
    got_hex = pending.hexes()
    bad = sorted({name for (name, _, _), g, w in zip(held, got_hex, wanted) if g != w} | lossy | set(differ))
    return bad, unreadable


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
