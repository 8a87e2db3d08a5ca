"""ModuleEngine: a plain PyTorch module (e.g. a transformers model) as the refit target, copied in place."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import torch
from torch import nn

from refit.checks.canary import causal_lm
from refit.checks.copy_digest import FusedCopy, widens
from refit.checks.manifest_check import waived
from refit.engines.base import Engine
from refit.engines.root import engine_root
from refit.layout.fp8 import FP8_DTYPES, BlockFormat, scale_shape
from refit.layout.manifest import Manifest
from refit.layout.packing import CopyPlan, LayoutGuard
from refit.layout.spec import Slice, TensorSpec
from refit.layout.state_layout import StateLayout, non_persistent_buffers


class ModuleEngine(Engine):
    """Loads into a module's parameters and buffers (or a state dict's tensors) in place, under no_grad.

    The targets are re-read at every handshake and refit, so a parameter or buffer the inference side
    replaced (`module.to()`, a reassigned buffer) receives the bytes, not its stale predecessor; copy
    plans are dropped whenever any target's storage, dtype, shape or strides changed. Names that share
    one storage and view (tied weights) are one spec with aliases: the handshake refuses a sender that
    sends them as separate tensors."""

    def __init__(
        self,
        module: nn.Module | Mapping[str, torch.Tensor],
        *,
        name_map: Mapping[str, str] | None = None,
        ignore: Iterable[str] = (),
        shards: Mapping[str, Slice] | None = None,
        fp8: Mapping[str, BlockFormat] | BlockFormat | None = None,
        probe: Callable[[torch.Tensor], torch.Tensor] | None = None,
        repair: bool = False,
    ) -> None:
        """`name_map` maps sender names to this module's names where they differ; `ignore`: sender names
        (or fnmatch patterns) never loaded nor checked, whether or not the module has them (reported).
        `shards` (M:N, `refit.topology.mesh`): per sender name, the slice of the checkpoint tensor this
        module's tensor holds (its shape is the slice's); names not listed are held whole.
        `fp8`: how the module's FP8 tensors were quantized, one format for all or per sender name; by default
        each FP8 tensor with float32 scales beside it named `<name>_scale_inv` is taken as 128 x 128 blocks
        (DeepSeek-V3's layout) when the scales' shape fits that (`formats`).
        `probe`: how this engine scores a canary probe (refit.checks.canary); by default a module is scored as a
        causal language model (`causal_lm`: its forward maps input_ids to logits).
        `repair`: when the fingerprint check names a few tensors wrong, fetch just those again from the trainer
        and check them within the same refit (refit.topology.repair) instead of failing the version."""
        super().__init__()
        self.optional_names = frozenset(ignore)
        self.repair = repair
        self.module = module
        self._probe = probe
        self._layout = StateLayout(module) if isinstance(module, nn.Module) else None
        self._computed = non_persistent_buffers(module) if isinstance(module, nn.Module) else []
        own = self._own()
        name_map = dict(name_map or {})
        unknown = sorted(v for v in name_map.values() if v not in own)
        if unknown:
            raise ValueError(f"name_map targets names the module does not have: {unknown[:10]}")
        _check_name_map(name_map, own)
        self._inverse = {v: k for k, v in name_map.items()}
        self.computed_names = frozenset(self._inverse.get(n, n) for n, _, _ in self._computed)
        self._plans: dict[int, tuple[list, CopyPlan]] = {}
        self._fused: dict[int, tuple[list, _DigestedLoad]] = {}
        self._proven: frozenset[str] = frozenset()
        self._used: set[int] = set()
        self._names: tuple[str, ...] = ()
        self._guard: LayoutGuard | None = None
        self._targets: dict[str, torch.Tensor] = {}
        self._specs: list[TensorSpec] | None = None
        """The specs of the targets as of the last `_refresh` that saw them change (one list while they hold)."""
        self._manifest: Manifest | None = None
        """The epoch's manifest (`prepare`): the names and wire dtypes `root` folds."""
        self._refresh()
        self._shards = dict(shards or {})
        self._fp8 = fp8
        for name, part in self._shards.items():
            t = self._targets.get(name)
            if t is None or part.dim >= max(t.dim(), 1) or (t.shape[part.dim] if t.dim() else 1) != part.length:
                shape = None if t is None else tuple(t.shape)
                raise ValueError(f"shards[{name!r}] = {part} does not fit the module's tensor (shape {shape})")

    def _own(self) -> dict[str, torch.Tensor]:
        if self._layout is None:
            return dict(self.module)  # type: ignore[arg-type]
        own = self._layout.read()
        for name, owner, key in self._computed:  # non-persistent buffers: outside the state dict, still held
            t = owner._buffers.get(key)
            if t is not None:
                own[name] = t
        return own

    def _refresh(self) -> None:
        """Re-read the live targets; forget every copy plan if any of them was replaced or re-laid-out."""
        own, inverse = self._own(), self._inverse
        self._targets = {inverse.get(n, n): t for n, t in own.items()} if inverse else own
        names, values = tuple(self._targets), list(self._targets.values())
        if names != self._names or self._guard is None or not self._guard.holds(values):
            self._plans, self._fused, self._names, self._guard = {}, {}, names, LayoutGuard(values)
            self._proven = _written_once(self._targets)
            self._specs = None

    def specs(self) -> list[TensorSpec]:
        self._refresh()
        return self._own_specs()

    def layout(self) -> list[TensorSpec]:
        """The specs as of the last re-read of the targets (`begin` re-reads them): the same list object
        while no target was replaced, recast, reshaped or moved, so comparing it costs nothing."""
        if type(self).specs is not ModuleEngine.specs:  # a subclass states its own specs
            return self.specs()
        return self._own_specs()

    def _own_specs(self) -> list[TensorSpec]:
        if self._specs is None:
            ties: dict[tuple, list[str]] = {}
            for n, t in self._targets.items():
                ties.setdefault(_view_key(t), []).append(n)
            self._specs = [_spec(names, self._targets[names[0]]) for names in ties.values()]
        return self._specs

    def begin(self, version: int) -> None:
        self._refresh()
        # Plans unused in the last refit belong to an old manifest; dropping them frees the old
        # buffers' views and staging tensor, which they would otherwise keep alive.
        self._plans = {k: v for k, v in self._plans.items() if k in self._used}
        self._fused = {k: v for k, v in self._fused.items() if k in self._used}
        self._used = set()
        super().begin(version)

    def prepare(self, manifest: Manifest) -> None:
        self._manifest = manifest
        super().prepare(manifest)

    def root(self) -> tuple[int | None, str]:
        """(committed version, Merkle root over the fingerprints of what this module holds now, in manifest
        order: refit.checks.root), read together; equal to the trainer's `RefitStats.root` of that version
        exactly when every tensor is the trainer's. ValueError before the first handshake or while a refit
        is under way."""
        if self._manifest is None:
            raise ValueError("no manifest yet: the root is defined once a sender's handshake named the tensors")
        return engine_root(self, self._manifest)

    def formats(self) -> dict[str, BlockFormat]:
        specs = {n: s for s in self.specs() for n in s.names}
        return block_formats(specs, self._fp8)

    def scoring(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        if self._probe is not None:
            return self._probe
        return causal_lm(self.module) if isinstance(self.module, nn.Module) else None

    def release_buffers(self) -> None:
        self._plans, self._fused, self._used = {}, {}, set()

    def shards(self) -> dict[str, Slice | None] | None:
        if not self._shards:
            return None
        self._refresh()
        skip = self.computed_names - self._shards.keys()  # M:N asks only for what the trainer holds (pieces.py)
        return {n: self._shards.get(n) for n in self._targets if not waived(n, self.optional_names) and n not in skip}

    def shard_target(self, name: str) -> torch.Tensor | None:
        return self._targets.get(name)

    def tensor(self, name: str) -> torch.Tensor:
        """The engine's tensor for a sender name."""
        return self._targets[name]

    def held(self, name: str) -> tuple[torch.Tensor, None] | None:
        t = None if waived(name, self.optional_names) else self._targets.get(name)
        return None if t is None else (t, None)

    def writable(self, name: str) -> torch.Tensor | None:
        """The live tensor `load` copies `name` into, unless a subclass changes `load` or `held`, or holds a shard."""
        if type(self).load is not ModuleEngine.load or type(self).held is not ModuleEngine.held:
            return None
        if name in self._shards or waived(name, self.optional_names):
            return None
        return self._targets.get(name)

    def load(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Copy in place. A list passed again (the receiver reuses one per bucket) replays a cached plan,
        so many small tensors cost one batched launch, not one Python step each."""
        hit = self._plans.get(id(tensors))
        if hit is None or hit[0] is not tensors:
            kept = [(n, t) for n, t in tensors if not waived(n, self.optional_names)]
            hit = (tensors, CopyPlan([self._targets[n] for n, _ in kept], [t for _, t in kept]))
            self._plans[id(tensors)] = hit
        self._used.add(id(tensors))
        with torch.no_grad():
            hit[1].run()

    def load_digested(self, tensors: list[tuple[str, torch.Tensor]]) -> tuple[list[str], torch.Tensor] | None:
        """`load` with the copy digesting what it writes (`refit.checks.copy_digest`): each target is written by one
        whole-tensor copy, and `_written_once` proved no other target overlaps it, so the digest of the
        bytes written is the digest of what the module holds (a bfloat16 wire widened into a float32 target
        is digested as the bfloat16 it holds exactly). Names whose copy casts otherwise are read back, and so is
        everything in a subclass that changes `load` or `held` (its copy may not be what it holds)."""
        if type(self).load is not ModuleEngine.load or type(self).held is not ModuleEngine.held:
            return super().load_digested(tensors)
        hit = self._fused.get(id(tensors))
        if hit is None or hit[0] is not tensors:
            hit = (tensors, _DigestedLoad(self._targets, tensors, self.optional_names, self._proven))
            self._fused[id(tensors)] = hit
        self._used.add(id(tensors))
        with torch.no_grad():
            return hit[1].run()


class _DigestedLoad:
    """One bucket's copies into the module, planned once per layout: each distinct target written once
    (aliases share it), same-dtype pairs through a `FusedCopy`, casting pairs through a `CopyPlan`."""

    def __init__(
        self,
        targets: dict[str, torch.Tensor],
        tensors: list[tuple[str, torch.Tensor]],
        optional: frozenset[str],
        proven: frozenset[str],
    ) -> None:
        fused: dict[tuple, int] = {}
        dst, src, cast_dst, cast_src, named = [], [], [], [], []
        for n, t in tensors:
            if optional and waived(n, optional):
                continue
            target = targets[n]
            if target.dtype != t.dtype and not widens(target, t):  # bfloat16 widened into float32 is exact
                cast_dst.append(target)
                cast_src.append(t)
                continue
            key = _view_key(target)
            if key not in fused:
                fused[key] = len(dst)
                dst.append(target)
                src.append(t)
            if n in proven:
                named.append((n, fused[key]))
        self._cast = CopyPlan(cast_dst, cast_src) if cast_dst else None
        self._fused = FusedCopy(dst, src)
        self.names = [n for n, _ in named]
        self._index = torch.tensor([i for _, i in named], dtype=torch.int64)

    def run(self) -> tuple[list[str], torch.Tensor]:
        if self._cast is not None:
            self._cast.run()
        got = self._fused.run()
        if self._index.device != got.device:
            self._index = self._index.to(got.device)
        return self.names, got[self._index]


def _written_once(targets: dict[str, torch.Tensor]) -> frozenset[str]:
    """The names whose target no other (distinct) target overlaps, so that a whole-tensor copy into it is
    the only write to its bytes: checked once per layout over every target at once (byte spans sorted by
    start; a strided target counts its whole span). Tied names (one view) share their bytes, proven together."""
    keys: dict[tuple, int] = {}
    spans, owners = [], []
    for n, t in targets.items():
        key = _view_key(t)
        if key not in keys:
            keys[key] = len(spans)
            last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))  # torch strides are >= 0
            lo = t.data_ptr()
            spans.append((lo, lo + (last + 1) * t.element_size() if t.numel() else lo))
        owners.append((n, keys[key]))
    if len(spans) < 2:
        return frozenset(targets)
    lo, hi = torch.tensor(spans, dtype=torch.int64).unbind(1)
    full = hi > lo  # an empty target writes nothing: it clashes with nothing
    order = torch.argsort(lo[full], stable=True)
    lo_s, hi_s = lo[full][order], hi[full][order]
    clash = torch.zeros(len(lo_s), dtype=torch.bool)
    if len(lo_s) > 1:
        reach = torch.cummax(hi_s, 0).values  # the furthest byte any span up to here reaches
        clash[1:] |= reach[:-1] > lo_s[1:]  # starts before an earlier one ends
        clash[:-1] |= hi_s[:-1] > lo_s[1:]  # ends after the next one (sorted: the earliest later one) starts
    bad = torch.zeros(len(spans), dtype=torch.bool)
    bad[torch.nonzero(full).view(-1)[order]] = clash
    flags = bad.tolist()
    return frozenset(n for n, k in owners if not flags[k])


def _check_name_map(name_map: dict[str, str], own: Mapping[str, torch.Tensor]) -> None:
    """Every module tensor must keep one sender name: two sender names for one tensor, or a sender name
    that is also an unmapped module name (whose own tensor it would hide), would leave a tensor unloaded."""
    targets: dict[str, list[str]] = {}
    for sender_name, module_name in name_map.items():
        targets.setdefault(module_name, []).append(sender_name)
    shared = {m: sorted(s) for m, s in targets.items() if len(s) > 1}
    if shared:
        first = sorted(shared)[0]
        raise ValueError(
            f"name_map maps several sender names to one module tensor ({first!r} <- {shared[first]}); "
            "map each module tensor from one sender name"
        )
    hidden = sorted(s for s in name_map if s in own and s not in targets)
    if hidden:
        raise ValueError(
            f"name_map maps sender name {hidden[0]!r} to {name_map[hidden[0]]!r}, but the module also has a tensor "
            f"named {hidden[0]!r}, which would never be loaded; map {hidden[0]!r} too (to another sender name), "
            "or rename one of them"
        )


def block_formats(
    specs: Mapping[str, TensorSpec], given: Mapping[str, BlockFormat] | BlockFormat | None
) -> dict[str, BlockFormat]:
    """Each FP8 tensor of `specs` with its format: `given` (per name, or one for all), else the default one
    when scales of its shape lie beside it. One the default cannot explain is left out (the handshake then
    names its dtype as the mismatch)."""
    out = {}
    for name, spec in specs.items():
        if spec.dtype not in FP8_DTYPES:
            continue
        f = given.get(name) if isinstance(given, Mapping) else given
        if f is None:
            f = BlockFormat(dtype=spec.dtype)
            scale = specs.get(f.scale_name(name))
            if scale is None or scale.dtype != torch.float32 or tuple(scale.shape) != scale_shape(spec.shape, f):
                continue
        out[name] = f
    return out


def _spec(names: list[str], t: torch.Tensor) -> TensorSpec:
    return TensorSpec(names[0], tuple(t.shape), t.dtype, tuple(names[1:]))


def _view_key(t: torch.Tensor) -> tuple:
    """Equal for two names of one tensor (tied weights); an empty tensor is never tied to anything."""
    if not t.numel():
        return (id(t),)
    return (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
