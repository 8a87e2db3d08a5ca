"""The canary's handler: with `SenderOptions.canary` set, every engine must state that it scores a probe
(READY), and each refit the canary is due for carries the trainer's scores in COMMIT, where the engines check
their own before they commit (refit.checks.canary)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from refit.checks import canary, canary_bisect
from refit.engines.base import Engine
from refit.errors import RefitError
from refit.layout.manifest import Manifest
from refit.sources.base import Source
from refit.stages.handler import Handler


class CanaryHandler(Handler):
    name = "canary"

    def __init__(self, options: Any) -> None:
        super().__init__(options)
        self.canary: canary.Canary | None = getattr(options, "canary", None)
        self.since: int | None = None
        """Refits committed since the last probed one committed, counting it (None: none probed yet)."""
        self.probed: frozenset[int] = frozenset()
        """The receivers the last committed probe reached."""

    def adapt(self, source: Source, statements: Sequence[bytes]) -> tuple[Source, tuple[str, ...]]:
        if self.canary is not None:
            canary.refuse_unable(statements)
        return source, ()

    def vet(self, raw: bytes, rank: int) -> str:
        return canary.mismatch(raw, rank) if self.canary is not None else ""

    def due(self, ranks: frozenset[int]) -> object | None:
        """The trainer's scores of the probe when due: by the count of committed refits, or because the refit
        reaches receivers the last probe did not."""
        c = self.canary
        if c is None or not (c.due(self.since) or not ranks <= self.probed):
            return None
        return c.reference_payload()

    def committed(self, ranks: list[int], carried: bool) -> None:
        if carried:
            self.since, self.probed = 1, frozenset(ranks)
        elif self.since is not None:
            self.since += 1

    def diagnose(self, done: dict, cache: dict) -> str:
        """Where a failed canary's outputs first leave the trainer's: one more pass of the probe, per refit."""
        return canary_bisect.trainer_half(self.canary, done.get(canary_bisect.FIELD), cache)

    @classmethod
    def stated(cls, engine: Engine) -> dict:
        return {"canary": True} if engine.scoring() is not None else {}

    @classmethod
    def parse(cls, value: object) -> object:
        return canary.parse(value)

    @classmethod
    def veto(cls, parsed: object, engine: Engine, manifest: Manifest, version: int) -> RefitError | None:
        """Score the probe with what the engine computes with, against the trainer's scores."""
        assert isinstance(parsed, canary.Probe)
        dtypes = [spec.dtype for spec in engine.specs()] + [p.spec.dtype for p in manifest.entries]  # held, as sent
        return canary.check(engine.scoring(), parsed, dtypes, version)

    @classmethod
    def explain(cls, parsed: object, engine: Engine, manifest: Manifest) -> dict:
        """The engine's per-module sketches of the probe, for the trainer's bisection (one more probe pass)."""
        assert isinstance(parsed, canary.Probe)
        dtypes = [spec.dtype for spec in engine.specs()] + [p.spec.dtype for p in manifest.entries]
        tol = parsed.tolerance if parsed.tolerance is not None else canary.tolerance_for(dtypes)
        return canary_bisect.engine_half(engine, parsed.tokens, tol)
