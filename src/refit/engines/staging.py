"""Staging: the engine side of a staged refit, over any Engine.

A staged refit writes version N+1 into staging memory (one tensor per name, in the dtype the engine holds)
while the engine goes on generating with N; the live engine is not touched, so it stays `current` at N
whatever happens to N+1. Once N+1 is verified (the fingerprint check reads the staging tensors) and every
worker committed it, it is *ready*; `apply()`, called by the engine loop between generation steps, loads
the staging tensors into the live engine through the engine's own `load` (a same-dtype local copy) and
commits N+1 there. The protocol drives this object in place of the engine (`Receiver(..., staged=True)`).

A refit that begins while a version is ready replaces it (N+2 overwrites the staged N+1, which is never
applied); one that fails leaves nothing ready. Staging costs one more copy of every tensor the engine loads.
"""

from __future__ import annotations

import threading

import torch

from refit.engines.base import Engine, Region
from refit.errors import RefitError
from refit.layout.packing import CopyPlan
from refit.layout.reshard import Slice
from refit.layout.spec import TensorSpec
from refit.log import get_logger

log = get_logger("receiver")


def staging_nbytes(specs: list[TensorSpec]) -> int:
    """Bytes a staged refit allocates for an engine stating `specs` (aliases share one tensor)."""
    return sum(s.nbytes for s in specs)


class Staging(Engine):
    """Stands in for `live` in the protocol: loads go to staging tensors; `apply()` moves them into `live`.

    The receive side (one thread) calls begin/load/commit/fail as for any engine, then `publish(version)`
    once every worker's verdict is in; the engine loop (another thread) calls `apply()`. A lock orders the
    two: a refit's begin waits for an apply in progress, and apply never reads a version still arriving."""

    def __init__(self, live: Engine, *, device: torch.device) -> None:
        super().__init__()
        self.live = live
        self.device = device
        self.exact_shapes = live.exact_shapes
        self.optional_names = live.optional_names
        self._lock = threading.Lock()
        self._tensors: dict[str, torch.Tensor] = {}
        """Staging tensor per name the sender loads under (an alias maps to its primary's tensor)."""
        self._dtypes: dict[str, torch.dtype] = {}
        self._primary: dict[str, str] = {}
        self._plans: dict[int, tuple[list, CopyPlan]] = {}
        self._apply: list[tuple[str, torch.Tensor]] = []
        """What `apply()` loads into `live`: every name as the receive path gave it, in order (one list
        object, so an engine that caches copy plans per list, like ModuleEngine, replays one plan)."""
        self._ready: int | None = None
        self._shards: dict[str, torch.Tensor] = {}
        """M:N: staging for the engine's shard targets (`shard_target`), copied into them by `apply()`."""
        self._shard_loads: dict[str, torch.Tensor] = {}
        """M:N: staging for the slices an engine takes through `load_shards`, replayed by `apply()`."""
        self._shard_plan: tuple[tuple, CopyPlan] | None = None

    @property
    def nbytes(self) -> int:
        """Bytes of staging memory allocated now."""
        every = [*self._tensors.values(), *self._shards.values(), *self._shard_loads.values()]
        return sum({id(t): t.numel() * t.element_size() for t in every}.values())

    @property
    def ready(self) -> int | None:
        """The version waiting for `apply()`, or None."""
        return self._ready

    def specs(self) -> list[TensorSpec]:
        specs = self.live.specs()
        self._dtypes = {n: s.dtype for s in specs for n in s.names}
        self._primary = {n: s.name for s in specs for n in s.names}
        self._plans = {}  # a handshake: the next refit's buffers and views are new
        return specs

    def shards(self) -> dict[str, Slice | None] | None:
        return self.live.shards()

    def begin(self, version: int) -> None:
        with self._lock:  # waits for an apply in progress; from here the staging tensors are being overwritten
            self._ready = None
            self.live.note_staged(None)
            super().begin(version)

    def load(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Copy into the staging tensors (allocated at the first load of each name, in the engine's dtype)."""
        hit = self._plans.get(id(tensors))
        if hit is None or hit[0] is not tensors:
            plan, changed = self._plan(tensors)
            if changed:  # an older plan would write into a dropped staging tensor
                self._plans = {}
            hit = self._plans[id(tensors)] = (tensors, plan)
        with torch.no_grad():
            hit[1].run()

    def _plan(self, tensors: list[tuple[str, torch.Tensor]]) -> tuple[CopyPlan, bool]:
        dst, src, done, changed = [], [], set(), False
        for name, t in tensors:
            key = self._primary.get(name)
            if key is None:  # a waived name the engine does not have: never loaded
                continue
            have = self._tensors.get(key)
            if have is None or have.shape != t.shape:
                have = self._tensors[key] = torch.empty(
                    t.shape, dtype=self._dtypes.get(name, t.dtype), device=self.device
                )
                changed = True
            if self._tensors.get(name) is not have:
                self._tensors[name], changed = have, True
            if key not in done:  # an alias is one tensor: copied once
                done.add(key)
                dst.append(have)
                src.append(t)
        if changed:
            self._apply = list(self._tensors.items())
        return CopyPlan(dst, src), changed

    def shard_target(self, name: str) -> torch.Tensor | None:
        """M:N: a staging tensor shaped and typed as the engine's own target for `name` (stable across refits)."""
        live = self.live.shard_target(name)
        if live is None:
            return None
        have = self._shards.get(name)
        if have is None or have.shape != live.shape or have.dtype != live.dtype:
            have = self._shards[name] = torch.empty(live.shape, dtype=live.dtype, device=live.device)
        return have

    def load_shards(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        for name, t in tensors:
            have = self._shard_loads.get(name)
            if have is None or have.shape != t.shape or have.dtype != t.dtype:
                have = self._shard_loads[name] = torch.empty_like(t, memory_format=torch.contiguous_format)
            have.copy_(t)

    def held_shard(self, name: str) -> torch.Tensor | None:
        return self._shards.get(name, self._shard_loads.get(name))

    def held(self, name: str) -> tuple[torch.Tensor, Region | None] | None:
        """The staging tensor: the fingerprint check proves what `apply()` will load."""
        t = self._tensors.get(name)
        return None if t is None else (t, None)

    def fail(self, version: int, reason: str) -> None:
        with self._lock:
            self._ready = None
            self.live.note_staged(None)
            super().fail(version, reason)

    def publish(self, version: int) -> None:
        """Every worker committed `version` (the verdict is in): it is ready for `apply()`."""
        with self._lock:
            self._ready = version
            self.live.note_staged(version)

    def apply(self) -> int | None:
        """Load the ready version into the live engine and commit it there; returns it (None: nothing ready).
        A failure leaves the live engine failed and the version still ready, so a second call retries it."""
        if self._ready is None:  # the common case between steps: no lock, no work
            return None
        with self._lock:
            version = self._ready
            if version is None:
                return None
            live = self.live
            live.begin(version)
            try:
                self._load_live()
                live.commit(version)
            except Exception as e:  # noqa: BLE001 - any engine error fails the apply, kept as the cause
                live.fail(version, f"applying staged version {version} failed: {type(e).__name__}: {e}")
                live.note_staged(version)
                raise RefitError(f"applying staged version {version} failed: {type(e).__name__}: {e}") from e
            self._ready = None
        log.info("applied staged version %d", version)
        return version

    def _load_live(self) -> None:
        """The final copy: every staged tensor into the live engine, by the engine's own loaders."""
        if self._apply:
            self.live.load(self._apply)
        if self._shards:
            targets = [self.live.shard_target(n) for n in self._shards]
            if any(t is None for t in targets):
                raise RefitError("the engine no longer has a target for a staged M:N slice")
            key = tuple((t.data_ptr(), t.shape, t.stride(), t.dtype) for t in targets)  # type: ignore[union-attr]
            if self._shard_plan is None or self._shard_plan[0] != key:
                self._shard_plan = (key, CopyPlan(targets, list(self._shards.values())))  # type: ignore[arg-type]
            with torch.no_grad():
                self._shard_plan[1].run()
        if self._shard_loads:
            self.live.load_shards(list(self._shard_loads.items()))

    def release_buffers(self) -> None:
        """Drop the copy plans into the receive buffers; the staging tensors (own memory) stay applicable."""
        self._plans = {}
