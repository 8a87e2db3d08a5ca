"""Shard statements: the one slice of each checkpoint tensor a vLLM worker reads, from its recording.

The recording says, for every copy a worker's loaders make, which elements of the full checkpoint
tensor it reads (a strided view of the flat, row-major tensor). Here those views are turned into
boxes of the tensor's index space, their union is checked to be exactly one slice along one dim
(`Slice`), and each view is re-addressed relative to that slice, so a worker can load its slice
alone. Anything that is not exactly one slice is stated whole (None): always safe, since the whole
tensor contains every slice. Pure: no vLLM, no memory touched.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from refit.integrations.vllm.recording import Strided
from refit.layout.spec import Slice

Box = tuple[tuple[int, int], ...]
"""Per dim of a tensor, the [lo, hi) range of indices a view covers."""


def _contiguous(shape: Sequence[int]) -> list[int]:
    out = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        out[d] = out[d + 1] * shape[d + 1]
    return out


def _unravel(flat: int, shape: Sequence[int]) -> list[int]:
    out = []
    for c in _contiguous(shape):
        out.append(flat // c)
        flat %= c
    return out


def _canonical(sizes: Sequence[int], strides: Sequence[int], offset: int) -> tuple:
    """The element set of a view in one normal form: size-1 and repeating dims dropped, dims by
    descending stride, dims that continue each other folded into one."""
    dims = sorted(((s, n) for n, s in zip(sizes, strides) if n > 1 and s > 0), reverse=True)
    out: list[list[int]] = []
    for s, n in reversed(dims):  # innermost first
        if out and out[-1][0] * out[-1][1] == s:
            out[-1][1] *= n
        else:
            out.append([s, n])
    return offset, tuple((s, n) for s, n in reversed(out))


def box(view: Strided, shape: Sequence[int]) -> Box | None:
    """The box of a `shape` tensor whose elements are exactly those `view` reads, or None."""
    if any(s < 0 for s in view.stride) or view.numel == 0:
        return None
    last = view.offset + sum((n - 1) * s for n, s in zip(view.size, view.stride))
    if view.offset < 0 or last >= math.prod(shape):
        return None
    lo, hi = _unravel(view.offset, shape), _unravel(last, shape)
    if any(a > b for a, b in zip(lo, hi)):
        return None
    extent = [b - a + 1 for a, b in zip(lo, hi)]
    if _canonical(extent, _contiguous(shape), view.offset) != _canonical(view.size, view.stride, view.offset):
        return None
    return tuple((a, b + 1) for a, b in zip(lo, hi))


def localize(view: Strided, shape: Sequence[int], part: Slice) -> Strided | None:
    """`view` (into the full, flat `shape` tensor) addressed into the flat, row-major slice `part`
    instead, when every element it reads lies in the slice and each of its steps moves by a fixed,
    carry-free step of indices; None otherwise."""
    if math.prod(shape[: part.dim]) == 1:  # the slice is one flat range: any view inside it only shifts
        lo, inner = part.start * _contiguous(shape)[part.dim], math.prod(shape[part.dim + 1 :])
        last = view.offset + sum((n - 1) * s for n, s in zip(view.size, view.stride))
        if min(view.stride, default=0) < 0 or view.offset < lo or last >= lo + part.length * inner:
            return None
        return Strided(tuple(view.size), tuple(view.stride), view.offset - lo)
    local_cs = _contiguous(slice_shape(shape, part))
    origin = _unravel(view.offset, shape)
    reach, strides = list(origin), []
    for n, s in zip(view.size, view.stride):
        if n == 1:
            strides.append(0)
            continue
        if s < 0 or s >= math.prod(shape):
            return None
        step = _unravel(s, shape)
        reach = [r + (n - 1) * e for r, e in zip(reach, step)]
        strides.append(sum(e * c for e, c in zip(step, local_cs)))
    if any(r >= b for r, b in zip(reach, shape)):
        return None  # a step carries into the next dim: the view is not linear in the slice's indices
    if origin[part.dim] < part.start or reach[part.dim] >= part.start + part.length:
        return None
    origin[part.dim] -= part.start
    return Strided(tuple(view.size), tuple(strides), sum(o * c for o, c in zip(origin, local_cs)))


def statement(views: Sequence[Strided], shape: Sequence[int]) -> tuple[Slice | None, str]:
    """The one slice of a `shape` tensor that `views` read together (None: the whole tensor), and why
    it is stated whole when the views read something narrower that is not one slice ('' otherwise)."""
    if not views or not shape:
        return None, ""
    parts: dict[int, list[tuple[int, int]]] = {}
    for v in views:
        b = box(v, shape)
        if b is None:
            return None, f"a copy reads {v}, which is not a box of the tensor"
        narrow = [d for d, (lo, hi) in enumerate(b) if (lo, hi) != (0, shape[d])]
        if len(narrow) > 1:
            return None, f"a copy reads the box {b}, narrow along dims {narrow}"
        if narrow:
            parts.setdefault(narrow[0], []).append(b[narrow[0]])
        else:
            return None, ""  # one copy reads it all: the union is the whole tensor
    if len(parts) > 1:
        return None, f"copies read slices along dims {sorted(parts)}"
    ((dim, ranges),) = parts.items()
    ranges.sort()
    start, stop = ranges[0]
    for lo, hi in ranges[1:]:
        if lo > stop:
            return None, f"copies read rows [{start}, {stop}) and [{lo}, {hi}) of dim {dim}, with a gap"
        stop = max(stop, hi)
    if (start, stop) == (0, shape[dim]):
        return None, ""
    part = Slice(dim, start, stop - start)
    if any(localize(v, shape, part) is None for v in views):
        return None, f"a copy's view cannot be addressed within {part}"
    return part, ""


def slice_shape(shape: Sequence[int], part: Slice | None) -> tuple[int, ...]:
    """The shape of `part` of a `shape` tensor (the whole shape for None)."""
    out = list(shape)
    if part is not None:
        out[part.dim] = part.length
    return tuple(out)
