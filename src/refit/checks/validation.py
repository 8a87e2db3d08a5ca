"""Validation: compares a manifest with what an engine expects and reports every difference at once."""

from __future__ import annotations

import operator
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import compress

from refit.dtypes import dtype_name, lossless
from refit.layout.manifest import gc_paused
from refit.layout.spec import TensorSpec

_NAME, _SHAPE, _DTYPE = (operator.attrgetter(f) for f in ("name", "shape", "dtype"))

_SHOWN = 20


@dataclass(frozen=True, slots=True)
class Report:
    """Sorted names that differ between the sender's manifest and the engine."""

    missing: tuple[str, ...] = ()
    """The engine expects these; the sender does not send them."""
    unexpected: tuple[str, ...] = ()
    """The sender sends these; the engine has no such tensor."""
    mismatched: tuple[tuple[str, str, str], ...] = ()
    """(name, what the engine holds, what the sender sends) where shape differs or the dtype cannot be held exactly."""

    @property
    def ok(self) -> bool:
        return not (self.missing or self.unexpected or self.mismatched)

    def to_json(self) -> dict:
        return {
            "missing": list(self.missing),
            "unexpected": list(self.unexpected),
            "mismatched": [list(m) for m in self.mismatched],
        }

    @classmethod
    def from_json(cls, obj: dict) -> Report:
        def names(key: str) -> tuple[str, ...]:
            v = obj.get(key, [])
            return tuple(str(x) for x in v) if isinstance(v, list) else ()

        mism = obj.get("mismatched", [])
        rows = (
            tuple(tuple(str(x) for x in m)[:3] for m in mism if isinstance(m, list)) if isinstance(mism, list) else ()
        )
        return cls(names("missing"), names("unexpected"), rows)  # type: ignore[arg-type]

    def message(self) -> str:
        parts = []
        if self.missing:
            parts.append(f"{len(self.missing)} missing (engine expects, sender lacks): {_list(self.missing)}")
        if self.unexpected:
            parts.append(f"{len(self.unexpected)} unexpected (sender sends, engine lacks): {_list(self.unexpected)}")
        if self.mismatched:
            rows = [f"{n}: engine holds {e}, sender sends {g}" for n, e, g in self.mismatched]
            parts.append(f"{len(self.mismatched)} mismatched: {_list(rows)}")
        return (
            "manifest does not match the engine; nothing was loaded. " + "; ".join(parts) + ". "
            "Fix: send the names the engine uses (or pass name_map), with its shapes and a dtype it can hold exactly."
        )


def _list(items: Iterable[str]) -> str:
    items = list(items)
    more = f", ... and {len(items) - _SHOWN} more" if len(items) > _SHOWN else ""
    return ", ".join(items[:_SHOWN]) + more


def _describe(spec: TensorSpec) -> str:
    return f"{list(spec.shape)} {dtype_name(spec.dtype)}"


def validate(
    sent: Iterable[TensorSpec],
    expected: Iterable[TensorSpec],
    *,
    exact_shapes: bool = True,
    optional: frozenset[str] = frozenset(),
) -> Report:
    """What differs between the specs a sender sends and the specs an engine holds (column by column: a
    manifest may list 100k tensors)."""
    with gc_paused():
        got, want = _by_name(sent), _by_name(expected)
        common = list(filter(want.__contains__, got))  # in the sender's order: memory read in sequence
        g, w = list(map(got.__getitem__, common)), list(map(want.__getitem__, common))
        recast = compress(range(len(common)), map(operator.is_not, map(_DTYPE, g), map(_DTYPE, w)))
        bad = {common[i] for i in recast if not lossless(g[i].dtype, w[i].dtype)}
        if exact_shapes:
            bad.update(compress(common, map(operator.ne, map(_SHAPE, g), map(_SHAPE, w))))
    bad = sorted(bad)
    mismatched = tuple(
        (n, _describe(want[n]) if exact_shapes else dtype_name(want[n].dtype), _describe(got[n])) for n in bad
    )
    missing = tuple(sorted(want.keys() - got.keys() - optional))
    return Report(missing, tuple(sorted(got.keys() - want.keys() - optional)), mismatched)


def _by_name(specs: Iterable[TensorSpec]) -> dict[str, TensorSpec]:
    specs = list(specs)
    return dict(zip(map(_NAME, specs), specs))
