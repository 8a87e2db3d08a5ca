"""The engine side of a handshake, before validation: the sender's manifest read, bound to this session
and sized for the agreed buffers, or refused (ERROR to the sender, IntegrityError here)."""

from __future__ import annotations

from refit.engines.base import Engine
from refit.errors import IntegrityError
from refit.layout.manifest import Manifest
from refit.protocol import auth
from refit.protocol.wire import Channel, Header, Kind


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
    prepare = getattr(engine, "prepare", None)  # M:N (refit.engines.pieces): check the pair's pieces
    if callable(prepare):
        try:
            prepare(manifest)
        except ValueError as e:
            raise refuse(str(e), f"sender's M:N pieces do not fit this worker: {e}") from None
    return manifest
