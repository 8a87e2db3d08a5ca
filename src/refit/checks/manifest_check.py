"""Validation: compares a manifest with what an engine expects and reports every difference at once."""

from __future__ import annotations

import fnmatch
import operator
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import compress

from refit.dtypes import dtype_from_name, dtype_name, lossless
from refit.layout.manifest import gc_paused
from refit.layout.spec import TensorSpec
from refit.log import get_logger

log = get_logger("validation")

_NAME, _SHAPE, _DTYPE, _ALIASES = (operator.attrgetter(f) for f in ("name", "shape", "dtype", "aliases"))

_SHOWN = 20


@dataclass(frozen=True, slots=True)
class Report:
    """Sorted names that differ between the sender's manifest and the engine."""

    missing: tuple[str, ...] = ()
    """The engine expects these; the sender does not send them."""
    unexpected: tuple[str, ...] = ()
    """The sender sends these; the engine has no such tensor."""
    mismatched: tuple[tuple[str, str, str], ...] = ()
    """(name, what the engine holds, what the sender sends) where shape differs, the dtype cannot be held
    exactly, or the engine ties names into one storage that the sender sends as separate tensors."""
    waived: tuple[str, ...] = ()
    """Names the user waived (`ignore=`): never loaded, never checked; reported, not failing."""
    stages: tuple[str, ...] = ()
    """Stages (refit.stages) the trainer's refits pass through that this engine's process has not registered."""
    unsynced: tuple[str, ...] = ()
    """State the engine computes itself (non-persistent buffers) that the sender does not send: it stays as
    the engine made it. Reported (logged at WARNING on both sides), not failing; send it or waive it."""

    @property
    def ok(self) -> bool:
        return not (self.missing or self.unexpected or self.mismatched or self.stages)

    def to_json(self) -> dict:
        return (
            {
                "missing": list(self.missing),
                "unexpected": list(self.unexpected),
                "mismatched": [list(m) for m in self.mismatched],
                "waived": list(self.waived),
            }
            | ({"stages": list(self.stages)} if self.stages else {})
            | ({"unsynced": list(self.unsynced)} if self.unsynced else {})
        )

    @classmethod
    def from_json(cls, obj: dict) -> Report:
        def names(key: str) -> tuple[str, ...]:
            v = obj.get(key, [])
            return tuple(str(x) for x in v) if isinstance(v, list) else ()

        mism = obj.get("mismatched", [])
        rows = (
            tuple(tuple(str(x) for x in m) for m in mism if isinstance(m, list) and len(m) == 3)
            if isinstance(mism, list)
            else ()
        )
        return cls(names("missing"), names("unexpected"), rows, names("waived"), names("stages"), names("unsynced"))  # type: ignore[arg-type]

    def message(self) -> str:
        stages = (
            f"the trainer's refits pass through stage(s) {_list(self.stages)}, which the engine's process has not "
            "registered; nothing was loaded. Fix: call refit.stages.register(name, cls) for each in the engine's "
            "process before its Receiver connects, as the trainer's process does"
        )
        if self.stages and not (self.missing or self.unexpected or self.mismatched):
            return stages
        parts = []
        if self.missing:
            parts.append(f"{len(self.missing)} missing (engine expects, sender lacks): {_list(self.missing)}")
        if self.unexpected:
            parts.append(f"{len(self.unexpected)} unexpected (sender sends, engine lacks): {_list(self.unexpected)}")
        if self.mismatched:
            ranked = sorted(self.mismatched, key=lambda m: _cause(m[1], m[2])[0])  # stable: shapes first
            rows = [f"{n}: engine holds {e}, sender sends {g}{_cause(e, g)[1]}" for n, e, g in ranked]
            parts.append(f"{len(self.mismatched)} mismatched: {_list(rows)}")
        return (
            "manifest does not match the engine; nothing was loaded. " + "; ".join(parts) + ". "
            "Fix: send the names the engine uses (or pass name_map), with its shapes and a dtype it can hold exactly"
            + (self._waiver() if self.unexpected else ".")
            + (self._leave_out() if self.missing else "")
            + (f" Also, {stages}." if self.stages else "")
        )

    def unsynced_message(self) -> str:
        """What the engine keeps of its own, with the two fixes ('' when nothing)."""
        if not self.unsynced:
            return ""
        shown = ", ".join(map(repr, self.unsynced[:3])) + (", ..." if len(self.unsynced) > 3 else "")
        return (
            f"the engine holds {len(self.unsynced)} non-persistent buffer(s) the trainer does not send, which "
            f"keep the values the engine computed: {_list(self.unsynced)}. If the trainer changes them, send them "
            f"(ModuleSource(model, non_persistent=True) sends a module's); if they are computed from the config, "
            f"waive them on the engine with ignore=[{shown}]"
        )

    def _leave_out(self) -> str:
        shown = ", ".join(map(repr, self.missing[:3])) + (", ..." if len(self.missing) > 3 else "")
        return (
            f" An engine tensor no refit should write (a buffer the engine computes itself) can be waived on the "
            f"engine with ignore=[{shown}]."
        )

    def _waiver(self) -> str:
        shown = ", ".join(map(repr, self.unexpected[:3])) + (", ..." if len(self.unexpected) > 3 else "")
        return (
            f"; or, to send tensors the engine will not load on purpose, waive them on the engine with "
            f"ignore=[{shown}] (names or fnmatch patterns)."
        )


def _cause(engine: str, sent: str) -> tuple[int, str]:
    """Which difference of a mismatched row fails it, and its rank in the report (shapes first): a dtype the
    engine holds exactly beside a shape difference is not the cause. Rows not of the form '[shape] dtype'
    (tie conflicts) rank last, unmarked."""
    try:
        (e_shape, e_dtype), (s_shape, s_dtype) = (d.rsplit(" ", 1) for d in (engine, sent))
        exact = e_dtype == s_dtype or lossless(dtype_from_name(s_dtype), dtype_from_name(e_dtype))
    except ValueError:
        return 2, ""
    if e_shape == s_shape:
        return 1, " (dtype: the engine cannot hold it exactly)"
    if exact:
        return 0, " (shape)" if e_dtype == s_dtype else " (shape; the dtype alone would load exactly)"
    return 0, " (shape, and the dtype cannot be held exactly)"


def _list(items: Iterable[str]) -> str:
    items = list(items)
    more = f", ... and {len(items) - _SHOWN} more" if len(items) > _SHOWN else ""
    return ", ".join(items[:_SHOWN]) + more


def _describe(spec: TensorSpec) -> str:
    return f"{list(spec.shape)} {dtype_name(spec.dtype)}"


def waived(name: str, patterns: Iterable[str]) -> bool:
    """Whether `name` is one the user waived: equal to a pattern or matching it (fnmatch-style)."""
    return any(name == p or (_GLOB & set(p) and fnmatch.fnmatchcase(name, p)) for p in patterns)


_GLOB = frozenset("*?[")


def validate(
    sent: Iterable[TensorSpec],
    expected: Iterable[TensorSpec],
    *,
    exact_shapes: bool = True,
    optional: frozenset[str] = frozenset(),
    stages: Iterable[str] = (),
    computed: frozenset[str] = frozenset(),
) -> Report:
    """What differs between the specs a sender sends and the specs an engine holds (column by column: a
    manifest may list 100k tensors).

    `optional`: names or fnmatch patterns the user waived (`ignore=`): left out of every check and
    reported as waived (logged at WARNING). An expected spec with aliases is a tie in the engine (one
    storage under several names): sending any of its names is enough, sending two of them as
    separate tensors (different sources, so the last write would win) is refused. `stages`: the manifest's
    stages this engine's process has not registered (each fails the report). `computed`: names the engine holds
    but computes itself (non-persistent buffers): loaded and checked when sent, reported as unsynced when not."""
    sent, expected = list(sent), list(expected)
    ties = [spec.names for spec in expected if spec.aliases]
    groups = _sent_groups(sent) if ties else {}
    sent, expected = _expanded(sent), _expanded(expected)
    skip = _waived({s.name for s in sent} | {s.name for s in expected}, optional) if optional else set()
    if skip:
        sent, expected = [s for s in sent if s.name not in skip], [s for s in expected if s.name not in skip]
    with gc_paused():
        got, want = _by_name(sent), _by_name(expected)
        common = list(filter(want.__contains__, got))  # in the sender's order: memory read in sequence
        g, w = list(map(got.__getitem__, common)), list(map(want.__getitem__, common))
        recast = compress(range(len(common)), map(operator.is_not, map(_DTYPE, g), map(_DTYPE, w)))
        bad = {common[i] for i in recast if not lossless(g[i].dtype, w[i].dtype)}
        if exact_shapes:
            bad.update(compress(common, map(operator.ne, map(_SHAPE, g), map(_SHAPE, w))))
    bad = sorted(bad)
    mismatched = [
        (n, _describe(want[n]) if exact_shapes else dtype_name(want[n].dtype), _describe(got[n])) for n in bad
    ]
    mismatched += _tie_conflicts(ties, groups, got.keys())
    tied = {n for names in ties for n in names}
    covered = {n for names in ties if got.keys() & set(names) for n in names}
    absent = want.keys() - got.keys() - covered - (tied - covered - {t[0] for t in ties})
    missing = tuple(sorted(absent - computed))
    unexpected = tuple(sorted(got.keys() - want.keys()))
    unsynced = tuple(sorted(absent & computed))
    return Report(missing, unexpected, tuple(mismatched), tuple(sorted(skip)), tuple(stages), unsynced)


def _expanded(specs: list[TensorSpec]) -> list[TensorSpec]:
    return [x for spec in specs for x in spec.expanded()] if any(map(_ALIASES, specs)) else specs


def _waived(names: set[str], patterns: frozenset[str]) -> set[str]:
    if not patterns:
        return set()
    skip = {n for n in names if waived(n, patterns)}
    if skip:
        log.warning(
            "%d tensor name(s) waived by ignore= (neither loaded nor checked): %s", len(skip), _list(sorted(skip))
        )
    return skip


def _sent_groups(sent: list[TensorSpec]) -> dict[str, int]:
    """Which sent entry (source) each sent name comes from: an entry's aliases share its source."""
    return {name: entry for entry, spec in enumerate(sent) for name in spec.names}


def _tie_conflicts(
    ties: list[tuple[str, ...]], groups: dict[str, int], sent: Iterable[str]
) -> list[tuple[str, str, str]]:
    sent = set(sent)
    rows = []
    for names in ties:
        here = [n for n in names if n in sent]
        if len({groups[n] for n in here}) > 1:
            rows.append(
                (
                    here[-1],
                    f"one storage with {', '.join(n for n in here if n != here[-1])} (tied in the engine)",
                    "a separate tensor (the last write would win); fix: tie the trainer's weights, or send one "
                    f"of them and waive the other with ignore=[{here[-1]!r}]",
                )
            )
    return rows


def _by_name(specs: Iterable[TensorSpec]) -> dict[str, TensorSpec]:
    specs = list(specs)
    return dict(zip(map(_NAME, specs), specs))
