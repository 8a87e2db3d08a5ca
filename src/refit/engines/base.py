"""Engine protocol: the parameters an engine expects, how it loads them, and its weights version state."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import torch

from refit.engines.versions import State, Versions, WeightsVersion
from refit.layout.fp8 import BlockFormat
from refit.layout.manifest import Manifest
from refit.layout.spec import Slice, TensorSpec

__all__ = ["Engine", "Region", "State", "WeightsVersion"]

Region = tuple[int, int, int]
"""(dim, start, stop): the slice of a checkpoint tensor an engine holds."""


class Engine(ABC):
    """The inference side. Subclasses say what they hold and how to load; versioning lives here."""

    exact_shapes: bool = True
    """False when the engine's own loader checks shapes (vLLM), so the handshake compares names and dtypes."""
    optional_names: frozenset[str] = frozenset()
    """Names the sender may send or omit (e.g. lm_head.weight of a tied model)."""
    computed_names: frozenset[str] = frozenset()
    """Names among `specs` the engine computes itself (non-persistent buffers): loaded and checked when the
    sender sends them; when it does not, the handshake names them (they keep the engine's own values)."""

    def __init__(self) -> None:
        self.versions = Versions()
        """The weights version state machine; the receiver moves it (a subclass's begin/commit/fail do its own
        work and leave the state to the base class)."""

    def assume_current(self, version: int) -> None:
        """Declare the weights the engine started with to be the trainer's `version` (an engine loaded from
        the checkpoint the trainer starts from): `current` before any refit. Only before the first refit."""
        self.versions.assume_current(version)

    @abstractmethod
    def specs(self) -> list[TensorSpec]:
        """Names (as the sender calls them), shapes and dtypes of everything the engine holds."""

    def layout(self) -> list[TensorSpec]:
        """What the engine holds now, as `specs` says it, called after `begin` to check that the epoch's
        validated manifest still fits. Engines that re-read their tensors in `begin` may answer from that."""
        return self.specs()

    @abstractmethod
    def load(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Copy these tensors in; they are views into a reused buffer, so copy before returning."""

    def load_digested(self, tensors: list[tuple[str, torch.Tensor]]) -> tuple[list[str], torch.Tensor] | None:
        """`load`, and for the names whose bytes that copy proves (written once, whole, in the wire dtype,
        and not changed by the engine afterwards) the fingerprint digest of what the engine now holds:
        (names, int64 digests on CPU). The fingerprint check reads back only the other names. The default
        proves nothing (None): every name is read back through `held` (engines that post-process)."""
        self.load(tensors)
        return None

    def held(self, name: str) -> tuple[torch.Tensor, Region | None] | None:
        """The engine's live tensor for sender name `name`, for the end-to-end fingerprint check.

        Returns (tensor, region): `tensor` holds the checkpoint tensor's values (in any dtype that
        holds the wire dtype exactly), or, when `region` is (dim, start, stop), only that slice of it
        (a tensor-parallel shard). None when this engine cannot read the tensor back (it is then
        reported as unverified, never as verified).
        """
        return None

    def writable(self, name: str) -> torch.Tensor | None:
        """The live tensor a one-sided READ may write sender name `name`'s bytes into directly, bypassing `load`
        (zero-copy over nixl; it is used only when contiguous in the wire dtype and shape). None (the default):
        the bytes go through `load`. Only an engine whose `load` of `name` is a plain copy into that very
        tensor, with nothing done after, may return one."""
        return None

    def shards(self) -> dict[str, Slice | None] | None:
        """M:N (`refit.topology.mesh`): per sender name this worker loads, the slice of the checkpoint
        tensor it keeps (None: the whole tensor); None (the default) when the engine states no shards."""
        return None

    def shard_target(self, name: str) -> torch.Tensor | None:
        """M:N: the live tensor holding exactly this worker's slice of `name` (slice shape), written in
        place; None when the engine loads slices through `load_shards` instead."""
        return None

    def load_shards(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        """M:N: like `load`, each tensor being this worker's slice of the named tensor, as `shards` states."""
        raise NotImplementedError(f"{type(self).__name__} states shards but neither targets nor loads them")

    def held_shard(self, name: str) -> torch.Tensor | None:
        """M:N: this worker's slice of `name` as the engine now holds it, for the fingerprint (None: unreadable)."""
        return None

    def prepare(self, manifest: Manifest) -> None:
        """Called by the Receiver with each epoch's manifest, before `specs` is read to validate it: an engine
        whose expectations depend on what the sender offers (M:N pieces, refit.engines.pieces) sets them up
        here, and raises ValueError, naming why, when the manifest cannot fit it. The default does nothing."""

    def formats(self) -> dict[str, BlockFormat]:
        """The tensors this engine holds in block FP8, by the names the trainer sends, with how each was
        quantized (its scales are held under `format.scale_name(name)`): the trainer sends its float tensors
        quantized by the same rule (refit.stages.fp8). The default holds none."""
        return {}

    def statement(self) -> dict:
        """What else this engine states with READY, by key, as JSON (the LoRA stage's engine half states its
        adapter and base digest under "lora": refit.stages.lora); the trainer checks it. The default: nothing."""
        return {}

    def scoring(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """How this engine scores a canary probe with what it computes with (refit.checks.canary): token ids in,
        each token's log-probability given the ones before it out; None (the default) when it cannot."""
        return None

    def release_buffers(self) -> None:
        """Drop every view this engine keeps into the receive buffers (cached copy plans and the like),
        so the buffers can be freed; called by Receiver.close(). The next load plans afresh."""

    @property
    def weights(self) -> WeightsVersion:
        return self.versions.weights

    def note_staged(self, version: int | None) -> None:
        """Record that `version` waits in staging memory (None: nothing does); the live state is unchanged."""
        self.versions.note_staged(version)

    def begin(self, version: int) -> None:
        """Called before the first bucket of a refit to `version`."""
        self.versions.begin(version)

    def commit(self, version: int) -> None:
        """Called after the last bucket arrived and was loaded. In a refit voted across trainer ranks (or
        strict) this runs before the vote; a vetoed version then gets `fail`, and the version stays the last
        committed one."""
        self.versions.commit(version)

    def fail(self, version: int, reason: str) -> None:
        """Called when a refit to `version` broke off after `begin`."""
        self.versions.fail(version, reason)

    def ensure_current(self, *, allow_failed: bool = False) -> None:
        """Raise unless the weights are one consistent version (call before generating)."""
        self.versions.ensure_current(allow_failed=allow_failed)
