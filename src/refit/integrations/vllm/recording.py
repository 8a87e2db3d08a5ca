"""Recording: where vLLM's own weight loaders put each checkpoint tensor's bytes, as strided copies.

Found once per plan, by running vLLM's own `model.load_weights` (its name mapping, fused q/k/v and gate/up
loaders, expert stacking, tensor-parallel slicing) on recording tensors: every layer is put back in
its checkpoint ("model") format on the meta device in float64, and each checkpoint name is loaded
from a CPU tensor whose values encode every element's flat index. A dispatch mode catches each copy
into a recording tensor and runs none of them: the copy's destination view says where the bytes
land, its source values say which bytes. Every refit then replays those copies from the received
bucket views as plain batched copies.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from types import MethodType
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_MARK = 0.25
"""Added to every encoded index: a loader that scales or shifts values leaves a different fraction."""


@dataclass(frozen=True, slots=True)
class Strided:
    """An `as_strided` view relative to a tensor's own storage offset."""

    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int

    def of(self, t: torch.Tensor) -> torch.Tensor:
        return t.as_strided(self.size, self.stride, t.storage_offset() + self.offset)

    @property
    def numel(self) -> int:
        return math.prod(self.size)


@dataclass(frozen=True, slots=True)
class Placement:
    """One copy: `src` of checkpoint tensor `name` (flat, contiguous) into `dst` of `module.param`."""

    name: str
    module: str
    param: str
    dst: Strided
    src: Strided


@dataclass(slots=True)
class Recording:
    """What running vLLM's loaders on recording tensors showed."""

    placements: list[Placement] = field(default_factory=list)
    fills: list[tuple[str, str, Strided, float]] = field(default_factory=list)
    """Constants a loader writes (vocabulary padding): (module, param, where, value)."""
    bad: dict[str, str] = field(default_factory=dict)
    """module -> why its loads cannot be replayed as copies."""
    rejected: dict[str, str] = field(default_factory=dict)
    """checkpoint name -> the error vLLM's loader raised for it."""
    writes: dict[str, set[str]] = field(default_factory=dict)
    """checkpoint name -> the modules its loading wrote to (copied, filled or otherwise)."""


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _writes_first_arg(func: Any) -> bool:
    schema = getattr(func, "_schema", None)
    if schema is None or not schema.arguments:
        return False
    alias = schema.arguments[0].alias_info
    return alias is not None and alias.is_write


class _Catcher(TorchDispatchMode):
    """Records copies into recording (meta) tensors and blocks every write to the live model."""

    def __init__(self, recs: dict[int, tuple[str, str]], live: dict[int, str], out: Recording) -> None:
        super().__init__()
        self.recs, self.live, self.out = recs, live, out
        self.name, self.numel = "", 0
        self.enc: torch.Tensor | None = None
        """The encoded tensor being loaded: a copy from a view of it needs no values read."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        dst = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if dst is None or not _writes_first_arg(func):
            return func(*args, **kwargs)
        enc = self.enc
        if enc is not None and not dst.is_meta and dst.untyped_storage().data_ptr() == enc.untyped_storage().data_ptr():
            self.enc = None  # the loader writes its input: from now on read the values, do not trust views
        if dst.is_meta and _storage_key(dst) in self.recs:
            self._record(func, dst, args)
            return dst
        if not dst.is_meta and dst.numel() and dst.untyped_storage().data_ptr() in self.live:
            module = self.live[dst.untyped_storage().data_ptr()]
            self.out.writes.setdefault(self.name, set()).add(module)
            self.out.bad.setdefault(module, f"loading {self.name} writes a live tensor directly ({func})")
            return dst
        return func(*args, **kwargs)

    def _view_of_input(self, src: torch.Tensor, dst: torch.Tensor) -> Strided | None:
        """Where a view of the encoded input reads (a pure move, as its geometry says); None for other tensors."""
        enc = self.enc
        if enc is None or src.dtype != torch.float64 or src.device.type != "cpu":
            return None
        if src.untyped_storage().data_ptr() != enc.untyped_storage().data_ptr():
            return None
        b = torch.broadcast_to(src, dst.shape)
        return Strided(tuple(b.shape), tuple(b.stride()), b.storage_offset() - enc.storage_offset())

    def _record(self, func: Any, dst: torch.Tensor, args: tuple) -> None:
        module, param = self.recs[_storage_key(dst)]
        self.out.writes.setdefault(self.name, set()).add(module)
        where = Strided(tuple(dst.shape), tuple(dst.stride()), dst.storage_offset())
        aten = torch.ops.aten
        if func is aten.copy_.default and isinstance(args[1], torch.Tensor) and not args[1].is_meta:
            src = self._view_of_input(args[1], dst) or solve(
                torch.broadcast_to(args[1], dst.shape).to("cpu", torch.float64), self.numel
            )
            if src is None:
                self.out.bad.setdefault(module, f"the loader transforms the values of {self.name}")
            else:
                self.out.placements.append(Placement(self.name, module, param, where, src))
        elif func in (aten.fill_.Scalar, aten.zero_.default):
            self.out.fills.append((module, param, where, float(args[1]) if len(args) > 1 else 0.0))
        else:
            self.out.bad.setdefault(module, f"the loader of {self.name} runs {func} on {param}")


def solve(values: torch.Tensor, numel: int) -> Strided | None:
    """The strided view of a flat `numel`-element tensor whose encoded indices are `values`, if any."""
    w = values - _MARK
    if w.numel() == 0 or not torch.equal(w, w.round()) or w.min() < 0 or w.max() >= numel:
        return None
    flat = w.reshape(-1)
    origin = int(flat[0])
    strides = []
    for d, n in enumerate(w.shape):
        step = [0] * w.dim()
        step[d] = 1 if n > 1 else 0
        strides.append(int(w[tuple(step)]) - origin if n > 1 else 0)
    if any(s < 0 for s in strides):
        return None
    expect = torch.full(w.shape, float(origin), dtype=torch.float64)
    for d, (n, s) in enumerate(zip(w.shape, strides)):
        shape = [1] * w.dim()
        shape[d] = n
        expect = expect + (torch.arange(n, dtype=torch.float64) * s).view(shape)
    return Strided(tuple(w.shape), tuple(strides), origin) if torch.equal(expect, w) else None


def templates(layer: torch.nn.Module, restore: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoint-format meta tensors for every parameter of `layer` (vLLM's recorded ones, else the live one)."""
    from vllm.model_executor.model_loader.reload.sanitize import layer_ref_sentinel

    out = {}
    for name, live in layer._parameters.items():
        if live is None:
            continue
        src = restore.get(name, live)
        meta = torch.empty_strided(tuple(src.shape), tuple(src.stride()), dtype=src.dtype, device="meta")
        meta.__class__ = src.__class__
        attrs = dict(src.__dict__)
        for k, v in attrs.items():
            if isinstance(v, MethodType) and v.__self__ is layer_ref_sentinel:
                attrs[k] = v.__func__.__get__(layer)
        for key in ("weight_loader", "_weight_loader"):  # vLLM's parameters keep theirs in `_weight_loader`
            while getattr(attrs.get(key), "__name__", "") == "online_process_loader":
                attrs[key] = attrs[key].__wrapped__  # vLLM's reload wrapper, left behind on its metadata
            if isinstance(attrs.get(key), MethodType) and attrs[key].__self__ is layer_ref_sentinel:
                attrs[key] = attrs[key].__func__.__get__(layer)
        meta.__dict__ = attrs
        out[name] = meta
    return out


def _recording_tensor(template: torch.Tensor) -> torch.Tensor:
    t = torch.empty_strided(tuple(template.shape), tuple(template.stride()), dtype=torch.float64, device="meta")
    t.__class__ = template.__class__
    t.__dict__ = dict(template.__dict__)
    return t


def record(
    model: torch.nn.Module,
    layers: dict[str, tuple[torch.nn.Module, dict[str, torch.Tensor]]],
    shapes: dict[str, tuple[int, ...]],
    *,
    load: Callable[[str, torch.Tensor], Any] | None = None,
) -> Recording:
    """Run `model.load_weights` (or `load(name, tensor)`) once per checkpoint name on recording tensors,
    with `layers` (module name -> (module, checkpoint-layout templates)) swapped in; the live model is untouched."""
    load = load or (lambda name, t: model.load_weights([(name, t)]))
    out = Recording()
    live: dict[int, str] = {}
    for module, layer in model.named_modules():
        for t in [*layer._parameters.values(), *layer._buffers.values()]:
            if t is not None and not t.is_meta and t.numel():
                live.setdefault(t.untyped_storage().data_ptr(), module)
    stash: dict[str, dict[str, Any]] = {}
    recs: dict[int, tuple[str, str]] = {}
    try:
        for module, (layer, temps) in layers.items():
            stash[module] = dict(layer._parameters)
            for name, template in temps.items():
                rec = _recording_tensor(template)
                layer._parameters[name] = rec
                recs[_storage_key(rec)] = (module, name)
        catcher = _Catcher(recs, live, out)
        with torch.no_grad():
            for name, shape in shapes.items():
                catcher.name, catcher.numel = name, math.prod(shape)
                enc = catcher.enc = (torch.arange(catcher.numel, dtype=torch.float64) + _MARK).view(shape)
                try:
                    with catcher:
                        load(name, enc)
                except Exception as e:  # noqa: BLE001 - vLLM refuses this name or shape: reported at the handshake
                    out.rejected[name] = f"{type(e).__name__}: {e}"
    finally:
        for module, params in stash.items():
            layers[module][0]._parameters.clear()
            layers[module][0]._parameters.update(params)
    out.placements = merge(merge(out.placements))
    return out


def merge(placements: list[Placement]) -> list[Placement]:
    """Fold runs of equal-shaped copies a constant step apart (one per expert, say) into one strided copy."""
    out: list[Placement] = []
    run: list[Placement] = []

    def flush() -> None:
        merged = None
        if len(run) > 1:
            a, b = run[0], run[1]
            dd, ds = b.dst.offset - a.dst.offset, b.src.offset - a.src.offset
            dst = Strided((len(run), *a.dst.size), (dd, *a.dst.stride), a.dst.offset)
            if not overlaps(dst):
                merged = Placement(
                    a.name, a.module, a.param, dst, Strided((len(run), *a.src.size), (ds, *a.src.stride), a.src.offset)
                )
        out.extend(run if merged is None else [merged])
        run.clear()

    for p in placements:
        if run and not _continues(run, p):
            flush()
        run.append(p)
    flush()
    return out


def _continues(run: list[Placement], p: Placement) -> bool:
    a = run[-1]
    if (p.name, p.module, p.param, p.dst.size, p.dst.stride, p.src.size, p.src.stride) != (
        a.name,
        a.module,
        a.param,
        a.dst.size,
        a.dst.stride,
        a.src.size,
        a.src.stride,
    ):
        return False
    dd, ds = p.dst.offset - a.dst.offset, p.src.offset - a.src.offset
    if dd <= 0 or ds <= 0:
        return False
    return len(run) < 2 or (dd, ds) == (a.dst.offset - run[-2].dst.offset, a.src.offset - run[-2].src.offset)


def overlaps(view: Strided) -> bool:
    """True unless every element of `view` has its own storage offset (checked dims by ascending stride)."""
    reach = 0
    dims = sorted(((s, n) for n, s in zip(view.size, view.stride) if n > 1))
    for s, n in dims:
        if s <= reach:
            return True
        reach += (n - 1) * s
    return False
