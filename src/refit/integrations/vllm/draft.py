"""DraftedEngine: a vLLM worker's target model and its speculative draft model as one refit Engine, so one
manifest, one refit and one version carry both (the draft's tensors named `draft.<checkpoint name>`), and
`drafted`, the trainer-side module that names them so. Imports nothing of vLLM.

vLLM's API updates a draft in a session of its own (`start_draft_weight_update`), which would commit the
target and the draft as two versions; here the draft session carries both, and both commit or neither.
"""

from __future__ import annotations

import torch

from refit.engines.base import Engine, Region
from refit.integrations.vllm.engine import VllmEngine
from refit.layout.spec import TensorSpec

DRAFT_PREFIX = "draft."
"""What the trainer puts before a draft model's checkpoint names (`drafted` does it)."""


def drafted(target: torch.nn.Module, draft: torch.nn.Module) -> torch.nn.Module:
    """A module whose parameters and buffers are the target's under their own names (its root-level ones
    included, persistent or not as in the target) and the draft's under `draft.<name>`: the source of a refit
    that carries both (`ModuleSource(drafted(policy, draft))`). It holds the same tensors, and the target's own
    root-level tables, so the source reads what the trainer holds now, a root tensor reassigned since included."""
    both = torch.nn.Module()
    for name, child in target.named_children():
        both.add_module(name, child)
    # the target's own dicts, shared, not copied: a root-level parameter or buffer reassigned later is read live
    both._parameters = target._parameters
    both._buffers = target._buffers
    both._non_persistent_buffers_set = target._non_persistent_buffers_set
    if hasattr(both, "draft"):
        raise ValueError("the target model has a child named 'draft': its names would clash with the draft's")
    both.add_module("draft", draft)
    return both


class DraftedEngine(Engine):
    """A target VllmEngine and, once vLLM names it (`attach`), its draft's: names, loads, the fingerprint's
    read-back, begin, commit and failure go to both; the version is this engine's, one for both."""

    def __init__(self, target: VllmEngine) -> None:
        super().__init__()
        self.target = target
        self.draft: VllmEngine | None = None
        self.exact_shapes = target.exact_shapes
        self.optional_names = target.optional_names
        self.computed_names = target.computed_names
        self._split: dict[int, tuple[list, list, list]] = {}

    def attach(self, draft: VllmEngine) -> None:
        """The draft model, from vLLM's draft session; its names join the specs of the next handshake."""
        self.draft = draft
        self.exact_shapes = self.target.exact_shapes and draft.exact_shapes
        self.optional_names = self.target.optional_names | {DRAFT_PREFIX + n for n in draft.optional_names}
        self.computed_names = self.target.computed_names | {DRAFT_PREFIX + n for n in draft.computed_names}
        self._split = {}

    @property
    def seconds(self) -> dict[str, float]:
        parts = [self.target.seconds, self.draft.seconds if self.draft is not None else {}]
        return {k: sum(p.get(k, 0.0) for p in parts) for k in ("copy", "post")}

    def specs(self) -> list[TensorSpec]:
        out = self.target.specs()
        if self.draft is not None:
            out += [
                TensorSpec(DRAFT_PREFIX + s.name, s.shape, s.dtype, tuple(DRAFT_PREFIX + a for a in s.aliases))
                for s in self.draft.specs()
            ]
        return out

    def _parts(self, tensors: list[tuple[str, torch.Tensor]]) -> tuple[list, list]:
        """The target's and the draft's tensors of one bucket, as lists kept per bucket list: the load plans
        cache their copies by list, and the receiver passes the same list for a bucket at every refit."""
        hit = self._split.get(id(tensors))
        if hit is None or hit[0] is not tensors:
            n = len(DRAFT_PREFIX)
            draft = [(name[n:], t) for name, t in tensors if name.startswith(DRAFT_PREFIX)]
            target = [(name, t) for name, t in tensors if not name.startswith(DRAFT_PREFIX)]
            hit = self._split[id(tensors)] = (tensors, target, draft)
        return hit[1], hit[2]

    def load(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        target, draft = self._parts(tensors)
        self.target.load(target)
        if draft:
            self._draft().load(draft)

    def load_digested(self, tensors: list[tuple[str, torch.Tensor]]) -> tuple[list[str], torch.Tensor] | None:
        target, draft = self._parts(tensors)
        got = [self.target.load_digested(target), self._draft().load_digested(draft) if draft else None]
        names = [*(got[0][0] if got[0] else []), *(DRAFT_PREFIX + n for n in (got[1][0] if got[1] else []))]
        digests = [g[1] for g in got if g is not None]
        return (names, torch.cat(digests)) if digests else None

    def held(self, name: str) -> tuple[torch.Tensor, Region | None] | None:
        if name.startswith(DRAFT_PREFIX):
            return None if self.draft is None else self.draft.held(name[len(DRAFT_PREFIX) :])
        return self.target.held(name)

    def release_buffers(self) -> None:
        self._split = {}
        for engine in (self.target, self.draft):
            if engine is not None:
                engine.release_buffers()

    def begin(self, version: int) -> None:
        super().begin(version)
        for engine in (self.target, self.draft):
            if engine is not None:
                engine.begin(version)

    def commit(self, version: int) -> None:
        """Both models' post-processing; a failure in either fails the version for both (the receiver then
        calls `fail`), so the version never names a target and a draft of different refits."""
        for engine in (self.target, self.draft):
            if engine is not None:
                engine.commit(version)
        super().commit(version)

    def fail(self, version: int, reason: str) -> None:
        for engine in (self.target, self.draft):
            if engine is not None:
                engine.fail(version, reason)
        super().fail(version, reason)

    def _draft(self) -> VllmEngine:
        if self.draft is None:
            raise ValueError(
                f"the trainer sends {DRAFT_PREFIX}* tensors, but vLLM named no draft model for this refit: start it "
                "with start_draft_weight_update (VllmRefit does when the source has draft tensors)"
            )
        return self.draft
