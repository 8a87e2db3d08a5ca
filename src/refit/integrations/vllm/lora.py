"""LoRA refits into vLLM: the trainer's PEFT adapter lands in a vLLM worker's memory and is registered with vLLM's
own LoRA manager from those tensors (no adapter files), `keep` versions side by side.

The worker half (`VllmLoraEngine`, made by the worker extension's `refit_lora_connect`) takes one adapter
version per refit into a slot no request reads, builds vLLM's `LoRAModel` from the landed tensors
(`LoRAModel.from_lora_tensors`) under a new int id, and adds and pins it in the model's LoRA manager (so vLLM's
LRU never evicts it, and never looks for it on disk). Its commit points new requests at it; the last versions
stay registered while a request uses them. The trainer half (`VllmLoraRefit`) drives the refits over
collective_rpc and hands out the current version's `LoRARequest` (`lora_request()`, or `pinned()` to keep a
request's version registered while it runs).

vLLM's weight-transfer API is not used here: its `finish_weight_update` drops every LoRA adapter (vLLM resets its
LoRA state after a base update). A LoRA refit never moves the base; the engine states a digest of the base it
serves (of the checkpoint vLLM loaded, or one given), which the trainer compares with its own.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from refit.engines.base import Engine, Region
from refit.errors import HandshakeError, RefitError
from refit.integrations.vllm.driver import VllmRefit
from refit.layout.spec import TensorSpec
from refit.log import get_logger
from refit.stages.lora import INSTALL, AdapterTensors, Turns, base_digest, layout_statement, refused

log = get_logger("vllm")

PEFT_FIELDS = (
    "r",
    "lora_alpha",
    "target_modules",
    "use_rslora",
    "rank_pattern",
    "alpha_pattern",
    "exclude_modules",
    "layers_to_transform",
    "layers_pattern",
)
"""The fields of a PEFT LoraConfig that decide an adapter's layout (vLLM's LoRA reads the first six)."""
_IDS = itertools.count(1 << 30)
"""vLLM LoRA int ids of refit's adapter versions: far above the small ids users give adapters they load."""


@dataclass(kw_only=True, slots=True)
class VllmLoraOptions:
    """The adapter a vLLM worker serves from refits: the trainer's PEFT LoRA layout, and how many versions live."""

    r: int
    """PEFT's r (vLLM must be started with max_lora_rank at least this, and every rank_pattern value)."""
    lora_alpha: float
    """PEFT's lora_alpha."""
    target_modules: list[str] | str
    """PEFT's target_modules (names or suffixes of linear modules, or one regex)."""
    use_rslora: bool = False
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, float] = field(default_factory=dict)
    exclude_modules: list[str] | str | None = None
    layers_to_transform: list[int] | int | None = None
    layers_pattern: list[str] | str | None = None
    keep: int = 2
    """Adapter versions registered at once (at least 2: the one new requests get and the one a refit writes);
    vLLM must be started with max_loras (and max_cpu_loras) at least this."""
    base: str | None = None
    """The base weights' digest (refit.stages.lora.base_digest of the trainer's base), when vLLM serves weights
    other than its checkpoint's; None: computed from the checkpoint vLLM loaded."""

    def __post_init__(self) -> None:
        if type(self.keep) is not int or self.keep < 2:
            raise ValueError(
                f"keep ({self.keep!r}) must be an int of at least 2: a refit writes a slot no request reads"
            )
        if type(self.r) is not int or self.r < 1:
            raise ValueError(f"r ({self.r!r}) must be a positive int")
        if isinstance(self.target_modules, (set, frozenset, tuple)):
            self.target_modules = sorted(self.target_modules)
        if isinstance(self.exclude_modules, (set, frozenset, tuple)):
            self.exclude_modules = sorted(self.exclude_modules)
        if not isinstance(self.target_modules, (list, str)) or not self.target_modules:
            raise ValueError(f"target_modules must name modules (a list or a regex), not {self.target_modules!r}")

    @classmethod
    def from_peft(cls, config: Any, *, keep: int = 2, base: str | None = None) -> VllmLoraOptions:
        """From the trainer's `peft.LoraConfig` (e.g. `peft_model.peft_config["default"]`) or its dict."""
        raw = config if isinstance(config, dict) else config.to_dict()
        return cls(**{k: raw[k] for k in PEFT_FIELDS if raw.get(k) is not None}, keep=keep, base=base)

    def to_json(self) -> dict:
        """Plain data for collective_rpc (`from_json` reads it back in the worker)."""
        return {k: getattr(self, k) for k in (*PEFT_FIELDS, "keep", "base")}

    @classmethod
    def from_json(cls, raw: Any) -> VllmLoraOptions:
        if not isinstance(raw, dict):
            raise ValueError(f"LoRA options must be a dict of VllmLoraOptions fields, not {type(raw).__name__}")
        return cls(**raw)


def adapter_layout(hf_config: Any, options: VllmLoraOptions, dtype: torch.dtype) -> tuple[dict, list[TensorSpec]]:
    """The adapter's layout statement (refit.stages.lora.layout_statement) and its tensors (PEFT's saved names,
    in `dtype`), from PEFT itself over the transformers model of `hf_config` built on the meta device."""
    try:
        import peft
        from transformers import AutoModelForCausalLM
    except ImportError:
        raise ValueError(f"a LoRA vLLM engine lays out the adapter with PEFT and transformers: {INSTALL}") from None
    fields = {k: getattr(options, k) for k in PEFT_FIELDS if getattr(options, k) is not None}
    with torch.device("meta"):
        model = peft.get_peft_model(AutoModelForCausalLM.from_config(hf_config), peft.LoraConfig(**fields))
    names = list(AdapterTensors(model, "default").items())
    embedded = [n for n, _ in names if ".lora_embedding_" in n]
    if embedded:
        raise ValueError(
            f"target_modules adapts an embedding ({embedded[0]}): vLLM LoRA refits move linear layers only"
        )
    specs = [TensorSpec(n, tuple(t.shape), dtype) for n, t in names]
    return layout_statement(model, "default"), specs


def _module(name: str) -> tuple[str, str]:
    """The module and 'A' or 'B' of one of PEFT's saved names: ('model.layers.0.mlp.down_proj', 'A') for
    'base_model.model.model.layers.0.mlp.down_proj.lora_A.weight'."""
    head, _, tail = name.removeprefix("base_model.model.").rpartition(".lora_")
    return head, tail.split(".")[0]


def places(manager: Any, modules: list[str]) -> dict[str, tuple[str, int]]:
    """Where vLLM keeps each target module's LoRA: (its LoRA module, the slice of a packed one: q, k, v of qkv_proj).
    ValueError names a target vLLM has no LoRA layer for."""
    packed = {sub: (whole, i) for whole, subs in manager.packed_modules.items() for i, sub in enumerate(subs)}
    out = {}
    for m in modules:
        if m in manager.modules:
            out[m] = (m, 0)
        elif m in packed:
            out[m] = packed[m]
        else:
            raise ValueError(
                f"vLLM has no LoRA layer for {m!r} (it adapts {sorted(manager.modules)[:6]}...): adapt other modules, "
                "or start vLLM without lora target_modules that leave it out"
            )
    return out


def check_capacity(lora_config: Any, options: VllmLoraOptions) -> None:
    """ValueError when vLLM was started with too few LoRA slots or too small a rank for these options."""
    rank = max([options.r, *options.rank_pattern.values()])
    if rank > lora_config.max_lora_rank:
        raise ValueError(
            f"the adapter's rank ({rank}) is above the max_lora_rank vLLM was started with "
            f"({lora_config.max_lora_rank}): start it with max_lora_rank={rank} or more"
        )
    for knob in ("max_loras", "max_cpu_loras"):
        if getattr(lora_config, knob) < options.keep:
            raise ValueError(
                f"vLLM was started with {knob}={getattr(lora_config, knob)}, but the engine keeps {options.keep} "
                f"adapter versions pinned: start it with {knob}={options.keep} or more, or keep fewer"
            )


@dataclass(slots=True)
class _Slot:
    """One adapter version's place: the tensors as they landed, and the vLLM adapter built from them."""

    landed: dict[str, torch.Tensor]
    """Every adapter tensor as the last refit into this slot landed (vLLM's adapter is built from copies)."""
    version: int | None = None
    """The version it holds, committed (None: none whole)."""
    lora_id: int | None = None
    """Its adapter's int id in vLLM while registered."""
    arrived: set[str] = field(default_factory=set)
    """The names loaded by the refit writing it (vLLM's adapter is built once all are)."""
    pins: int = 0
    """Requests that pinned it (`VllmLoraEngine.pin`) and have not released it."""


class VllmLoraEngine(Engine):
    """One vLLM worker's LoRA adapter versions, refitted from the trainer's tensors in memory.

    A refit lands in a slot that neither new requests nor pinned or running ones use; once its last tensor is
    in, a `LoRAModel` is built from them and added and pinned in vLLM's LoRA manager under a new int id (the
    fingerprint then reads back what vLLM's LoRA layers hold). Commit points `lora_request()` at it. A refit
    finding no such slot is refused (nothing loaded)."""

    def __init__(
        self,
        manager: Any,
        hf_config: Any,
        options: VllmLoraOptions,
        *,
        base: str,
        running: Callable[[], set[int]] = set,
    ) -> None:
        """`manager`: the model's vLLM LoRA manager (`model.lora_manager` of an LLM started with enable_lora).
        `base`: the digest of the base vLLM serves. `running`: the int ids of adapters that requests in the
        worker's batch use now (kept registered as if pinned)."""
        super().__init__()
        from vllm.lora.peft_helper import PEFTHelper

        self.manager, self.options, self.base, self._running = manager, options, base, running
        check_capacity(manager.lora_config, options)
        self.layout_statement, specs = adapter_layout(hf_config, options, manager.lora_config.lora_dtype)
        self.helper = PEFTHelper.from_dict({k: getattr(options, k) for k in PEFT_FIELDS[:6]})
        self.helper.validate_legal(manager.lora_config)
        self.names = {s.name: _module(s.name) for s in specs}
        self.places = places(manager, sorted({m for m, _ in self.names.values()}))
        self._specs = specs
        self.shapes = {s.name: s.shape for s in specs}
        self.slots = [_Slot({s.name: torch.zeros(s.shape, dtype=s.dtype) for s in specs}) for _ in range(options.keep)]
        self.turns = Turns(self.slots, self.versions)
        self.seconds: dict[str, float] = {}
        self._lock = threading.Lock()
        self._refused = ""

    # -- what it states and holds

    def statement(self) -> dict:
        return {"lora": {**self.layout_statement, "base": self.base}}

    def specs(self) -> list[TensorSpec]:
        return list(self._specs)

    def layout(self) -> list[TensorSpec]:
        if self._refused:
            raise RefitError(self._refused)
        return self.specs()

    @property
    def live(self) -> dict[int, int]:
        """The versions live now, each with its pins: the one new requests get, and every older one a request
        pins or runs on. The others are retired: their slot is free, and the next refit into it removes their
        adapter from vLLM (until then a request already queued on one still finds it)."""
        with self._lock:
            current, running = self.turns.now(), self._running()
            return {
                s.version: s.pins
                for s in self.slots
                if s.version is not None and (s is current or s.pins or s.lora_id in running)
            }

    def lora_request(self) -> Any:
        """vLLM's `LoRARequest` of the version new requests get (pass it as `lora_request=` to generate)."""
        from vllm.lora.request import LoRARequest

        name, lora_id = self.request_info()
        return LoRARequest(name, lora_id, lora_path=f"refit-in-memory:{name}")

    def request_info(self) -> tuple[str, int]:
        """(name, int id) of the current version's vLLM adapter."""
        with self._lock:
            slot = self.turns.now()
            if slot is None or slot.lora_id is None:
                raise RefitError("no adapter version committed yet: run a refit first")
            return f"refit-v{slot.version}-{slot.lora_id}", slot.lora_id

    def pin(self, lora_id: int) -> int:
        """Keep the version of adapter `lora_id` registered until `release(lora_id)`; returns its version."""
        with self._lock:
            slot = next((s for s in self.slots if s.lora_id == lora_id and s.version is not None), None)
            if slot is None:
                raise RefitError(f"adapter {lora_id} is retired (or never was refit's): pin lora_request() anew")
            slot.pins += 1
            return int(slot.version)  # type: ignore[arg-type]

    def release(self, lora_id: int) -> None:
        """One pin of `lora_id` ends; an older version with no pin and no running request is retired now."""
        with self._lock:
            slot = next((s for s in self.slots if s.lora_id == lora_id and s.pins), None)
            if slot is None:
                return
            slot.pins -= 1
            if slot is not self.turns.now() and not slot.pins and slot.lora_id not in self._running():
                self._retire(slot)

    @contextlib.contextmanager
    def pinned(self) -> Iterator[Any]:
        """The current version's `LoRARequest`, its version kept registered until the block ends."""
        request = self.lora_request()
        self.pin(request.lora_int_id)
        try:
            yield request
        finally:
            self.release(request.lora_int_id)

    def held(self, name: str) -> tuple[torch.Tensor, Region | None] | None:
        with self._lock:
            slot = self.turns.writing or self.turns.now()
        if slot is None or slot.lora_id is None or name not in self.names:
            return None
        return _read_back(self, slot, name), None

    # -- vLLM's adapters

    def _register(self, slot: _Slot) -> None:
        """vLLM's adapter from the slot's landed tensors (copies: vLLM scales lora_B in place), added and pinned."""
        from vllm.lora.lora_model import LoRAModel

        model = self.manager.model
        mapper = getattr(model, "hf_to_vllm_mapper", None)
        lora = LoRAModel.from_lora_tensors(
            next(_IDS),
            {n: t.clone() for n, t in slot.landed.items()},
            self.helper,
            device="cpu",
            dtype=self.manager.lora_config.lora_dtype,
            model_vocab_size=self.manager.vocab_size,
            weights_mapper=mapper.get_rename_mapper() if mapper is not None else None,
            skip_prefixes=getattr(model, "lora_skip_prefixes", None),
        )
        self.manager.add_adapter(lora)
        self.manager.pin_adapter(lora.id)  # in vLLM's CPU and GPU caches: never evicted, never looked for on disk
        slot.lora_id = lora.id

    def _retire(self, slot: _Slot) -> None:
        if slot.lora_id is not None:
            self.manager.remove_adapter(slot.lora_id)
            log.info("retired LoRA version %s (vLLM adapter %d)", slot.version, slot.lora_id)
        slot.lora_id, slot.version = None, None

    def retire_all(self) -> None:
        """Remove every adapter this engine registered from vLLM (before another engine takes the worker)."""
        with self._lock:
            for s in self.slots:
                self._retire(s)

    # -- the refit

    def assume_current(self, version: int) -> None:
        raise ValueError("vLLM starts with no refit adapter: run a refit instead of assume_current")

    def begin(self, version: int) -> None:
        with self._lock:
            running = self._running()
            slot = self.turns.begin(lambda s: not s.pins and s.lora_id not in running)
            if slot is not None:
                self._retire(slot)  # no request uses it: its bytes change from here on
                slot.arrived = set()
            busy = {s.version: s.pins for s in self.slots if s.pins or (s.lora_id is not None and s.lora_id in running)}
        self.seconds = {"copy": 0.0, "post": 0.0}
        if slot is None:  # refused before any byte: the engine's state stays what it was (current at its last)
            more = "VllmLoraOptions(keep=...), and vLLM's max_loras as many"
            self._refused = refused(version, len(self.slots), self.weights.version, busy, more)
            return
        self._refused = ""
        super().begin(version)

    def load(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        slot = self.turns.writing
        assert slot is not None, "a load outside a refit, or after begin refused it"
        t = time.perf_counter()
        for n, x in tensors:
            slot.landed[n].copy_(x)
        self.seconds["copy"] += time.perf_counter() - t
        slot.arrived.update(n for n, _ in tensors)
        if len(slot.arrived) == len(self.names) and slot.lora_id is None:
            t = time.perf_counter()
            self._register(slot)  # the last tensor is in: the fingerprint reads back what vLLM now holds
            self.seconds["post"] += time.perf_counter() - t

    def commit(self, version: int) -> None:
        slot = self.turns.writing
        if slot is None:
            raise RefitError(self._refused or f"commit of version {version} without a begin")
        if slot.lora_id is None:
            missing = sorted(self.names.keys() - slot.arrived)
            raise RefitError(f"version {version}: {len(missing)} adapter tensors never arrived ({missing[0]}, ...)")
        with self._lock:
            self.turns.commit(version)
        super().commit(version)  # new requests get it (two-phase: once every worker committed)
        log.info("LoRA version %d is vLLM adapter %d", version, slot.lora_id)

    def fail(self, version: int, reason: str) -> None:
        with self._lock:
            for s in self.turns.fail():  # the slot being written, or one committed and then vetoed
                if s.pins:
                    s.version = None  # a request pinned it before the verdict: retired at its release
                else:
                    self._retire(s)
            was_refused, self._refused = bool(self._refused), ""
        if not was_refused:  # a refused refit began nothing: the engine stays current at its last version
            super().fail(version, reason)


def _read_back(engine: VllmLoraEngine, slot: _Slot, name: str) -> torch.Tensor:
    """What vLLM's LoRA layer holds for `name` in the slot's adapter: lora_A as it is; lora_B (which vLLM keeps
    multiplied by the scaling) as landed when vLLM holds exactly landed x scaling, else vLLM's over the scaling
    (NaN where that would read as landed: it differs, so it must not verify)."""
    module, key = engine.names[name]
    where, part = engine.places[module]
    layer = engine.manager.modules[where]
    index = engine.manager.lora_index_to_id.index(slot.lora_id)
    rows, cols = engine.shapes[name]
    if key == "A":
        return layer.lora_a_stacked[part][index, 0, :rows, :cols]
    live = layer.lora_b_stacked[part][index, 0, :rows, :cols]
    landed = slot.landed[name]
    scaling = engine.layout_statement["targets"][module][1]
    want = landed.clone()
    if scaling != 1:
        want *= scaling  # as vLLM's LoRALayerWeights.optimize does
    if torch.equal(live, want):
        return landed
    back = live / scaling
    return torch.full_like(back, float("nan")) if torch.equal(back, landed) else back


# -- in a vLLM worker ----------------------------------------------------------------------------------------


def checkpoint_digest(vllm_config: Any) -> str:
    """refit.stages.lora.base_digest of the checkpoint vLLM loaded, read again with transformers in the dtype vLLM
    serves (it costs one load of the base on CPU). ValueError when vLLM did not load real weights."""
    model_config = vllm_config.model_config
    if str(vllm_config.load_config.load_format) == "dummy":
        raise ValueError(
            "vLLM was started with load_format='dummy': its base weights are random, not its checkpoint's; load the "
            "trainer's base checkpoint, or give VllmLoraOptions(base=refit.stages.lora.base_digest(base)) for the "
            "weights it serves"
        )
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        model_config.model, revision=model_config.revision, dtype=model_config.dtype
    )
    return base_digest(model)


def worker_lora_engine(worker: Any, options: VllmLoraOptions) -> VllmLoraEngine:
    """The LoRA engine of one vLLM worker (started with enable_lora=True, one worker: TP x PP = 1)."""
    runner = worker.model_runner
    manager = getattr(runner.get_model(), "lora_manager", None)
    if manager is None:
        raise ValueError("this vLLM serves no LoRA: start it with enable_lora=True (and max_loras, max_lora_rank)")
    workers = worker.vllm_config.parallel_config.world_size
    if workers != 1:
        raise ValueError(f"LoRA refits into vLLM take one worker (TP x PP = 1), not {workers}")
    base = options.base or checkpoint_digest(worker.vllm_config)

    def running() -> set[int]:
        batch = getattr(runner, "input_batch", None)
        return set(getattr(batch, "lora_id_to_request_ids", {}))

    return VllmLoraEngine(manager, runner.model_config.hf_config, options, base=base, running=running)


# -- the trainer's driver ------------------------------------------------------------------------------------


class VllmLoraRefit(VllmRefit):
    """Refits the LoRA adapter an offline `vllm.LLM` serves (started with `enable_lora=True`, `max_loras` and
    `max_lora_rank` large enough, and `worker_extension_cls="refit.integrations.vllm.RefitWorkerExtension"`),
    from a Sender of `refit.stages.lora.LoraSource`. Generate with `lora_request=driver.lora_request()`; wrap a
    request that must finish on its version in `with driver.pinned() as request:`.

    Each version is a vLLM adapter of its own name, so vLLM's prefix cache never serves one version's KV to
    another: a refit resets nothing."""

    def __init__(self, llm: Any, sender: Any, options: VllmLoraOptions) -> None:
        super().__init__(llm, sender)
        self.lora = options

    def connect(self) -> None:
        """Make the worker's LoRA engine and the Sender's session together (the handshake compares adapters)."""
        if self._connected:
            return
        args = (self.sender.rendezvous(), self.sender.settings.timeout_s, self.lora.to_json())
        self._concurrently(
            self.sender.connect,
            lambda: self.llm.collective_rpc("refit_lora_connect", args=args),
            on_engine_error=self.sender.close,
        )
        self._connected = True

    def refit(self, version: int) -> Any:
        """Push the adapter as `version`; new requests get it once this returns."""
        self.connect()
        try:
            stats = self._concurrently(
                lambda: self.sender.refit(version), lambda: self.llm.collective_rpc("refit_receive")
            )
        except HandshakeError:
            raise
        except Exception as e:
            self.failure = f"refit of version {version} failed: {e}"
            raise
        self.failure = ""
        return stats

    def lora_request(self) -> Any:
        """vLLM's `LoRARequest` of the version new requests get."""
        from vllm.lora.request import LoRARequest

        name, lora_id = self.llm.collective_rpc("refit_lora_request")[0]
        return LoRARequest(name, lora_id, lora_path=f"refit-in-memory:{name}")

    @contextlib.contextmanager
    def pinned(self) -> Iterator[Any]:
        """The current version's `LoRARequest`, its version kept registered in vLLM until the block ends."""
        request = self.lora_request()
        self.llm.collective_rpc("refit_lora_pin", args=(request.lora_int_id,))
        try:
            yield request
        finally:
            self.llm.collective_rpc("refit_lora_release", args=(request.lora_int_id,))

    @property
    def live(self) -> dict[int, int]:
        """The worker's live versions with their pins (see `VllmLoraEngine.live`)."""
        return {int(v): int(n) for v, n in self.llm.collective_rpc("refit_lora_live")[0]}

    def generate(self, prompts: Any, *args: Any, allow_failed: bool = False, **kwargs: Any) -> Any:
        """`llm.generate` with the current version's adapter (unless `lora_request=` is given). `allow_failed` is
        accepted and not needed: a failed LoRA refit leaves the current version serving, whole."""
        kwargs.setdefault("lora_request", self.lora_request())
        return self.llm.generate(prompts, *args, **kwargs)
