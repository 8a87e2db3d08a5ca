"""The LoRA stage: the trainer trains a PEFT LoRA adapter over a frozen base; refits move only the adapter.

Both halves live here. The trainer's (`LoraSource`) sends one adapter's tensors of a PEFT model (lora_A and
lora_B of every target module, named as PEFT saves them: without the adapter's name). The engine's
(`LoraEngine`) loads them into a PEFT model in place, into one of `keep` adapter slots, so that versions
live side by side: a commit points new requests at the new version (`with engine.adapter() as name`), a
request that started on an older one finishes on it, and a version is retired once no request uses it.

The engine states what it holds when it joins (READY, under "lora"): each target module's rank and scaling
(from r, lora_alpha, use_rslora and the patterns) and a digest of its base weights. The trainer compares
them with its own and refuses the session, naming the fix, when they differ: the base never moves with a
LoRA refit, so it must already be the trainer's bit for bit (move it once with `base_source` into
`base_engine`). The manifest lists the stage, so an engine process that does not know it refuses the
handshake; the bucket halves pass the bytes through, and the fingerprint covers the adapter like any tensor.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import math
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

import torch
from torch import nn

from refit.checks.tensor_digest import digests
from refit.dtypes import dtype_name
from refit.engines.base import Engine, Region
from refit.engines.module import ModuleEngine
from refit.engines.versions import State, Versions
from refit.errors import RefitError
from refit.layout.manifest import Manifest
from refit.layout.packing import layout_key
from refit.layout.spec import TensorSpec
from refit.sources.base import Source
from refit.sources.module import ModuleSource
from refit.stages.base import Stage

KEYS = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B")
"""The containers of a PEFT LoRA layer that hold one adapter's trained tensors."""
_NOT_BASE = {*KEYS, "lora_magnitude_vector"}
"""Path segments of adapter tensors (never part of the base)."""
MAX_TARGETS = 1 << 20
"""Most target modules one engine may state (its READY is read after the token is proved, but still bounded)."""
INSTALL = "pip install 'refit[lora]' (peft)"


class LoraStage(Stage):
    """Listed in the manifest of a LoRA session; the bytes of every bucket pass through unchanged."""

    name = "lora"


# -- reading a PEFT model ------------------------------------------------------------------------------------


def _lora_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:
        raise ValueError(f"LoRA refits read PEFT models: {INSTALL}") from None
    return [(n, m) for n, m in model.named_modules() if isinstance(m, LoraLayer)]


def _check_adapter(model: nn.Module, adapter: str) -> object:
    """The adapter's PEFT config, checked to be a LoRA refit can move (ValueError names what is not)."""
    configs = getattr(model, "peft_config", None)
    if not isinstance(configs, dict):
        raise ValueError(f"{type(model).__name__} is not a PEFT model: wrap it with peft.get_peft_model first")
    if adapter not in configs:
        raise ValueError(f"the PEFT model has no adapter {adapter!r} (it has {sorted(configs)})")
    config = configs[adapter]
    if getattr(config, "peft_type", None) is None or str(config.peft_type.value) != "LORA":
        raise ValueError(f"adapter {adapter!r} is {config.peft_type}, not LoRA")
    unsupported = {
        "use_dora": bool(getattr(config, "use_dora", False)),
        "lora_bias": bool(getattr(config, "lora_bias", False)),
        "modules_to_save": bool(getattr(config, "modules_to_save", None)),
        "trainable_token_indices": bool(getattr(config, "trainable_token_indices", None)),
        "bias": getattr(config, "bias", "none") != "none",
    }
    named = [k for k, on in unsupported.items() if on]
    if named:
        raise ValueError(
            f"adapter {adapter!r} sets {', '.join(named)}: LoRA refits move lora_A and lora_B alone and cannot "
            "yet move what those options train; leave them at their defaults"
        )
    return config


class AdapterTensors(Mapping[str, torch.Tensor]):
    """One adapter's tensors in a PEFT model, by their wire names (PEFT's saved names: no adapter name), each
    looked up live in its layer when read. The LoRA layers are found once: re-inject the adapter, build anew."""

    def __init__(self, model: nn.Module, adapter: str) -> None:
        self.adapter = adapter
        self._where: dict[str, tuple[nn.Module, str | None]] = {}
        self._flat = True
        """Every adapter parameter is its module's own (`weight`, not `sub.weight`): read without a path walk."""
        for name, layer in _lora_layers(model):
            for key in KEYS:
                container = getattr(layer, key, None)
                if container is None or adapter not in container:
                    continue
                item = container[adapter]
                if isinstance(item, torch.Tensor):
                    self._where[f"{name}.{key}"] = (container, None)
                else:
                    for pn, _ in item.named_parameters():
                        self._where[f"{name}.{key}.{pn}"] = (container, pn)
                        self._flat &= "." not in pn
        if not self._where:
            raise ValueError(f"adapter {adapter!r} adapts no module of the model: check its target_modules")

    def __getitem__(self, name: str) -> torch.Tensor:
        container, param = self._where[name]
        item = container._modules[self.adapter] if isinstance(container, nn.ModuleDict) else container[self.adapter]
        if param is None:
            return item
        return item._parameters[param] if self._flat else item.get_parameter(param)  # type: ignore[return-value]

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


def _base_name(name: str) -> str | None:
    """A base parameter's name as the plain model calls it (None for an adapter tensor)."""
    parts = name.split(".")
    if _NOT_BASE.intersection(parts):
        return None
    return ".".join(p for p in parts if p != "base_layer").removeprefix("base_model.model.")


def base_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The base weights of a PEFT model (or of a plain one: the same names), by the plain model's names."""
    out = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        base = _base_name(name)
        if base is not None:
            out[base] = p
    return out


def base_digest(model: nn.Module) -> str:
    """A digest of the base weights (names, shapes, dtypes and every byte), equal for the plain model and its
    PEFT wrapping; it reads every base byte once (on the weights' own devices)."""
    tensors = base_tensors(model)
    names = sorted(tensors)
    by_device: dict[torch.device, list[str]] = {}
    for n in names:
        by_device.setdefault(tensors[n].device, []).append(n)
    sums: dict[str, int] = {}
    with torch.no_grad():
        for group in by_device.values():
            sums.update(zip(group, digests([tensors[n].detach() for n in group]).tolist()))
    rows = [[n, list(tensors[n].shape), dtype_name(tensors[n].dtype), sums[n]] for n in names]
    return hashlib.sha256(json.dumps(rows, separators=(",", ":")).encode()).hexdigest()


def layout_statement(model: nn.Module, adapter: str) -> dict:
    """The adapter's part of the statement: its config's r and lora_alpha, and its target modules (by the plain
    model's names), each with its rank and scaling (which r, lora_alpha, use_rslora and the patterns decide).
    Reads no weight: it works on a model built on the meta device."""
    config = _check_adapter(model, adapter)
    targets = {}
    for name, layer in _lora_layers(model):
        if adapter in getattr(layer, "r", {}):
            targets[_base_name(name) or name] = [int(layer.r[adapter]), float(layer.scaling[adapter])]
    return {
        "rank": int(config.r),  # type: ignore[attr-defined]
        "alpha": float(config.lora_alpha),  # type: ignore[attr-defined]
        "targets": targets,
    }


def statement(model: nn.Module, adapter: str) -> dict:
    """What one side holds, as READY states it: `layout_statement` and the base weights' digest."""
    return {**layout_statement(model, adapter), "base": base_digest(model)}


# -- comparing the two sides ---------------------------------------------------------------------------------


def parse(raw: bytes, who: str) -> dict | None:
    """The LoRA part of one READY statement (None: it states none), every field checked (ValueError names
    `who` and what is wrong)."""
    if not raw:
        return None
    try:
        obj = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise ValueError(f"{who}'s READY statement is not JSON: {e}") from None
    lora = obj.get("lora") if isinstance(obj, dict) else None
    if lora is None:
        return None
    ok = (
        isinstance(lora, dict)
        and set(lora) == {"rank", "alpha", "targets", "base"}
        and type(lora["rank"]) is int
        and isinstance(lora["alpha"], (int, float))
        and isinstance(lora["base"], str)
        and isinstance(lora["targets"], dict)
        and len(lora["targets"]) <= MAX_TARGETS
        and all(_target(v) for v in lora["targets"].values())
    )
    if not ok:
        raise ValueError(f"{who} states an impossible LoRA adapter: {json.dumps(lora)[:200]}")
    return lora


def _target(v: object) -> bool:
    return isinstance(v, list) and len(v) == 2 and type(v[0]) is int and _finite(v[1])


def _finite(v: object) -> bool:
    """A JSON number a float holds (an integer of 400 digits overflows it: not finite here)."""
    try:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    except OverflowError:
        return False


def differs(mine: Mapping, theirs: Mapping | None) -> str:
    """Why an engine that states `theirs` cannot take this trainer's adapter (`mine`), or ''."""
    if theirs is None:
        return (
            "it states no LoRA adapter: serve the PEFT model through refit.stages.lora.LoraEngine, unstaged (its "
            "adapter slots already let requests run while a refit lands)"
        )
    if theirs["base"] != mine["base"]:
        return (
            f"its base weights differ from the trainer's (digest {theirs['base'][:12]} there, {mine['base'][:12]} "
            "here); a LoRA refit moves only the adapter, so the engine must hold the trainer's base bit for bit, "
            "dtype included: load the same base checkpoint into it, or move the base once with "
            "Sender(refit.stages.lora.base_source(model)) into Receiver(refit.stages.lora.base_engine(engine_model))"
        )
    here, there = mine["targets"], theirs["targets"]
    only_here, only_there = sorted(here.keys() - there.keys()), sorted(there.keys() - here.keys())
    if only_here or only_there:
        first = f"{only_here[0]!r} only here" if only_here else f"{only_there[0]!r} only there"
        return f"it adapts other modules than the trainer ({first}): give both the same target_modules"
    for name in sorted(here):
        if list(here[name]) != list(there[name]):
            (r1, s1), (r2, s2) = here[name], there[name]
            return (
                f"{name!r} has rank {r2} and scaling {s2} there, rank {r1} and scaling {s1} here (r {mine['rank']}, "
                f"lora_alpha {mine['alpha']}): give both the same r, lora_alpha, use_rslora and patterns"
            )
    return ""


def adapt(source: Source, statements: Sequence[bytes]) -> tuple[str, ...]:
    """The stage names a LoRA source adds to the session ('lora'), after checking that every receiver holds
    its adapter's layout over the same base; () for any other source that no receiver states an adapter to.
    ValueError says which receiver does not fit, and why."""
    stated = [parse(raw, f"receiver {r}") for r, raw in enumerate(statements)]
    if not isinstance(source, LoraSource):
        held = [r for r, s in enumerate(stated) if s is not None]
        if held:
            raise ValueError(
                f"receiver {held[0]} serves a LoRA adapter (refit.stages.lora.LoraEngine) but the trainer sends "
                f"{type(source).__name__}: send the adapter from refit.stages.lora.LoraSource(peft_model)"
            )
        return ()
    mine = source.statement()
    for r, theirs in enumerate(stated):
        why = differs(mine, theirs)
        if why:
            raise ValueError(f"receiver {r} cannot take this LoRA adapter: {why}")
    return (LoraStage.name,)


def mismatch(raw: bytes, source: Source, rank: int) -> str:
    """Why an engine joining later (its READY `raw`) does not fit a session sending from `source`, or ''."""
    try:
        adapt(source, [raw])
    except ValueError as e:
        return str(e).replace("receiver 0", f"receiver {rank}", 1)
    return ""


# -- the trainer's half --------------------------------------------------------------------------------------


class LoraSource(ModuleSource):
    """One adapter of a PEFT model, read live at every refit: only its lora_A and lora_B tensors are sent,
    named as PEFT saves them (`base_model.model.<module>.lora_A.weight`). The base weights are not sent; the
    session checks, when it connects, that the engines hold the same base and the same adapter layout."""

    def __init__(
        self,
        model: nn.Module,
        *,
        adapter: str = "default",
        wire_dtype: torch.dtype | None = None,
        overrides: Mapping[str, torch.dtype] | None = None,
    ) -> None:
        """`model`: a PEFT model (`peft.get_peft_model`) with LoRA adapter `adapter`. `wire_dtype` casts every
        adapter tensor (e.g. float32 adapters sent as bfloat16 to a bfloat16 engine); `overrides` per name."""
        _check_adapter(model, adapter)
        self.model, self.adapter = model, adapter
        self._cast: dict[tuple[str, ...], tuple[tuple, tuple[torch.Tensor | None, list[torch.Tensor]]]] = {}
        super().__init__(AdapterTensors(model, adapter), wire_dtype=wire_dtype, overrides=overrides)

    def statement(self) -> dict:
        """This adapter's layout and the base weights' digest (read once per connect: it reads the base)."""
        return statement(self.model, self.adapter)

    @property
    def lookup_only(self) -> bool:
        return False  # `tensors` casts a bucket's tensors, together, at every refit

    def tensors(self, names: Sequence[str]) -> list[torch.Tensor]:
        """One bucket's adapter tensors, read live; where they need a cast to one wire dtype (float32 adapters
        sent as bfloat16), cast together in one operation into a flat tensor kept for these names, so that
        packing copies them without a cast per tensor (the bytes are those of each tensor's own cast)."""
        live = super().tensors(names)
        key = tuple(names)
        layout = layout_key(live)
        kept = self._cast.get(key)
        if kept is None or kept[0] != layout:
            kept = self._cast[key] = (layout, _cast_into(live, [self._wire(n, t) for n, t in zip(names, live)]))
        flat, views = kept[1]
        if flat is None:
            return live
        if flat.device.type == "cpu":
            torch._foreach_copy_(views, [t.detach() for t in live])  # one call: C++ loops over the pairs
        else:  # CUDA batches a cat's inputs into an output of their own dtype only: then one cast
            flat.copy_(torch.cat([t.detach().reshape(-1) for t in live]))
        return views

    def held_bytes(self) -> int:
        return sum(s.nbytes for s in self.specs()) if self._casts() else 0

    def held_tensors(self) -> list[torch.Tensor]:
        return [flat for _, (flat, _) in self._cast.values() if flat is not None]

    def _casts(self) -> bool:
        return any(self._wire(n, t) != t.dtype for n, t in self._tensors.items())


def _cast_into(live: list[torch.Tensor], wire: list[torch.dtype]) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
    """A flat tensor in the one wire dtype of `live` and a view of it shaped as each tensor; (None, []) where
    nothing needs a cast, or the tensors do not share one wire dtype and device."""
    if not live or len(set(wire)) != 1 or len({t.device for t in live}) != 1:
        return None, []
    if all(t.dtype == w for t, w in zip(live, wire)):
        return None, []
    flat = torch.empty(sum(t.numel() for t in live), dtype=wire[0], device=live[0].device)
    views, at = [], 0
    for t in live:
        views.append(flat[at : at + t.numel()].view(t.shape))
        at += t.numel()
    return flat, views


def base_source(model: nn.Module, *, wire_dtype: torch.dtype | None = None) -> ModuleSource:
    """A source of the base weights alone, by the plain model's names, to move the base once (a full refit)
    into an engine's `base_engine` before the LoRA session."""
    return ModuleSource(base_tensors(model), wire_dtype=wire_dtype)


# -- the engine's half ---------------------------------------------------------------------------------------


class Versioned(Protocol):
    """An adapter slot as `Turns` sees it: the version whose bytes it holds (None: none whole)."""

    version: int | None


S = TypeVar("S", bound=Versioned)


class Turns(Generic[S]):
    """Which of an engine's adapter slots new requests get: kept as a slot, never found by its version number.

    A commit makes its slot pending; it becomes current once the engine's weights read current at its version
    (at once for a plain commit, after the verdict in a two-phase one), and any other slot claiming that version
    is retired then, so that no two slots ever claim one version. A failed or refused refit leaves the slot
    that was current before it current. The engine calls it under its own lock."""

    def __init__(self, slots: Sequence[S], versions: Versions) -> None:
        self.slots, self._versions = list(slots), versions
        self.current: S | None = None
        self.writing: S | None = None
        """The slot the refit under way writes (None: none, or its begin found every slot in use)."""
        self._pending: S | None = None
        self._undo: tuple[S | None, list[tuple[S, int | None]]] | None = None
        """What the refit under way's promotion replaced (its commit read current before its verdict came)."""

    def now(self) -> S | None:
        """The slot new requests get (a committed slot is promoted here once the weights confirm its version)."""
        pending, w = self._pending, self._versions.weights
        if pending is not None and w.state == State.CURRENT and w.version == pending.version:
            stale = [(s, s.version) for s in self.slots if s is not pending and s.version == pending.version]
            for s, _ in stale:
                s.version = None  # the same version number refit again: the older bytes are retired
            self._undo = (self.current, stale)
            self.current, self._pending = pending, None
        return self.current

    def begin(self, free: Callable[[S], bool]) -> S | None:
        """The slot a refit writes: not current and `free` (no request uses it), retired ones first; None when
        there is none (the refit is refused and nothing changes)."""
        current = self.now()
        self._pending = self._undo = None
        options = [s for s in self.slots if s is not current and free(s)]
        self.writing = min(options, key=lambda s: s.version is not None) if options else None
        if self.writing is not None:
            self.writing.version = None  # its bytes change from here on
        return self.writing

    def commit(self, version: int) -> S:
        """The engine committed `version` into the slot being written: it is pending until the weights confirm it."""
        slot = self.writing
        assert slot is not None, "a commit without a slot being written"
        slot.version, self.writing, self._pending = version, None, slot
        return slot

    def fail(self) -> list[S]:
        """The refit under way failed: the slots it wrote (the caller retires them); the slot that was current
        before it is current again, with the versions it held."""
        written = [s for s in (self.writing, self._pending) if s is not None]
        if self._undo is not None:  # its commit read current for a moment, and a request asked then
            if self.current is not None:
                written.append(self.current)
            self.current, stale = self._undo
            for s, v in stale:
                s.version = v
        self.writing = self._pending = self._undo = None
        return written

    def assume(self, slot: S, version: int) -> None:
        """`slot` holds `version` already (the engine's starting adapter): it is current."""
        slot.version, self.current = version, slot


@dataclass(slots=True)
class _Slot:
    """One adapter of the engine's PEFT model that versions take turns in."""

    name: str
    engine: ModuleEngine
    version: int | None = None
    """The version whose bytes it holds (None: none whole: never written, or a write that failed)."""
    requests: int = 0
    """Requests that pinned it (`LoraEngine.adapter`) and have not finished."""


class LoraEngine(Engine):
    """A PEFT model whose LoRA adapter the trainer refits, `keep` versions side by side.

    The model's adapter `adapter` is the first of `keep` slots (the others are added as copies of its config,
    named `refit1`, ...). A refit writes into a slot no request reads, never the one new requests get; its
    commit points new requests at it. Generate inside `with engine.adapter() as name:` and pass
    `adapter_names=[name] * batch` to the model (PEFT's per-request adapters): the version is pinned until
    the block ends, while later refits commit. A refit finding every other slot pinned is refused (nothing
    loaded, the engine stays current at its last version; retry after those requests finish, or keep more
    versions)."""

    def __init__(self, model: nn.Module, *, adapter: str = "default", keep: int = 2) -> None:
        """`model`: a PEFT model holding LoRA adapter `adapter` over the trainer's base weights (e.g. built from
        the same checkpoint, then `peft.get_peft_model(model, the trainer's LoraConfig)`), in eval mode.
        `keep`: adapter versions live at once (at least 2: the one requests get and the one a refit writes)."""
        super().__init__()
        if type(keep) is not int or keep < 2:
            raise ValueError(f"keep ({keep!r}) must be an int of at least 2: a refit writes a slot no request reads")
        config = _check_adapter(model, adapter)
        names = [adapter, *(f"refit{i}" for i in range(1, keep))]
        for name in names[1:]:
            if name not in model.peft_config:  # type: ignore[operator]
                model.add_adapter(name, copy.deepcopy(config))  # type: ignore[operator]
        self.model, self.adapter_name = model, adapter
        self.slots = [_Slot(n, ModuleEngine(AdapterTensors(model, n))) for n in names]
        self.turns = Turns(self.slots, self.versions)
        self._lock = threading.Lock()
        self._refused = ""

    # -- what it states and holds

    def statement(self) -> dict:
        return {"lora": statement(self.model, self.adapter_name)}

    def specs(self) -> list[TensorSpec]:
        return self._target().engine.specs()

    def layout(self) -> list[TensorSpec]:
        if self._refused:
            raise RefitError(self._refused)
        return self._target().engine.layout()

    def _target(self) -> _Slot:
        """The slot a refit writes (or, between refits, the one requests get; the first before any)."""
        with self._lock:
            return self.turns.writing or self.turns.now() or self.slots[0]

    @property
    def live(self) -> dict[int, int]:
        """The versions live now, each with the requests using it: the one new requests get, and every older one
        a request still uses (the others are retired: their slot is free for the next refit)."""
        with self._lock:
            current = self.turns.now()
            return {s.version: s.requests for s in self.slots if s.version is not None and (s is current or s.requests)}

    @contextlib.contextmanager
    def adapter(self) -> Iterator[str]:
        """Pin the version new requests get now, for one request: yields its adapter's name (pass it to the
        model as `adapter_names`); later commits leave it alone until the block ends."""
        with self._lock:
            slot = self.turns.now()
            if slot is None:
                raise RefitError(
                    "no adapter version committed yet: run a refit first, or call engine.assume_current(version) "
                    f"if adapter {self.adapter_name!r} already holds the trainer's"
                )
            slot.requests += 1
        try:
            yield slot.name
        finally:
            with self._lock:
                slot.requests -= 1

    # -- the refit

    def assume_current(self, version: int) -> None:
        super().assume_current(version)
        with self._lock:
            self.turns.assume(self.slots[0], version)

    def begin(self, version: int) -> None:
        with self._lock:
            slot = self.turns.begin(lambda s: not s.requests)
            busy = {s.version: s.requests for s in self.slots if s.requests}
        if slot is None:  # refused before any byte: the engine's state stays what it was (current at its last)
            self._refused = refused(version, len(self.slots), self.weights.version, busy, "LoraEngine(keep=...)")
            return
        self._refused = ""
        slot.engine.begin(version)
        super().begin(version)

    def load(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        self._written().load(tensors)

    def load_digested(self, tensors: list[tuple[str, torch.Tensor]]) -> tuple[list[str], torch.Tensor] | None:
        return self._written().load_digested(tensors)

    def _written(self) -> ModuleEngine:
        slot = self.turns.writing
        assert slot is not None, "a load outside a refit, or after begin refused it"
        return slot.engine

    def held(self, name: str) -> tuple[torch.Tensor, Region | None] | None:
        return self._target().engine.held(name)

    def commit(self, version: int) -> None:
        if self.turns.writing is None:
            raise RefitError(self._refused or f"commit of version {version} without a begin")
        with self._lock:
            self.turns.commit(version)
        super().commit(version)  # new requests get it (two-phase: once every worker committed)

    def fail(self, version: int, reason: str) -> None:
        with self._lock:
            for s in self.turns.fail():  # the slot being written, or one committed and then vetoed
                s.version = None
            was_refused, self._refused = bool(self._refused), ""
        if not was_refused:  # a refused refit began nothing: the engine stays current at its last version
            super().fail(version, reason)

    def release_buffers(self) -> None:
        for s in self.slots:
            s.engine.release_buffers()

    def prepare(self, manifest: Manifest) -> None:
        for s in self.slots:
            s.engine.prepare(manifest)


def refused(version: int, slots: int, current: int | None, busy: Mapping[int | None, int], more: str) -> str:
    """Why a refit to `version` finds none of the `slots` adapter slots free: the current version's, and those
    requests use (`busy`: version -> requests); `more`: how to keep more versions."""
    return (
        f"refused refit {version}: all {slots} adapter slots are in use by requests (version {current} serves new "
        f"requests; requests still run on versions {dict(busy)}); nothing was loaded and version {current} stays "
        f"current. Retry once those requests finish, or keep more versions ({more})"
    )


def base_engine(model: nn.Module) -> ModuleEngine:
    """An engine over the base weights alone (by the plain model's names) of a PEFT or plain model, to receive
    the base once (from `base_source`) before the LoRA session."""
    return ModuleEngine(base_tensors(model))
