"""The FP8 handler: engines that state block-FP8 tensors with READY get them from the trainer quantized.

It reads the formats every engine states (refit.stages.fp8), which must agree, wraps the trainer's source so
that it sends those tensors as the engines hold them, and refuses at connect what it cannot quantize (a tied
tensor, a 0-d one, zero-copy), telling every engine why. A joiner must state the session's formats."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from refit.engines.base import Engine
from refit.layout.fp8 import BlockFormat
from refit.sources.base import Source
from refit.stages import fp8
from refit.stages.handler import Handler


class Fp8Handler(Handler):
    name = "fp8"

    def __init__(self, options: Any) -> None:
        super().__init__(options)
        self.formats: dict[str, BlockFormat] = {}
        """The formats the session's engines stated."""

    def adapt(self, source: Source, statements: Sequence[bytes]) -> tuple[Source, tuple[str, ...]]:
        self.formats = fp8.stated(statements)
        adapted, added = fp8.adapt(source, self.formats, zero_copy=bool(getattr(self.options, "zero_copy", False)))
        if added:
            adapted.specs()  # what it cannot quantize (a tied or 0-d tensor) is refused here, before any refit
        return adapted, added

    def vet(self, raw: bytes, rank: int) -> str:
        return fp8.mismatch(raw, self.formats, rank)

    @classmethod
    def stated(cls, engine: Engine) -> dict:
        formats = fp8.checked(engine.formats(), engine.specs(), exact_shapes=engine.exact_shapes)
        return {"formats": fp8.formats_to_json(formats)} if formats else {}
