"""Backend 'refit' of vLLM's trainer-side weight-transfer API: `WeightTransferTrainerFactory.trainer_init(
RefitTrainerInitInfo(rank=...), client=..., source=...)` returns an engine whose `send_weights()` is one refit.

The control plane is vLLM's own `VLLMWeightSyncClient` (HTTP or Ray, or any object with its four methods),
the weights come from vLLM's own `WeightSource` (read through `StreamSource`), and the refit itself is
`VllmRefit` on a `Sender`: the session's handshake once, buckets, verification, commit, and the version
set where vLLM's `get_weight_version` reads it. Imports vLLM: a trainer that uses vLLM's API has it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Self

from vllm.distributed.weight_transfer.base import TrainerInitInfo, TrainerWeightTransferEngine

from refit.errors import RefitError
from refit.integrations.vllm.cache import CachePolicy, check_cache_policy
from refit.integrations.vllm.driver import HttpEngine, VllmRefit
from refit.integrations.vllm.engine import BACKEND, VllmOptions
from refit.integrations.vllm.weight_source import StreamSource
from refit.log import get_logger
from refit.settings import Settings
from refit.topology.options import SenderOptions, Verify
from refit.topology.sender import Sender
from refit.topology.stats import RefitStats

log = get_logger("vllm")


@dataclass
class RefitTrainerInitInfo(TrainerInitInfo):
    """Trainer-side init info of backend 'refit' (the engine's side is `RefitInitInfo`, sent by the trainer)."""

    backend: ClassVar[str] = BACKEND

    transport: str = "shm"
    """refit transport: 'shm' (same host, CPU), 'gloo' (CPU across hosts), 'cuda-ipc', 'nccl'."""
    num_receivers: int | None = None
    """vLLM's workers (TP x PP), each a receiver; None: asked from the server (vLLM's HTTP client), else 1."""
    settings: Settings | None = None
    """refit's Settings (bucket size, timeouts, token, listen host); None: from the environment."""
    verify: Verify = "fingerprint"
    """The Sender's `verify`: 'fingerprint' (the default, as for Sender) or 'strict' compare the engine's tensors
    with the trainer's before the version commits; None sends unverified."""
    first_version: int = 1
    """The version of the first `send_weights()`; each committed round adds one (a failed one is retried as is)."""
    options: VllmOptions = field(default_factory=VllmOptions)
    """How each worker loads (`VllmOptions`)."""
    staged: bool = False
    """Workers receive each round into staging memory while vLLM generates; generation pauses (mode 'keep')
    only for the final copy, the version and the prefix-cache reset (`VllmRefit(staged=True)`)."""
    cache_policy: CachePolicy = "reset"
    """vLLM's prefix cache at each commit: 'reset' drops it; 'salt' keeps it and starts a new cache salt
    (`engine.cache_salt`, to send as `cache_salt` with every request); 'keep' leaves stale KV (measuring only)."""

    def __post_init__(self) -> None:
        check_cache_policy(self.cache_policy)
        if self.num_receivers is not None and self.num_receivers < 1:
            raise ValueError(f"num_receivers ({self.num_receivers}) must be >= 1: one per vLLM worker (TP x PP)")


class ClientEngine:
    """A `VLLMWeightSyncClient` seen with the methods `VllmRefit` drives (those of an offline `vllm.LLM`)."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self._warned = False
        self._warned_pause = False

    def init_weight_transfer_engine(self, request: dict) -> None:
        self.client.init_weight_transfer_engine(request["init_info"])

    def start_weight_update(self) -> None:
        self.client.start_weight_update()

    def start_draft_weight_update(self) -> None:
        """vLLM's draft session, where the client has it (else the server's route for vLLM's HTTP client)."""
        if not self._own_or_http("start_draft_weight_update"):
            raise RefitError(f"the vLLM client {type(self.client).__name__} cannot start a draft weight update")

    def update_weights(self, request: dict) -> None:
        self.client.update_weights(request["update_info"])

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.client.finish_weight_update(weight_version)

    def _http(self) -> HttpEngine | None:
        base_url = getattr(self.client, "base_url", None)
        if not isinstance(base_url, str):
            return None
        return HttpEngine(base_url, timeout_s=float(getattr(self.client, "timeout", 600.0)))

    def _own_or_http(self, method: str, **kwargs: Any) -> bool:
        """Call `method` on the client where it has it, else on the server's route (vLLM's HTTP client);
        False where it has neither."""
        own, http = getattr(self.client, method, None), self._http()
        if callable(own):
            own(**kwargs)
        elif http is not None:
            getattr(http, method)(**kwargs)
        return callable(own) or http is not None

    def pause_generation(self, *, mode: str = "abort") -> None:
        """vLLM's pause, through the client's own method or the server's /pause route (vLLM's HTTP client);
        a client with neither is not paused (vLLM still applies the update between two engine steps)."""
        if not self._own_or_http("pause_generation", mode=mode) and not self._warned_pause:
            self._warned_pause = True
            log.warning(
                "the vLLM client %s cannot pause generation: the staged version is applied between two engine "
                "steps, and a step may run between the new weights and the prefix-cache reset",
                type(self.client).__name__,
            )

    def resume_generation(self) -> None:
        self._own_or_http("resume_generation")

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool | None:
        """Drop KV computed with the old weights: through the client's own method where it has one, the
        server's route for vLLM's HTTP client, each actor for its Ray client; else say once that it cannot.
        Returns whether vLLM reset it (None where the client does not say)."""
        own = getattr(self.client, "reset_prefix_cache", None)
        handles = getattr(self.client, "handles", None)
        http = self._http()
        if callable(own):
            return own()
        if http is not None:
            return http.reset_prefix_cache(reset_running_requests=reset_running_requests)
        if isinstance(handles, list):
            import ray

            return all(ray.get([h.reset_prefix_cache.remote(reset_running_requests) for h in handles]))
        if not self._warned:
            self._warned = True
            log.warning(
                "the vLLM client %s has no way to reset the prefix cache: cached prompts keep KV computed with "
                "the old weights; give it a reset_prefix_cache() method",
                type(self.client).__name__,
            )
        return None


class RefitTrainerWeightTransferEngine(TrainerWeightTransferEngine[RefitTrainerInitInfo]):
    """Trainer side of backend 'refit' in vLLM's API. `send_weights()` on the sender (rank 0) is one refit of
    the source's weights, committed as the next version; on other ranks it takes one pass of the source, as
    the sender does, so sources that materialise collectively stay in lockstep."""

    init_info_cls = RefitTrainerInitInfo

    def __init__(
        self,
        *,
        client: Any,
        source: Any,
        is_sender: bool = True,
        driver: VllmRefit | None = None,
        first_version: int = 1,
    ) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.driver = driver
        self.next_version = first_version
        self.last_stats: RefitStats | None = None
        """The last committed round's RefitStats (the sender only)."""

    @classmethod
    def trainer_init(cls, init_info: RefitTrainerInitInfo, *, client: Any, source: Any = None) -> Self:
        """On the sender: the Sender's session and vLLM's side (`client.init_weight_transfer_engine`), set up
        together, once. Other ranks set up nothing."""
        if source is None:
            raise ValueError(
                "backend 'refit' requires a WeightSource (it sends the whole model every round): pass source= "
                "(vLLM's ModuleSource(model) or any WeightSource)"
            )
        if not init_info.is_sender:
            return cls(client=client, source=source, is_sender=False, first_version=init_info.first_version)
        options = SenderOptions(
            transport=init_info.transport,
            num_receivers=_num_receivers(init_info.num_receivers, client),
            verify=init_info.verify,
        )
        sender = Sender(StreamSource(source), options, settings=init_info.settings)
        driver = VllmRefit(
            ClientEngine(client),
            sender,
            options=init_info.options,
            staged=init_info.staged,
            cache_policy=init_info.cache_policy,
        )
        driver.connect()  # on failure the Sender is closed already
        return cls(client=client, source=source, driver=driver, first_version=init_info.first_version)

    def send_weights(self, *, version: int | None = None) -> RefitStats | None:
        """One refit as `version` (default: the next one): vLLM's start, update and finish calls with the
        Sender's buckets, verification and commit, vLLM's weight version set to `str(version)`, then its
        prefix cache as the init info's `cache_policy` says (reset by default). Returns the sender's
        RefitStats (None on other ranks)."""
        version = self.next_version if version is None else version
        if not self.is_sender:
            for _ in self.source:
                pass
            self.next_version = version + 1
            return None
        assert self.driver is not None  # trainer_init makes every sender with one
        stream = self.driver.sender.source
        stream.begin_round()
        committed = False
        try:
            self.last_stats = self.driver.refit(version)
            committed = True
        finally:
            stream.end_round(drain=not committed)
        self.next_version = version + 1
        return self.last_stats

    @property
    def cache_salt(self) -> str | None:
        """Cache policy 'salt': the committed version's salt, to send as `cache_salt` with every request
        (vLLM's OpenAI routes and prompts take it); None under other policies, before the first commit, and
        on ranks other than the sender."""
        return None if self.driver is None else self.driver.cache_salt

    def shutdown(self) -> None:
        """Close the Sender, then release vLLM's side (`shutdown_weight_transfer_engine`) where the client can."""
        if self.driver is not None:
            self.driver.close()
            self.driver = None
        release = getattr(self.client, "shutdown_weight_transfer_engine", None)
        if self.is_sender and callable(release):
            release()


def _num_receivers(stated: int | None, client: Any) -> int:
    """The receivers to wait for: vLLM's workers (TP x PP) where the server can say (its /get_world_size),
    checked against what the init info states; else the stated number, or 1."""
    base_url = getattr(client, "base_url", None)
    if not isinstance(base_url, str):
        return stated or 1
    import json
    import urllib.error
    import urllib.request

    url = f"{base_url}/get_world_size?include_dp=false"
    try:
        with urllib.request.urlopen(url, timeout=float(getattr(client, "timeout", 60.0))) as resp:  # noqa: S310 - vLLM's own client URL
            workers = int(json.loads(resp.read())["world_size"])
    except (urllib.error.URLError, OSError, ValueError, KeyError) as e:
        raise RefitError(
            f"cannot ask the vLLM server at {base_url} for its workers ({e}): is it up, and started with "
            "VLLM_SERVER_DEV_MODE=1 (which enables its weight-transfer routes)?"
        ) from None
    if stated is not None and stated != workers:
        raise ValueError(
            f"the vLLM server at {base_url} has {workers} workers (TP x PP), each a receiver: "
            f"set num_receivers={workers} (or leave it None), not {stated}"
        )
    return workers


def register_trainer() -> None:
    """Make backend 'refit' known to `WeightTransferTrainerFactory` (done when this module is imported, and
    by the `vllm.general_plugins` entry point in every vLLM process)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    if BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(BACKEND, RefitTrainerWeightTransferEngine)


register_trainer()
