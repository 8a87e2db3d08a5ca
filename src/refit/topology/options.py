"""A Sender's options, typed and checked once: the one declaration `Sender`, `MeshRefit` and the vLLM trainer
API share (their keyword arguments are a thin convenience over it)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import Any, Literal

from refit.checks.canary import Canary
from refit.layout.budget import NUM_SLOTS
from refit.layout.manifest import MAX_STAGES
from refit.stages import names, registered
from refit.stages.delta import Costs

Verify = Literal["fingerprint", "strict"] | None
VERIFY_MODES: tuple[Verify, ...] = (None, "fingerprint", "strict")
ZERO_COPY_TRANSPORTS = ("cuda-ipc", "nixl")
"""The transports that can share the source's own tensors (refit.topology.zero_copy)."""


@dataclass(frozen=True)
class SenderOptions:
    """`verify="fingerprint"` (the default; None turns it off): after the last bucket, each receiver compares a
    digest of what its engine now holds with a digest of the trainer's live tensors (after the wire cast), and
    the refit fails, naming the tensors that differ, unless all agree; tensors an engine cannot read back are
    reported (`RefitStats.unverified_names`) but accepted. `verify="strict"` verifies the same way and fails the
    refit (committed on no receiver) when any tensor went unverified.
    `zero_copy` (cuda-ipc or nixl): receivers copy straight from the source tensors, shared once per epoch (CUDA
    IPC handles; or registered with NIXL, which the engines READ one-sided, into their live tensors where they
    can); the source must hold contiguous tensors in their wire dtype (CUDA for cuda-ipc; CPU or CUDA for nixl).
    `elastic`: receivers beyond the first `num_receivers` may join at any time (they take part from the next
    refit), and one that leaves or dies is dropped while the refit goes on with the rest (`RefitStats.departed`
    names it); without it any lost receiver fails the refit and the session.
    `min_receivers` (elastic): a refit that commits on fewer receivers raises RefitError naming who left and why
    (those that committed hold the version); 0 lets a refit with no receiver at all pass.
    `delta`: send only the wire chunks that changed since the version every receiver committed (docs/PROTOCOL.md,
    Delta refits); each side keeps that committed wire image (one copy of the model in its wire dtype, on the
    transport's device). A new epoch, a joiner, a receiver that did not commit the image's version, or a refit
    after any failure is sent full; so is each bucket whose delta payload would exceed `delta_threshold` of its
    bytes (default 0.25: about an eighth of its values changed). A delta goes only where it pays: each bucket is
    sent full, uncompared (and kept), when the scan for its changed values is predicted to cost more than the link
    time its bytes would save, from `delta_costs` (default: measured in this session; `Costs.known` fixes them).
    Verification is unchanged: whole tensors against the trainer's live ones.
    `stages`: names of more stages (refit.stages.register) every refit's buckets pass through, after delta's;
    each engine process must have registered them too, or its handshake refuses the manifest naming them.
    `canary` (refit.checks.canary.Canary): every `canary.every` refits the engines score a fixed probe with what
    they compute with and compare it with the trainer's scores before they commit; a token beyond the tolerance
    fails the refit, named. Every engine must say how it scores a probe (READY), or the handshake refuses it."""

    transport: str = "shm"
    num_receivers: int = 1
    verify: Verify = "fingerprint"
    verify_checksum: bool = False
    num_slots: int = NUM_SLOTS
    zero_copy: bool = False
    port: int = 0
    elastic: bool = False
    min_receivers: int = 1
    delta: bool = False
    delta_threshold: float = 0.25
    delta_costs: Costs | None = None
    stages: tuple[str, ...] = ()
    canary: Canary | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "stages", tuple(self.stages))  # a list given is kept as the tuple it means
        for broken, message in RULES:
            if broken(self):
                raise ValueError(message(self))

    @property
    def stage_names(self) -> tuple[str, ...]:
        """Every stage of the session's refits, in the trainer's order."""
        return (("delta",) if self.delta else ()) + self.stages

    @classmethod
    def of(cls, options: SenderOptions | None, overrides: dict[str, Any]) -> SenderOptions:
        """`options` (default: all defaults) with the keyword arguments a caller gave on top."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise TypeError(f"unknown Sender option(s) {unknown}; the options are {sorted(known)}")
        return replace(options or cls(), **overrides)


Rule = tuple[Callable[[SenderOptions], bool], Callable[[SenderOptions], str]]
"""(is the options' combination broken, the message that says why and the fix)."""

RULES: tuple[Rule, ...] = (
    (lambda o: o.num_receivers < 1, lambda o: f"num_receivers ({o.num_receivers}) must be >= 1"),
    (lambda o: o.num_slots < 1, lambda o: f"num_slots ({o.num_slots}) must be >= 1 (2 overlaps packing with transfer)"),
    (
        lambda o: o.verify not in VERIFY_MODES,
        lambda o: f"verify must be one of {', '.join(map(repr, VERIFY_MODES))}, got {o.verify!r}",
    ),
    (lambda o: o.min_receivers < 0, lambda o: f"min_receivers ({o.min_receivers}) must be >= 0"),
    (
        lambda o: not o.elastic and o.min_receivers > o.num_receivers,
        lambda o: (
            f"min_receivers ({o.min_receivers}) is for an elastic Sender (elastic=True); a fixed one always "
            f"needs all num_receivers ({o.num_receivers})"
        ),
    ),
    (
        lambda o: o.elastic and o.zero_copy,
        lambda o: "elastic=True cannot be combined with zero_copy (a joiner would need the source handles)",
    ),
    (
        lambda o: o.delta and o.zero_copy,
        lambda o: "delta=True cannot be combined with zero_copy (zero-copy moves no bucket to shrink)",
    ),
    (
        lambda o: not 0.0 <= o.delta_threshold <= 1.0,
        lambda o: f"delta_threshold ({o.delta_threshold}) must be within 0..1 (a fraction of a bucket)",
    ),
    (
        lambda o: any(not registered(n) for n in o.stages),
        lambda o: (
            f"stages {[n for n in o.stages if not registered(n)]} are not registered (registered: {names()}); "
            "call refit.stages.register first"
        ),
    ),
    (lambda o: "delta" in o.stages, lambda o: "the delta stage is delta=True, not a name in stages"),
    (
        lambda o: len(set(o.stages)) != len(o.stages),
        lambda o: f"stages {list(o.stages)} name {_twice(o.stages)!r} twice; a manifest lists each stage once",
    ),
    (
        lambda o: len(o.stage_names) > MAX_STAGES,
        lambda o: f"{len(o.stage_names)} stages given (delta counts as one); a manifest lists at most {MAX_STAGES}",
    ),
    (
        lambda o: bool(o.stages) and o.zero_copy,
        lambda o: "stages cannot be combined with zero_copy (zero-copy moves no bucket to transform)",
    ),
    (
        lambda o: o.zero_copy and o.transport not in ZERO_COPY_TRANSPORTS,
        lambda o: f"zero_copy needs the cuda-ipc or nixl transport ({o.transport!r} given)",
    ),
)
"""Every rule SenderOptions checks at construction, in order: the first broken one is raised as ValueError."""


def _twice(names: tuple[str, ...]) -> str:
    return next(n for i, n in enumerate(names) if n in names[:i])


def stage_rules(added: tuple[str, ...], own: tuple[str, ...]) -> None:
    """The manifest's rules for the stages the engines' statements `added` before the session's `own`:
    ValueError names the broken one (a stage named twice, or more than the manifest lists)."""
    both = (*added, *own)
    if len(set(both)) != len(both):
        raise ValueError(
            f"what the engines state adds stage(s) {list(added)}, and the Sender's options name "
            f"{_twice(both)!r} too; a manifest lists each stage once: drop it from stages"
        )
    if len(both) > MAX_STAGES:
        raise ValueError(
            f"what the engines state adds stage(s) {list(added)} to the {len(own)} the Sender's options name; "
            f"a manifest lists at most {MAX_STAGES}: name fewer stages"
        )
