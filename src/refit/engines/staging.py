"""Staging: the engine side of a staged refit, over any Engine.

A staged refit writes version N+1 into staging memory (one tensor per name, in the dtype the engine holds)
while the engine goes on generating with N; the live engine is not touched, so it stays `current` at N
whatever happens to N+1. Once N+1 is verified (the fingerprint check reads the staging tensors) and every
worker committed it, it is *ready*; `apply()`, called by the engine loop between generation steps, loads
the staging tensors into the live engine through the engine's own `load` (a same-dtype local copy) and
commits N+1 there. The protocol drives this object in place of the engine (`Receiver(..., staged=True)`).

A refit that begins while a version is ready replaces it (N+2 overwrites the staged N+1, which is never
applied); one that fails leaves nothing ready. Staging costs one more copy of every tensor the engine loads.

Partial staging (`limit` below what the engine loads): the tensors first in bucket order that fit are staged;
the others would mix versions if written while the engine generates, so the receive side, at the first of
them, asks the engine loop for a pause and waits until the loop is inside `apply()`. The loop stays there
(the pause) while the rest arrives straight into the live engine, the refit is verified (staged names in
staging, the others in the live engine) and every worker's verdict is in; then it copies the staged part in
and commits. A refit that fails after writing into the live engine leaves it `failed`, never current.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from refit.engines.base import Engine, Region
from refit.errors import RefitError
from refit.layout.fp8 import BlockFormat
from refit.layout.manifest import Manifest
from refit.layout.packing import CopyPlan
from refit.layout.spec import Slice, TensorSpec, changes
from refit.log import get_logger

log = get_logger("receiver")


def staging_nbytes(specs: list[TensorSpec]) -> int:
    """Bytes a staged refit allocates for an engine stating `specs` (aliases share one tensor)."""
    return sum(s.nbytes for s in specs)


@dataclass(frozen=True, slots=True)
class Split:
    """How a bounded staging memory divides one epoch's tensors between staging and the pause."""

    staged_nbytes: int
    """Staging memory the staged tensors take (in the engine's dtypes): received while the engine generates."""
    total_nbytes: int
    """Staging memory the whole engine would take."""
    num_staged: int
    num_direct: int
    direct_wire_nbytes: int
    """Bytes on the wire of the other tensors: received into the live engine during the pause."""
    first_direct_bucket: int | None
    """The bucket at which the pause begins (None: everything is staged, no pause but the final copy)."""
    num_buckets: int

    def describe(self) -> str:
        """What the pause covers, in one line (logged once per epoch)."""
        if self.first_direct_bucket is None:
            return f"staging holds all {self.total_nbytes} bytes; the pause covers only the final copy"
        last = self.num_buckets - 1
        where = f"bucket {last}" if self.first_direct_bucket == last else f"buckets {self.first_direct_bucket}-{last}"
        rest = (
            f"{self.num_direct} tensor(s), {self.direct_wire_nbytes} bytes on the wire in {where}, straight into the "
            "live engine, the fingerprint check, every worker's verdict"
        )
        if not self.num_staged:
            return (
                f"staging holds none of {self.total_nbytes} bytes (the first tensor in bucket order does not fit); "
                f"the pause covers receiving all {rest}"
            )
        return (
            f"staging holds {self.staged_nbytes} of {self.total_nbytes} bytes ({self.num_staged} of "
            f"{self.num_staged + self.num_direct} tensors, the first in bucket order); the pause covers receiving "
            f"the other {rest} and the final copy of the {self.staged_nbytes} staged bytes"
        )


def plan_split(
    manifest: Manifest,
    limit: int | None,
    *,
    primary: dict[str, str] | None = None,
    dtypes: dict[str, torch.dtype] | None = None,
) -> tuple[Split, frozenset[str]]:
    """The staged tensors under `limit` bytes: those first in bucket order that fit, and the names loaded
    live during the pause. The pause begins at the first tensor that does not fit, so staging the earliest
    keeps it shortest (a later one that fits would still arrive during the pause, and cost a copy).
    `primary` and `dtypes` map the engine's names to the tensor they load into and its dtype (default: an
    engine holding the manifest's tensors in their wire dtypes); names outside `primary` are never loaded."""
    primary = primary if primary is not None else {n: p.name for p in manifest.entries for n in p.spec.names}
    dtypes = dtypes if dtypes is not None else {n: p.spec.dtype for p in manifest.entries for n in p.spec.names}
    direct: set[str] = set()
    staged: dict[str, int] = {}
    total: dict[str, int] = {}
    wire, first, num_staged, num_direct, staged_nbytes = 0, None, 0, 0, 0
    for p in sorted(manifest.entries, key=lambda p: (p.bucket, p.offset)):
        names = [n for n in p.spec.names if n in primary]
        if not names:
            continue
        keys = {primary[n] for n in names}
        cost = {k: p.spec.numel * dtypes[names[0]].itemsize for k in keys - total.keys()}
        total.update(cost)
        fits = first is None and (limit is None or staged_nbytes + sum(cost.values()) <= limit)
        if fits or keys & staged.keys():  # an engine tensor already staged takes this entry too: no second home
            staged.update(cost)
            staged_nbytes += sum(cost.values())
            num_staged += 1
            continue
        first = p.bucket if first is None else first
        direct.update(names)
        wire += p.nbytes
        num_direct += 1
    split = Split(staged_nbytes, sum(total.values()), num_staged, num_direct, wire, first, manifest.num_buckets)
    return split, frozenset(direct)


class Staging(Engine):
    """Stands in for `live` in the protocol: loads go to staging tensors; `apply()` moves them into `live`.

    The receive side (one thread) calls begin/load/commit/fail as for any engine, then `publish(version)`
    once every worker's verdict is in; the engine loop (another thread) calls `apply()`. A lock orders the
    two: a refit's begin waits for an apply in progress, and apply never reads a version still arriving."""

    def __init__(
        self, live: Engine, *, device: torch.device, limit: int | None = None, timeout_s: float = 120.0
    ) -> None:
        """`limit`: bytes of staging memory at most (None: no bound); `timeout_s`: how long the receive side
        of a partial staged refit waits for the engine loop to pause."""
        super().__init__()
        self.live = live
        self.device = device
        self.limit = limit
        self.timeout_s = timeout_s
        self.exact_shapes = live.exact_shapes
        self.optional_names = live.optional_names
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._tensors: dict[str, torch.Tensor] = {}
        """Staging tensor per name the sender loads under (an alias maps to its primary's tensor)."""
        self._built: list[TensorSpec] | None = None
        """The live engine's specs as of the last handshake (the dtypes staging tensors are made in)."""
        self._staged_for: list[TensorSpec] | None = None
        """`_built` when the refit now staged began: `apply` refuses a live engine laid out otherwise, even
        after a later handshake moved `_built` (the staged bytes keep the old dtypes)."""
        self._dtypes: dict[str, torch.dtype] = {}
        self._primary: dict[str, str] = {}
        self._plans: dict[int, tuple[list, CopyPlan, list]] = {}
        """Per list the receive path loads: (that list, the copy plan into staging, its direct part)."""
        self._apply: list[tuple[str, torch.Tensor]] = []
        """What `apply()` loads into `live`: every name as the receive path gave it, in order (one list
        object, so an engine that caches copy plans per list, like ModuleEngine, replays one plan)."""
        self._ready: int | None = None
        self._shards: dict[str, torch.Tensor] = {}
        """M:N: staging for the engine's shard targets (`shard_target`), copied into them by `apply()`."""
        self._shard_loads: dict[str, torch.Tensor] = {}
        """M:N: staging for the slices an engine takes through `load_shards`, replayed by `apply()`."""
        self._shard_plan: tuple[tuple, CopyPlan] | None = None
        self._direct: frozenset[str] = frozenset()
        """Partial staging: names loaded straight into `live` during the pause (the epoch's `split`)."""
        self._refilter = False
        """`_direct` changed: the next refit's begin drops the staging of those names."""
        self._seq = 0
        """Refits begun; the pause and its outcome are keyed by it (a retry reuses the version number)."""
        self._want: int | None = None
        """The refit (seq) whose receive side asks the engine loop to pause."""
        self._paused: int | None = None
        """The refit (seq) the engine loop is paused for, inside `apply()`."""
        self._live_begun: int | None = None
        """The refit (seq) that began writing into `live`: failing it fails `live`."""
        self._ended: tuple[int, str | None] = (0, None)
        """(seq, failure reason or None) of the last refit whose receive side ended."""

    @property
    def nbytes(self) -> int:
        """Bytes of staging memory allocated now."""
        every = [*self._tensors.values(), *self._shards.values(), *self._shard_loads.values()]
        return sum({id(t): t.numel() * t.element_size() for t in every}.values())

    @property
    def ready(self) -> int | None:
        """The version waiting for `apply()`, or None."""
        return self._ready

    @property
    def direct(self) -> frozenset[str]:
        """Partial staging: the names this epoch loads straight into the live engine, during the pause."""
        return self._direct

    def specs(self) -> list[TensorSpec]:
        specs = self._built = self.live.specs()
        self._dtypes = {n: s.dtype for s in specs for n in s.names}
        self._primary = {n: s.name for s in specs for n in s.names}
        self._plans = {}  # a handshake: the next refit's buffers and views are new
        return specs

    def split(self, manifest: Manifest) -> Split:
        """Choose this epoch's staged tensors (`plan_split` under `limit`, in the engine's dtypes). Call after
        `specs()`, before the epoch's first refit; staging tensors of names now loaded live are dropped when
        that refit begins (a version already staged, and not yet applied, still needs them)."""
        split, direct = plan_split(manifest, self.limit, primary=self._primary, dtypes=self._dtypes)
        with self._lock:
            self._refilter = direct != self._direct or self._refilter
            self._direct = direct
            self._plans = {}
        return split

    def _drop_direct(self) -> None:
        """(Lock held, at a refit's begin.) Forget the staging of every engine tensor now loaded live, under
        any of its names: a tied name left in `_apply` would overwrite the live load with an old copy."""
        if not self._refilter:
            return
        self._refilter = False
        gone = self._direct | {self._primary.get(n, n) for n in self._direct}
        kept = {n: t for n, t in self._tensors.items() if n not in gone and self._primary.get(n, n) not in gone}
        if len(kept) != len(self._tensors):
            self._tensors = kept
            self._apply = list(kept.items())

    def layout(self) -> list[TensorSpec]:
        return self.live.specs()  # the engine loop may have changed the live engine since the handshake

    def follow(self) -> None:
        """The refit under way stages for the layout the last `specs()` read (the receiver re-validated it and
        split again): the staging of names that `split` moved to the live load goes now, before any byte."""
        with self._lock:
            self._staged_for = self._built
            self._drop_direct()

    def _check_live(self, version: int) -> None:
        """Before writing into the live engine: its tensors must still be laid out as staging was built for,
        or the same-dtype copy of the verified bytes would not be what it holds (a lossy cast, a wrong shape)."""
        now = self.live.specs()
        if now is self._staged_for or now == self._staged_for:
            return
        raise RefitError(
            f"staged version {version} was not applied: the live engine's tensors changed since it was staged "
            f"({changes(self._staged_for, now)}), so it would not hold the verified bytes; the live weights are "
            f"untouched (version {self.live.weights.version}); version {version} stays staged until the next refit "
            "begins (it applies if they are put back first), and that refit validates the new layout and stages for it"
        )

    def shards(self) -> dict[str, Slice | None] | None:
        return self.live.shards()

    def formats(self) -> dict[str, BlockFormat]:
        return self.live.formats()

    def begin(self, version: int) -> None:
        with self._cond:
            # A partial refit's pause ends with its apply: the next refit waits for it, never drops it.
            self._cond.wait_for(lambda: self._paused is None)
            self._ready = None
            self.live.note_staged(None)
            self._drop_direct()
            self._staged_for = self._built
            self._seq += 1
            super().begin(version)

    def load(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Copy into the staging tensors (allocated at the first load of each name, in the engine's dtype);
        partial staging: the names not staged go into the live engine, once the engine loop has paused."""
        hit = self._plans.get(id(tensors))
        if hit is None or hit[0] is not tensors:
            plan, changed = self._plan(tensors)
            if changed:  # an older plan would write into a dropped staging tensor
                self._plans = {}
            direct = [(n, t) for n, t in tensors if n in self._direct]
            hit = self._plans[id(tensors)] = (tensors, plan, direct)
        with torch.no_grad():
            hit[1].run()
        if hit[2]:
            self._pause()
            self.live.load(hit[2])

    def _plan(self, tensors: list[tuple[str, torch.Tensor]]) -> tuple[CopyPlan, bool]:
        dst, src, done, changed = [], [], set(), False
        for name, t in tensors:
            key = self._primary.get(name)
            if key is None or name in self._direct:  # a waived name (never loaded), or one loaded live
                continue
            have = self._tensors.get(key)
            dtype = self._dtypes.get(name, t.dtype)  # the engine's, as of the last handshake
            if have is None or have.shape != t.shape or have.dtype != dtype:
                have = self._tensors[key] = torch.empty(t.shape, dtype=dtype, device=self.device)
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

    def _pause(self) -> None:
        """Receive side, partial staging: wait until the engine loop is paused in `apply()`, then begin the
        live engine (from here a failure fails it)."""
        with self._cond:
            seq, version = self._seq, self.weights.target
            assert version is not None
            if self._live_begun == seq:
                return
            self._want = seq
            self._cond.notify_all()
            if not self._cond.wait_for(lambda: self._paused == seq, timeout=self.timeout_s):
                self._want = None
                raise RefitError(
                    f"staged refit of version {version}: staging holds only part of the model, and the engine "
                    f"loop did not pause within {self.timeout_s:g} s to receive the rest into the live weights; "
                    "call receiver.apply_staged() between generation steps (or raise staging_bytes)"
                )
            self._check_live(version)  # paused: the engine loop changes nothing from here on
            self.live.begin(version)
            self._live_begun = seq

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
        """The staging tensor: the fingerprint check proves what `apply()` will load (partial staging: the
        live engine's tensor for a name loaded there)."""
        t = self._tensors.get(name)
        if t is not None:
            return t, None
        return self.live.held(name) if name in self._direct else None

    def fail(self, version: int, reason: str) -> None:
        with self._cond:
            self._ready = None
            self.live.note_staged(None)
            super().fail(version, reason)
            if self._live_begun == self._seq:  # partial: the live engine holds part of it, so it is failed too
                self.live.fail(version, reason)
            self._want = None
            self._ended = (self._seq, reason)
            self._cond.notify_all()

    def abort(self, reason: str) -> None:
        """The receive side stopped (the session ended, or an unexpected error) with a refit under way: fail
        it, so that a paused engine loop never waits for it."""
        w = self.weights
        if self._ended[0] < self._seq:  # begun and neither published nor failed (it may have committed here)
            version = w.target if w.target is not None else w.version
            assert version is not None
            self.fail(version, reason)

    def publish(self, version: int) -> None:
        """Every worker committed `version` (the verdict is in): it is ready for `apply()`."""
        with self._cond:
            self._ready = version
            self.live.note_staged(version)
            self._ended = (self._seq, None)
            self._cond.notify_all()

    def apply(self) -> int | None:
        """Load the ready version into the live engine and commit it there; returns it (None: nothing ready).
        A failure leaves the live engine failed and the version still ready, so a second call retries it.
        Partial staging: when the receive side asks for the pause, stay here until the refit ends."""
        if self._ready is None and self._want is None:  # the common case between steps: no lock, no work
            return None
        with self._cond:
            if self._want is not None:
                version: int | None = self._paused_apply()
            else:
                version = self._ready
                if version is None:
                    return None
                self._check_live(version)
                self.live.begin(version)
                self._install(version)
        log.info("applied staged version %d", version)
        return version

    def _paused_apply(self) -> int:
        """The pause (lock held, released while waiting): the receive side writes the rest into the live
        engine (it began it) and ends the refit; then the staged part is copied in and the version committed."""
        seq, self._want = self._want, None
        self._paused = seq
        self._cond.notify_all()
        try:
            self._cond.wait_for(lambda: self._ended[0] >= seq)  # type: ignore[operator]
            reason, version = self._ended[1], self._ready
            if (reason is not None or version is None) and self._live_begun != seq:
                raise RefitError(
                    f"staged refit of version {self.weights.target} failed during the pause, before writing into the "
                    f"live engine: {reason}; the live weights are untouched"
                )
            if reason is not None or version is None:
                raise RefitError(
                    f"staged refit of version {self.weights.target} failed during the pause, after writing into "
                    f"the live engine: {reason}; its weights are failed (ensure_current refuses them) until a "
                    "refit succeeds"
                )
            self._install(version)
            return version
        finally:
            self._paused = None
            self._cond.notify_all()

    def _install(self, version: int) -> None:
        """The final copy into the begun live engine, and its commit; a failure keeps the version ready."""
        live = self.live
        try:
            self._load_live()
            live.commit(version)
        except Exception as e:  # noqa: BLE001 - any engine error fails the apply, kept as the cause
            live.fail(version, f"applying staged version {version} failed: {type(e).__name__}: {e}")
            live.note_staged(version)
            raise RefitError(f"applying staged version {version} failed: {type(e).__name__}: {e}") from e
        self._ready = None

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
