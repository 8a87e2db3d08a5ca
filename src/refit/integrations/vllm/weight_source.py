"""StreamSource: a vLLM `WeightSource` (its `ModuleSource`, or any other) read as a refit Source.

vLLM's sources declare `(name, wire dtype, full shape)` through `metadata()` and yield materialised
`(name, tensor)` pairs, one fresh pass per round, in their own order. refit packs in manifest (name)
order, so this adapter takes exactly one pass of the source per refit and keeps what it yielded until
the round ends. Imports nothing of vLLM: the source is used through those two methods only."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch

from refit.errors import RefitError
from refit.layout.spec import TensorSpec
from refit.sources.base import Source


class StreamSource(Source):
    """Names, shapes and wire dtypes from `source.metadata()`; tensors from one pass of `iter(source)` per
    round (`begin_round` ... `end_round`).

    One pass per round keeps trainer ranks that materialise collectively (FSDP `full_tensor()`) in
    lockstep: ranks that do not send iterate the same source once per round too. A tensor yielded
    ahead of the one asked for is held until the round ends, so a source whose pass materialises fresh
    tensors may hold up to the whole model at once (refit's own `FsdpSource` gathers bucket by bucket).
    """

    stable_tensors = False  # a round's tensors are dropped with the round: no copy plan outlives them
    signature_covers_layout = False

    def __init__(self, source: Any) -> None:
        if not (callable(getattr(source, "metadata", None)) and callable(getattr(source, "__iter__", None))):
            raise ValueError(
                f"source must be a vLLM WeightSource (metadata() and iteration over (name, tensor)), "
                f"not {type(source).__name__}"
            )
        self.source = source
        self._pass: Iterator[tuple[str, torch.Tensor]] | None = None
        self._held: dict[str, torch.Tensor] = {}

    def specs(self) -> list[TensorSpec]:
        return [TensorSpec(m.name, tuple(m.shape), m.dtype) for m in self.source.metadata()]

    def begin_round(self) -> None:
        self._held.clear()
        self._pass = iter(self.source)

    def end_round(self, *, drain: bool) -> None:
        """Drop the round's tensors; with `drain`, first finish the pass, so that ranks iterating the same
        source collectively are not left waiting for this one (after a failed send, not a failed source)."""
        if drain and self._pass is not None:
            for _ in self._pass:
                pass
        self._pass = None
        self._held.clear()

    def tensors(self, names: Sequence[str]) -> list[torch.Tensor]:
        if self._pass is None:
            raise RefitError("StreamSource.tensors called outside a round (begin_round was not called)")
        for name in names:
            while name not in self._held:
                item = next(self._pass, None)
                if item is None:  # the trainer's own error (not the session's): the Sender tells the engines at once
                    raise ValueError(
                        f"the WeightSource's pass ended without yielding {name!r}, which its metadata() declares; "
                        "metadata() and iteration must name the same tensors"
                    )
                self._held[item[0]] = item[1]
        return [self._held[n] for n in names]
