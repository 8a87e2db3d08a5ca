"""The weights version state machine (empty, updating, current, failed; and what waits in staging): one owner,
`Versions`, which each engine holds and the receiver drives. Engines do their own work in begin/commit/fail;
the state moves only here."""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum

from refit.errors import RefitError


class State(str, Enum):
    EMPTY = "empty"
    """No refit has committed yet: the engine holds whatever it started with, not the trainer's weights."""
    CURRENT = "current"
    """Every parameter belongs to `version`."""
    UPDATING = "updating"
    """A refit to `target` is under way; parameters are mixed."""
    FAILED = "failed"
    """A refit to `target` failed partway; parameters are mixed until a retry succeeds."""


@dataclass(frozen=True, slots=True)
class WeightsVersion:
    state: State
    version: int | None
    """Last committed version (None before the first commit)."""
    target: int | None = None
    """Version being (or that failed being) installed."""
    reason: str = ""
    staged: int | None = None
    """A staged refit (`Receiver(..., staged=True)`): the version received, verified and committed by every
    worker into staging memory, waiting for `apply_staged()`; the live weights are still `version`."""


class Versions:
    """The state of one engine's weights; every transition of it goes through these methods."""

    def __init__(self) -> None:
        self.weights = WeightsVersion(State.EMPTY, None)
        self._held: int | None = None
        """A version whose engine commit, next, must leave the state 'updating' (`hold`)."""

    def assume_current(self, version: int) -> None:
        if self.weights.state != State.EMPTY:
            raise ValueError(f"assume_current({version}) after a refit began (state: {self.weights.state.value})")
        self.weights = WeightsVersion(State.CURRENT, version)

    def note_staged(self, version: int | None) -> None:
        self.weights = replace(self.weights, staged=version)

    def begin(self, version: int) -> None:
        self._held = None
        self.weights = WeightsVersion(State.UPDATING, self.weights.version, version)

    def hold(self, version: int) -> None:
        """The engine's own commit of `version`, next, leaves the weights 'updating' (the last committed version
        still the one before): a verdict or a check decides later, and no reader ever sees `version` current
        before it does. The commit after that decision makes it current."""
        self._held = version

    def commit(self, version: int) -> None:
        w = self.weights
        if w.state != State.UPDATING or w.target != version:
            raise RefitError(f"commit of version {version} without a matching begin (state: {w})")
        if self._held == version:
            self._held = None  # the engine's own commit ran; the state waits for the verdict or the checks
            return
        self.weights = WeightsVersion(State.CURRENT, version)

    def fail(self, version: int, reason: str) -> None:
        self._held = None
        self.weights = WeightsVersion(State.FAILED, self.weights.version, version, reason)

    def ensure_current(self, *, allow_failed: bool = False) -> None:
        w = self.weights
        if w.state == State.CURRENT or (allow_failed and w.state == State.FAILED):
            return
        if w.state == State.EMPTY:
            raise RefitError(
                "engine has not committed any refit yet: it holds the weights it started with, not the trainer's. "
                "Run a refit first, or call engine.assume_current(version) if it was loaded from the checkpoint "
                "the trainer starts from"
            )
        raise RefitError(
            f"engine weights are {w.state.value} (last committed {w.version}, target {w.target}): "
            f"{w.reason or 'refit in progress'}. "
            "Retry the refit of the same version to restore them, or pass allow_failed=True to generate anyway."
        )
