"""Stage: one transformation of a refit's wire bytes, with both halves (the trainer's and the engine's).

A stage is made once per epoch on each side, from the epoch's manifest, and called by both rounds at fixed
points: when a refit begins (the trainer may name a base version the refit is sent against; the engine checks
it), per bucket on the way out (after the pack, before the checksum) and on the way in (after the checksum,
before the unpack), and when the refit commits or fails. On the trainer, stages run in the order the session
lists them; on the engine, in reverse, each undoing its own step.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import ClassVar

import torch

from refit.errors import RefitError
from refit.layout.manifest import Manifest
from refit.protocol.wire import Bucket


class Stage:
    """Both halves of one stage; the base class passes the bytes through unchanged."""

    name: ClassVar[str] = ""
    """The name it is registered under (`refit.stages.register`), which the manifest lists."""
    flags: ClassVar[Bucket] = Bucket(0)
    """The BUCKET status bits this stage sets and reads (only refit's own stages have any)."""
    resizing: ClassVar[Bucket] = Bucket(0)
    """Of `flags`, those that mark a bucket moving another number of bytes than the manifest's. A bucket
    without one of them must move exactly the manifest's bytes (checked on both sides)."""

    def __init__(self, manifest: Manifest, device: torch.device, *, trainer: bool) -> None:
        """`device`: where the bucket buffers live. `trainer`: this is the trainer's half."""
        self.manifest = manifest
        self.device = device
        self.trainer = trainer

    def configure(self, session: Mapping[str, object]) -> None:
        """The session's settings by name (the trainer's: `delta_threshold`, `delta_costs`; each side's own
        keys), given once after the stage is made; a stage reads the ones it knows. The default reads none."""

    # -- the trainer's half ----------------------------------------------------------------------

    def base(self, version: int, ranks: list[int]) -> int | None:
        """A refit of `version` to the receivers of `ranks` begins: the committed version it is sent against
        (BEGIN's `base`), or None when it does not depend on one. At most one stage of a session names one."""
        return None

    def outgoing(self, b: int, buf: torch.Tensor, nbytes: int) -> tuple[int, Bucket]:
        """Bucket `b`'s `nbytes` wire bytes in `buf` (the slot, whole bucket capacity): rewrite them in place;
        returns the bytes now to move (at most the buffer) and this stage's flags for the BUCKET header; a
        different number of bytes only with one of its `resizing` flags."""
        return nbytes, Bucket(0)

    def sent(self, b: int, nbytes: int, seconds: float) -> None:
        """Bucket `b` was retired: its `nbytes` (as `outgoing` left them) took `seconds` of the sender's time on
        the link (sending it, then waiting until every receiver took it; the part that overlapped later packs is
        not counted). A stage may learn the link's cost from it."""

    def refusal(self) -> str:
        """After the last bucket went out: why the trainer refuses this refit (found during its pack, and told
        to the receivers in a bucket's flags, so that none commits it), or ''. The refit then fails with it."""
        return ""

    def buckets(self) -> dict[str, int]:
        """This refit's buckets per way this stage sent them (`RefitStats.buckets`); empty when it has no say."""
        return {}

    # -- the engine's half -----------------------------------------------------------------------

    def accept(self, version: int, base: int | None) -> RefitError | None:
        """A refit of `version` against `base` (None: none named) begins: the reason this side cannot take
        it (nothing is then loaded, the buckets are drained), or None."""
        return None

    def incoming(self, b: int, buf: torch.Tensor, nbytes: int, flags: Bucket) -> torch.Tensor | None:
        """Undo `outgoing` for bucket `b`: `nbytes` in `buf` as they arrived (checksum already checked). Either
        rewrite `buf` in place and return None, or return the tensor of `buffers()` that now holds the bucket's
        wire bytes. Raise IntegrityError for bytes this stage cannot have sent."""
        return None

    def buffers(self) -> Sequence[torch.Tensor] | None:
        """Per bucket, a tensor `incoming` may return, fixed for the epoch (the receive path plans its unpack
        from them once); None when `incoming` always works in place."""
        return None

    # -- both ------------------------------------------------------------------------------------

    def committed(self, version: int, ranks: list[int]) -> None:
        """The refit committed `version` (on the trainer: on the receivers of `ranks`; on the engine: here)."""

    def failed(self) -> None:
        """The refit failed (before or after its buckets moved)."""

    @property
    def nbytes(self) -> int:
        """Memory this stage keeps for the epoch (bytes), for `refit plan` and the logs."""
        return 0
