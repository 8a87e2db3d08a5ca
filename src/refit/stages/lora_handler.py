"""The LoRA handler: a session sending one adapter (refit.stages.lora.LoraSource) checks at connect that every
engine states that adapter's layout over the same base, and adds the `lora` stage; an engine serving an adapter
refuses any other source. A joiner is held to the same."""

from __future__ import annotations

from collections.abc import Sequence

from refit.sources.base import Source
from refit.stages import lora
from refit.stages.handler import Handler


class LoraHandler(Handler):
    name = "lora"
    source: Source | None = None

    def adapt(self, source: Source, statements: Sequence[bytes]) -> tuple[Source, tuple[str, ...]]:
        self.source = source
        return source, lora.adapt(source, statements)

    def vet(self, raw: bytes, rank: int) -> str:
        return lora.mismatch(raw, self.source, rank) if self.source is not None else ""
