"""The engine side of a handshake: the sender's manifest read, bound to this session and sized for the agreed
buffers, or refused (ERROR to the sender, IntegrityError here); then validated against what the engine holds
and answered with one REPORT (HandshakeError here when it refuses)."""

from __future__ import annotations

import torch

from refit import stages
from refit.checks.manifest_check import validate
from refit.engines.base import Engine
from refit.errors import HandshakeError, IntegrityError
from refit.layout.manifest import Manifest
from refit.layout.spec import TensorSpec
from refit.log import get_logger
from refit.protocol import auth
from refit.protocol.wire import Channel, Header, Kind
from refit.stages import Stage
from refit.topology.digest_plan import engine_regions
from refit.topology.landing import Live

log = get_logger("receiver")


def read_manifest(ch: Channel, header: Header, payload: bytes, *, capacity: int, rank: int, engine: Engine) -> Manifest:
    """The MANIFEST in `header` and `payload`: parsed, its MAC under the session key checked, its capacity the
    agreed one, and (M:N) the pair's pieces checked by the engine."""

    def refuse(message: str, raised: str) -> IntegrityError:
        ch.send(Header(Kind.ERROR), {"message": f"receiver {rank} rejected the manifest: {message}"})
        return IntegrityError(raised)

    try:
        manifest = Manifest.from_json(payload)
    except (ValueError, RecursionError) as e:
        raise refuse(str(e), f"sender's manifest is malformed: {e}") from None
    binding = auth.manifest_binding(manifest.epoch, manifest.digest)
    if not auth.check_tag(ch.key, b"MANIFEST", binding, header.digest):
        msg = "manifest is not bound to this session (its MAC under the session key is wrong)"
        raise refuse(msg, msg)
    if manifest.capacity != capacity:
        msg = f"manifest capacity {manifest.capacity} differs from the agreed {capacity}"
        raise refuse(msg, msg)
    try:
        engine.prepare(manifest)  # M:N (refit.engines.pieces): the pair's pieces fit this worker
    except ValueError as e:
        raise refuse(str(e), f"sender's M:N pieces do not fit this worker: {e}") from None
    return manifest


def answer(ch: Channel, manifest: Manifest, engine: Engine, landing: Live, *, fingerprint: bool) -> list[TensorSpec]:
    """Validate `manifest` against the engine (and the stages this process registered) and send the REPORT;
    returns the engine's specs it was validated against, or raises HandshakeError with the report."""
    layout = engine.specs()
    report = validate(
        [p.spec for p in manifest.entries],  # with aliases: which names share one source
        layout,
        exact_shapes=engine.exact_shapes,
        optional=engine.optional_names,
        stages=[n for n in manifest.stages if not stages.registered(n)],
        computed=engine.computed_names,
    )
    if report.ok and report.unsynced:
        log.warning("%s", report.unsynced_message())
    if report.ok:  # staged: what goes to staging memory decides which regions the engine names
        landing.epoch(manifest)
    regions = engine_regions(manifest, engine) if fingerprint and report.ok else {}
    ch.send(Header(Kind.REPORT), {**report.to_json(), "regions": regions})
    if not report.ok:
        raise HandshakeError(report.message())
    return layout


def prepare_stages(ch: Channel, manifest: Manifest, device: torch.device, *, rank: int) -> list[Stage]:
    """The engine's half of each stage the manifest lists (none while one is unregistered: the REPORT refuses
    it). One that cannot be made (out of memory for the delta image, say) ends the session with ERROR naming
    it, before the REPORT could promise that this side takes the refits."""
    if not all(stages.registered(n) for n in manifest.stages):
        return []
    try:
        return stages.make(manifest.stages, manifest, device, trainer=False)
    except Exception as e:  # noqa: BLE001 - any failure to prepare is the session's end, said to the sender
        msg = f"receiver {rank} could not prepare the stages {list(manifest.stages)}: {type(e).__name__}: {e}"
        ch.send(Header(Kind.ERROR), {"message": msg})
        raise IntegrityError(msg) from None
