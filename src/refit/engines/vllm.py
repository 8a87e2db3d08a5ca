"""vLLM engine: a Receiver inside each vLLM worker, loading through vLLM's own weight loading.

Three parts:
- `VllmEngine`: the Engine for one worker's model (checkpoint names in, vLLM fuses and shards).
- `RefitWeightTransferEngine`: the worker side of vLLM's weight-transfer API, registered as backend
  'refit' by the `vllm.general_plugins` entry point (`refit.engines.vllm:register`).
- `RefitWorkerExtension`: the same receiver for `worker_extension_cls=`, driven by collective_rpc.
- `VllmRefit`: the trainer-side driver for an offline `vllm.LLM`.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from refit.engines.base import Engine
from refit.errors import HandshakeError, RefitError
from refit.receiver import Receiver
from refit.settings import Settings
from refit.spec import TensorSpec, dtype_from_name, dtype_name

BACKEND = "refit"


def layout(model: torch.nn.Module) -> dict[str, list[str]]:
    """For each vLLM parameter, the checkpoint names concatenated (along dim 0) into it."""
    packed: dict[str, list[str]] = dict(getattr(model, "packed_modules_mapping", None) or {})
    out: dict[str, list[str]] = {}
    for name, _ in model.named_parameters():
        parts = name.split(".")
        hit = next((i for i, part in enumerate(parts) if part in packed), None)
        out[name] = [name] if hit is None else [".".join([*parts[:hit], sub, *parts[hit + 1 :]]) for sub in packed[parts[hit]]]
    return out


def checkpoint_names(model: torch.nn.Module) -> dict[str, torch.dtype]:
    """The checkpoint tensor names a vLLM model loads, with the dtype it holds them in.

    vLLM fuses some checkpoint tensors into one parameter (q/k/v into qkv_proj, gate/up into
    gate_up_proj); its `packed_modules_mapping` says which, so each fused name expands to its parts.
    """
    params = dict(model.named_parameters())
    return {part: params[name].dtype for name, parts in layout(model).items() for part in parts}


class VllmEngine(Engine):
    """One vLLM worker's model. Validates names and dtypes; vLLM's loader checks shapes as it loads."""

    exact_shapes = False

    def __init__(self, model: torch.nn.Module, model_config: Any) -> None:
        super().__init__()
        self.model = model
        self.model_config = model_config
        self._expected = checkpoint_names(model)
        tied = bool(getattr(getattr(model_config, "hf_config", None), "tie_word_embeddings", False))
        self.optional_names = frozenset({"lm_head.weight"} - self._expected.keys()) if tied else frozenset()

    def specs(self) -> list[TensorSpec]:
        return [TensorSpec(n, (), dt) for n, dt in self._expected.items()]

    def begin(self, version: int) -> None:
        from vllm.model_executor.model_loader.reload.layerwise import initialize_layerwise_reload

        super().begin(version)
        initialize_layerwise_reload(self.model)

    def load(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        # vLLM holds on to a layer's tensors until the whole layer arrived, which can be after
        # this bucket's buffer is reused: hand it copies, never views into the buffer.
        self.model.load_weights([(n, t.clone()) for n, t in tensors])

    def commit(self, version: int) -> None:
        from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)
        super().commit(version)

    def fail(self, version: int, reason: str) -> None:
        from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

        super().fail(version, reason)
        try:  # put every layer back on real storage; values stay mixed until a retry succeeds
            finalize_layerwise_reload(self.model, self.model_config)
        except Exception:
            pass


def _receiver(model: torch.nn.Module, model_config: Any, device: torch.device, rendezvous: dict, timeout_s: float) -> Receiver:
    engine = VllmEngine(model, model_config)
    receiver = Receiver(engine, rendezvous, settings=Settings(timeout_s=timeout_s), device=device)
    receiver.connect()
    return receiver


def _device(vllm_device: torch.device, transport: str) -> torch.device:
    return vllm_device if transport in ("cuda-ipc", "nccl") else torch.device("cpu")


# -- vLLM's weight-transfer API ------------------------------------------------------------------


@dataclass
class RefitInitInfo:
    rendezvous: dict = field(default_factory=dict)
    """What `Sender.rendezvous()` returned."""
    timeout_s: float = 120.0


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
        transport = str(init_info.rendezvous.get("transport", ""))
        self.receiver = _receiver(self.model, self.model_config, _device(self.device, transport),
                                  init_info.rendezvous, init_info.timeout_s)  # fmt: skip

    def start_weight_update(self) -> None:
        """Nothing to do: the receiver begins the version when the first header arrives."""

    def receive_weights(self, update_info: RefitUpdateInfo) -> None:
        stats = self.receiver.receive()
        if stats is None:
            raise RefitError("the trainer closed the refit session")
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


def register() -> None:
    """The `vllm.general_plugins` entry point: make backend 'refit' known in every vLLM process."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, "refit.engines.vllm", "RefitWeightTransferEngine")


# -- worker extension ----------------------------------------------------------------------------


class RefitWorkerExtension:
    """Mixed into each vLLM worker with `worker_extension_cls="refit.engines.vllm.RefitWorkerExtension"`.

    Every argument and result is plain JSON-like data, as collective_rpc needs.
    """

    def refit_connect(self, rendezvous: dict, timeout_s: float = 120.0) -> int:
        runner = self.model_runner  # type: ignore[attr-defined]
        device = _device(runner.device, str(rendezvous.get("transport", "")))
        self.refit_receiver = _receiver(runner.get_model(), runner.model_config, device, rendezvous, timeout_s)
        return self.refit_receiver.rank

    def refit_receive(self) -> dict | None:
        stats = self.refit_receiver.receive()
        return None if stats is None else stats.to_json()

    def refit_weights_version(self) -> dict:
        w = self.refit_receiver.engine.weights
        return {"state": w.state.value, "version": w.version, "target": w.target, "reason": w.reason}

    def refit_layout(self) -> dict[str, list]:
        """{vLLM parameter: [its dtype name, [the checkpoint names fused into it]]} for every parameter
        that still holds its values in checkpoint layout. vLLM may repack others after loading (the CPU
        build moves linear weights into its kernels' own format); those are left out."""
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        params = dict(model.named_parameters())
        return {n: [dtype_name(params[n].dtype), parts] for n, parts in layout(model).items() if params[n].numel() > 0}

    def refit_fingerprints(self) -> dict[str, str]:
        """Bitwise fingerprints of the parameters `refit_layout` lists (vLLM's fused names, its own dtypes)."""
        from refit.verify import fingerprint

        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        return {n: fingerprint(p, p.dtype) for n, p in model.named_parameters() if p.numel() > 0}

    def refit_close(self) -> None:
        self.refit_receiver.close()


def expected_fingerprints(sent: dict[str, torch.Tensor], worker_layout: dict[str, list]) -> dict[str, str]:
    """What `refit_fingerprints` must return (tensor parallel size 1) once `sent` (wire tensors) is loaded."""
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

    The workers' receive runs through vLLM's own calls (which block) while the Sender pushes from a
    background thread; a worker's exception surfaces here with its message.
    """

    def __init__(self, llm: Any, sender: Any) -> None:
        self.llm = llm
        self.sender = sender
        self._connected = False
        config = getattr(getattr(llm, "llm_engine", None), "vllm_config", None)
        workers = config.parallel_config.world_size if config is not None else sender.num_receivers
        if workers != sender.num_receivers:
            raise ValueError(f"this vLLM has {workers} workers (TP x PP), each a receiver: make the Sender with "
                             f"num_receivers={workers}, not {sender.num_receivers}")  # fmt: skip
        self.failure = ""
        """Why the last refit failed partway (vLLM then holds mixed weights); empty when current."""

    def _concurrently(self, trainer_side: Any, engine_side: Any) -> Any:
        result: dict[str, Any] = {}

        def run() -> None:
            try:
                result["value"] = trainer_side()
            except BaseException as e:  # re-raised in the caller's thread
                result["error"] = e

        thread = threading.Thread(target=run, name="refit-sender", daemon=True)
        thread.start()
        try:
            engine_side()
        except Exception as e:
            thread.join(self.sender.settings.timeout_s)
            raise RefitError(f"vLLM worker failed: {e}") from e
        thread.join()
        if "error" in result:
            raise result["error"]
        return result.get("value")

    def connect(self) -> None:
        if self._connected:
            return
        info = {"rendezvous": self.sender.rendezvous(), "timeout_s": self.sender.settings.timeout_s}
        self._concurrently(self.sender.connect, lambda: self.llm.init_weight_transfer_engine({"init_info": info}))
        self._connected = True

    def refit(self, version: int):
        """Push the source's weights as `version`, then drop KV computed with the old weights."""
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
        return stats

    def generate(self, *args: Any, allow_failed: bool = False, **kwargs: Any) -> Any:
        """`llm.generate`, refused while the weights are mixed after a failed refit."""
        if self.failure and not allow_failed:
            raise RefitError(f"vLLM holds mixed weights ({self.failure}); retry the refit, or pass allow_failed=True")
        return self.llm.generate(*args, **kwargs)

    def close(self) -> None:
        self.sender.close()
