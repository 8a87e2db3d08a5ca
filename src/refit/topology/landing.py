"""Landing: where an engine side's refits land, the live engine or staging memory in front of it.

A receiver (and an M:N worker) drives `target.engine`; the target says what a committed version means (live:
it is what the engine serves now; staged: it is ready for `apply`), what a stopped receive side does to a
refit under way, and (staged) how each epoch's tensors divide between staging memory and the pause."""

from __future__ import annotations

from collections.abc import Callable

import torch

from refit.engines.base import Engine
from refit.engines.staging import Split, Staging
from refit.layout.manifest import Manifest
from refit.log import get_logger
from refit.settings import Settings

log = get_logger("receiver")
OnCommit = Callable[[int], None] | None


class Live:
    """Refits load the live engine; a committed version is live at once."""

    staging: Staging | None = None
    split: Split | None = None

    def __init__(self, engine: Engine, on_commit: OnCommit) -> None:
        self.engine = engine
        self.on_commit = on_commit

    def epoch(self, manifest: Manifest) -> None:
        """A new manifest was validated."""

    def relaid(self, manifest: Manifest) -> None:
        """The engine's tensors changed since the handshake and the manifest still fits them."""

    def committed(self, version: int) -> None:
        """Every worker's verdict is in."""
        if self.on_commit is not None:
            self.on_commit(version)

    def abort(self, reason: str) -> None:
        """The receive side stopped."""

    def apply(self) -> bool:
        """Between generation steps: whether a staged version went live."""
        return False


class Staged(Live):
    """Refits land in staging memory while the engine generates; `apply` moves a committed version in."""

    def __init__(self, staging: Staging, on_commit: OnCommit) -> None:
        super().__init__(staging, on_commit)
        self.staging: Staging = staging

    def epoch(self, manifest: Manifest) -> None:
        self.split = self.staging.split(manifest)
        if self.split.num_direct:
            log.info("staged refit, epoch %d: %s", manifest.epoch, self.split.describe())

    def relaid(self, manifest: Manifest) -> None:
        self.split = self.staging.split(manifest)
        self.staging.follow()

    def committed(self, version: int) -> None:
        self.staging.publish(version)

    def abort(self, reason: str) -> None:
        self.staging.abort(reason)

    def apply(self) -> bool:
        version = self.staging.apply()
        if version is None:
            return False
        super().committed(version)
        return True


def landing(
    engine: Engine, device: torch.device, *, staged: bool, limit: int | None, settings: Settings
) -> Live | Staged:
    """A receiver's landing: staged (staging memory of at most `limit` bytes, None: unbounded) or live."""
    if limit is not None and limit < 0:
        raise ValueError(f"staging_bytes ({limit}) must be at least 0, or None for no bound")
    if not staged:
        return Live(engine, None)
    # Half the timeout: the pause's error must reach the sender before its own wait for this bucket runs out.
    return Staged(Staging(engine, device=device, limit=limit, timeout_s=settings.timeout_s / 2), None)
