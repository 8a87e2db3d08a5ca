"""Backend 'refit' of vLLM's weight-transfer API (worker side), registered by the `vllm.general_plugins`
entry point; the whole refit (begin, buckets, commit) runs in `update_weights`. Imports vLLM: loaded only
inside a vLLM process."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.weight_transfer.base import WeightTransferEngine

from refit.errors import RefitError
from refit.integrations.vllm.engine import (
    BACKEND,
    engine_device,
    engine_seconds,
    make_receiver,
    parse_options,
    worker_index,
)
from refit.topology.ranked import pick


@dataclass
class RefitInitInfo:
    rendezvous: dict | list = field(default_factory=dict)
    """What `Sender.rendezvous()` returned, or (per-rank refit) `RankedRefit.rendezvous()`: every trainer
    rank's, of which each worker takes the one on its own device (refit.topology.ranked.pick)."""
    timeout_s: float = 120.0
    options: dict = field(default_factory=dict)
    """`VllmOptions` fields."""


@dataclass
class RefitUpdateInfo:
    version: int = 0


class RefitWeightTransferEngine(WeightTransferEngine):
    """Worker side of backend 'refit': the whole refit (begin, buckets, commit) runs in `update_weights`."""

    init_info_cls = RefitInitInfo
    update_info_cls = RefitUpdateInfo
    supports_draft_weight_update = False

    def init_transfer_engine(self, init_info: RefitInitInfo) -> None:
        rendezvous = pick(init_info.rendezvous, self.device, index=worker_index())
        transport = str(rendezvous.get("transport", ""))
        self.receiver = make_receiver(
            self.model,
            self.model_config,
            engine_device(self.device, transport),
            rendezvous,
            init_info.timeout_s,
            parse_options(init_info.options),
        )
        self.last: dict[str, float] = {}

    def start_weight_update(self) -> None:
        """Nothing to do: the receiver begins the version when the first header arrives."""

    def receive_weights(self, update_info: RefitUpdateInfo) -> None:
        stats = self.receiver.receive()
        if stats is None:
            raise RefitError("the trainer closed the refit session")
        self.last = {**engine_seconds(self.receiver.engine, stats.seconds), "received_bytes": float(stats.nbytes)}
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
    """The `vllm.general_plugins` entry point: make backend 'refit' known in every vLLM process, to both
    factories (the trainer side's too, for a trainer in a process that runs vLLM)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    from refit.integrations.vllm.trainer import register_trainer

    register_trainer()

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(
            BACKEND, "refit.integrations.vllm.backend", "RefitWeightTransferEngine"
        )
