"""Repair: a receiver whose fingerprint check names a few tensors wrong fetches just those again, in the same refit.

After COMMIT, instead of DONE with status 1, such a receiver answers DONE with status `ASK` and
`{"repair": [names]}`. The sender answers REPAIR: its live tensors of those names in their wire dtypes, as a
JSON index and the bytes after it (`pack`). The receiver loads them, digests what its engine now holds for
those names against the fingerprints of this refit's VERIFY, and goes on to commit (its engine's commit, the
pre-commit checks, DONE) as if nothing had been wrong; if anything fails (a name it did not ask for, sizes that do not
fit, a digest that still differs), the version fails as without repair. Only an engine that asks for it
(`ModuleEngine(..., repair=True)`) repairs. One repair per refit, only of whole
tensors sent without stages and held whole; at most `MAX_REPAIR_FRACTION` of the model's
bytes, else the version fails and a retry resends everything.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from typing import Any

import torch

from refit.checks.root import held_leaves, verified_root
from refit.engines.base import Engine
from refit.errors import IntegrityError, RefitError
from refit.layout.manifest import Manifest
from refit.protocol.wire import MAX_JSON_BYTES, Channel, Header, Kind, parse_json
from refit.sources.base import Source
from refit.topology.stats import RefitStats

ASK = 2
"""DONE's status asking for a repair."""
MAX_REPAIR_FRACTION = 0.25
"""Most of the model's bytes one repair moves (beyond it, resending the version costs about the same)."""
MAX_NAMES = 1024
_LEN = struct.Struct("<Q")


def budget(m: Manifest) -> int:
    return min(int(m.nbytes * MAX_REPAIR_FRACTION), MAX_JSON_BYTES - (1 << 20))


def _nbytes(m: Manifest, name: str) -> int:
    spec = m.entry(name).spec
    return spec.nbytes


def wanted(m: Manifest, engine: Engine, bad: Sequence[str], *, stages: bool) -> list[str] | None:
    """The names a receiver asks again, or None where repair cannot help (stages, shards, too many bytes) or its
    engine did not ask for it (`ModuleEngine(..., repair=True)`)."""
    if (
        not getattr(engine, "repair", False)
        or stages
        or not bad
        or len(bad) > MAX_NAMES
        or not set(bad) <= set(m.names)
    ):
        return None
    held = [engine.held(n) for n in bad]
    if any(h is None or h[1] is not None for h in held):
        return None
    return list(bad) if sum(_nbytes(m, n) for n in bad) <= budget(m) else None


def parse_request(payload: bytes, m: Manifest) -> list[str]:
    """The sender's check of DONE's repair request: IntegrityError for anything but known names within budget."""
    names = parse_json(payload, "DONE").get("repair")
    ok = isinstance(names, list) and 0 < len(names) <= MAX_NAMES and all(isinstance(n, str) for n in names)
    if not ok or len(set(names)) != len(names) or not set(names) <= set(m.names):  # type: ignore[arg-type]
        raise IntegrityError(f"DONE asks to repair something other than 1 to {MAX_NAMES} distinct manifest names")
    if sum(_nbytes(m, n) for n in names) > budget(m):  # type: ignore[union-attr]
        raise IntegrityError(f"DONE asks to repair more than {budget(m)} bytes: resend the version instead")
    return names  # type: ignore[return-value]


def pack(m: Manifest, source: Source, names: list[str]) -> bytes:
    """REPAIR's payload: an 8-byte length, JSON `{"tensors": [[name, nbytes], ...]}`, then each tensor's bytes."""
    live = source.tensors([m.entry(n).name for n in names])
    parts = []
    with torch.no_grad():
        for n, t in zip(names, live):
            wire = t.detach().to(m.entry(n).spec.dtype).contiguous().cpu()
            parts.append(wire.reshape(-1).view(torch.uint8).numpy().tobytes())
    index = json.dumps({"tensors": [[n, len(p)] for n, p in zip(names, parts)]}).encode()
    return _LEN.pack(len(index)) + index + b"".join(parts)


def unpack(payload: bytes, m: Manifest, asked: list[str]) -> list[tuple[str, torch.Tensor]]:
    """REPAIR's tensors, checked against what was asked and the manifest's shapes; IntegrityError otherwise."""
    if len(payload) < _LEN.size:
        raise IntegrityError("REPAIR is shorter than its index length")
    (size,) = _LEN.unpack_from(payload)
    if size > len(payload) - _LEN.size:
        raise IntegrityError("REPAIR's index runs past its end")
    items = parse_json(payload[_LEN.size : _LEN.size + size], "REPAIR").get("tensors")
    ok = isinstance(items, list) and [i[0] if isinstance(i, list) and len(i) == 2 else None for i in items] == asked
    if not ok:
        raise IntegrityError("REPAIR does not list exactly the tensors asked for, in order")
    out, at = [], _LEN.size + size
    for name, nbytes in items:  # type: ignore[union-attr]
        spec = m.entry(name).spec
        if type(nbytes) is not int or nbytes != spec.nbytes or at + nbytes > len(payload):
            raise IntegrityError(f"REPAIR's {name!r} is {nbytes!r} bytes, not the manifest's {spec.nbytes}")
        raw = torch.frombuffer(bytearray(payload[at : at + nbytes]), dtype=torch.uint8)
        out.append((name, raw.view(spec.dtype).reshape(spec.shape)))
        at += nbytes
    if at != len(payload):
        raise IntegrityError("REPAIR carries bytes after its last tensor")
    return out


def serve(ch: Channel, m: Manifest, source: Source, payload: bytes, version: int) -> tuple[list[str], int]:
    """The sender's half: answer a repair request with REPAIR (status 1 and a message where it is refused);
    (the names sent, their bytes)."""
    try:
        names = parse_request(payload, m)
    except IntegrityError as e:
        ch.send(Header(Kind.REPAIR, status=1, version=version), json.dumps({"message": str(e)}).encode())
        return [], 0
    body = pack(m, source, names)
    ch.send(Header(Kind.REPAIR, version=version), body)
    return names, len(body)


def mend(
    ch: Channel, m: Manifest, engine: Engine, bad: list[str], digests: list[str], version: int
) -> RefitError | None:
    """The receiver's half, after COMMIT: ask for `bad`, load what comes, check it against `digests` (VERIFY's,
    in manifest order). None when the engine now holds the trainer's tensors; else why the version fails."""
    ch.send(Header(Kind.DONE, status=ASK, version=version), {"repair": bad})
    header, payload = ch.recv(f"repair of version {version}", max_payload=MAX_JSON_BYTES)
    if header.kind != Kind.REPAIR or header.version != version:
        return IntegrityError(f"expected REPAIR of version {version}, got {header.kind.name}")
    if header.status:
        return RefitError(f"the sender refused the repair: {payload[:500].decode(errors='replace')}")
    try:
        tensors = unpack(payload, m, bad)
    except IntegrityError as e:
        return e
    engine.load(tensors)
    where = {n: i for i, n in enumerate(m.names)}
    got = held_leaves(bad, [engine.held(n)[0] for n in bad], [m.entry(n).spec.dtype for n in bad])  # type: ignore[index]
    still = [n for n, g in zip(bad, got) if g != digests[where[n]].lower()]
    if still:
        return IntegrityError(
            f"fingerprint check failed after repair: {len(still)} tensor(s) still differ: {still[:20]}"
        )
    return None


def on_receiver(session: Any, failure: RefitError | None, stats: RefitStats, version: int) -> RefitError | None:
    """Receive round's hook before its commit: where `failure` is the fingerprint check's (`ReceivePath.wrong`)
    and repair can help, repair; the failure that stands (None: repaired)."""
    path, m, engine, ch = session.path, session.manifest, session.engine, session.channel
    wrong = path.wrong if path is not None else None
    if failure is None or wrong is None or failure is not wrong[2]:
        return failure
    names = wanted(m, engine, wrong[0], stages=bool(path.stages))
    if names is None:
        return failure
    got = mend(ch, m, engine, names, wrong[1], version)
    if got is None:
        stats.repaired, stats.repair_bytes = names, sum(_nbytes(m, n) for n in names)
        stats.root = verified_root(m.names, wrong[1], stats.unverified_names, engine.optional_names)
    return got


def on_sender(session: Any, ch: Channel, payload: bytes, version: int, stats: RefitStats) -> tuple[Header, bytes]:
    """Send round's hook on a DONE asking for a repair: answer it, then read that receiver's next DONE."""
    names, nbytes = serve(ch, session.manifest, session.source, payload, version)
    stats.repaired = sorted({*stats.repaired, *names})
    stats.repair_bytes += nbytes
    return ch.expect(Kind.DONE, f"commit of version {version} after its repair")
