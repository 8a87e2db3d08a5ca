"""Errors: the exceptions refit raises, each naming what went wrong and what to check."""

from __future__ import annotations


class RefitError(RuntimeError):
    """A refit or session failed; the engine's weights are not reported as the new version."""


class HandshakeError(RefitError):
    """The manifest does not match the engine; nothing was loaded."""


class PeerError(RefitError):
    """The other side failed, closed, sent something malformed or did not answer in time."""


class IntegrityError(RefitError):
    """Bytes arrived that do not match their header (checksum, epoch, digest, size)."""
