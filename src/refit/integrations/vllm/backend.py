"""Backend 'refit' of vLLM's weight-transfer API (worker side), registered by the `vllm.general_plugins`
entry point. Unstaged, the whole refit (begin, buckets, commit) runs in `update_weights`. Staged
(`RefitInitInfo.staged`), a thread started at init receives every refit into staging memory while vLLM
keeps generating with the version it holds, and `update_weights` only applies the staged version (the
final copy), which the trainer brackets with vLLM's pause and resume. Imports vLLM: loaded only inside
a vLLM process."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.weight_transfer.base import WeightTransferEngine

from refit.errors import PeerError, RefitError
from refit.integrations.vllm.draft import DRAFT_PREFIX, DraftedEngine
from refit.integrations.vllm.engine import (
    BACKEND,
    VllmEngine,
    engine_device,
    engine_seconds,
    parse_options,
    worker_index,
)
from refit.integrations.vllm.receiving import make_receiver
from refit.log import get_logger
from refit.topology.ranked import pick

log = get_logger("vllm")


@dataclass
class RefitInitInfo:
    rendezvous: dict | list = field(default_factory=dict)
    """What `Sender.rendezvous()` returned, or (per-rank refit) `RankedRefit.rendezvous()`: every trainer
    rank's, of which each worker takes the one on its own device (refit.topology.ranked.pick)."""
    timeout_s: float = 120.0
    options: dict = field(default_factory=dict)
    """`VllmOptions` fields."""
    staged: bool = False
    """Receive each refit into staging memory on a background thread while vLLM keeps generating;
    `update_weights` then applies the staged version (one local copy into vLLM's tensors)."""


@dataclass
class RefitUpdateInfo:
    version: int = 0


class RefitWeightTransferEngine(WeightTransferEngine):
    """Worker side of backend 'refit': the whole refit (begin, buckets, commit) runs in `update_weights`."""

    init_info_cls = RefitInitInfo
    update_info_cls = RefitUpdateInfo
    supports_draft_weight_update = True
    """vLLM's draft session (`start_draft_weight_update`) carries the target and the draft as one refit."""

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
            staged=init_info.staged,
            drafted=self._has_draft(),
        )
        self.options = parse_options(init_info.options)
        self.last: dict[str, float] = {}
        self.staged = StagedReceipts(self.receiver, init_info.timeout_s) if init_info.staged else None

    def _has_draft(self) -> bool:
        spec = getattr(self.vllm_config, "speculative_config", None)
        self._said_stale_draft = False
        return getattr(spec, "draft_model_config", None) is not None

    def start_weight_update(self) -> None:
        """The receiver begins the version when the first header arrives. In vLLM's draft session (its
        `start_draft_weight_update` made the draft model this engine's target) the draft joins the engine,
        so this refit carries the target's and the draft's tensors, committed as one version."""
        if self.model is self._default_model:
            engine = self._open().engine
            if isinstance(engine, DraftedEngine) and engine.draft is None and not self._said_stale_draft:
                self._said_stale_draft = True
                log.warning(
                    "this vLLM runs a speculative draft model, but the refit carries no %s* tensors: the draft "
                    "keeps the weights it loaded (its acceptance rate falls as the target trains); send both "
                    "(refit.integrations.vllm.drafted) and VllmRefit refits them as one version",
                    DRAFT_PREFIX,
                )
            return
        engine = self._open().engine
        if not isinstance(engine, DraftedEngine):
            raise RefitError("vLLM started a draft weight update, but this worker was set up without a draft model")
        if engine.draft is None or engine.draft.model is not self.model:
            engine.attach(VllmEngine(self.model, self.model_config, self.options))

    def receive_weights(self, update_info: RefitUpdateInfo) -> None:
        stats = self._open().receive()
        if stats is None:
            raise RefitError("the trainer closed the refit session")
        self.last = {**engine_seconds(self.receiver.engine, stats.seconds), "received_bytes": float(stats.nbytes)}
        if stats.version != update_info.version:
            raise RefitError(f"received version {stats.version}, but update_weights asked for {update_info.version}")

    def update_weights(self, update_info: dict[str, Any]) -> None:
        info = self.parse_update_info(update_info)
        self._open()
        if self.staged is None:
            self.receive_weights(info)
            return
        t = time.perf_counter()
        stats = self.staged.apply(info.version)
        live = self.receiver.staging.live  # type: ignore[union-attr]
        self.last = {
            **engine_seconds(live, stats.seconds),
            "received_bytes": float(stats.nbytes),
            "apply": time.perf_counter() - t,
        }

    def finish_weight_update(self) -> None:
        """Nothing to do: the receiver already committed (vLLM's post-processing ran in commit)."""

    def shutdown(self) -> None:
        # Dropped, not only closed: the worker's weights version must then come from whichever receiver
        # the worker holds next (the worker extension's), not from this closed session.
        receiver = getattr(self, "receiver", None)
        self.receiver = None
        self.staged = None
        if receiver is not None:
            receiver.close()

    def _open(self) -> Any:
        if getattr(self, "receiver", None) is None:
            raise RefitError(
                "refit's weight transfer engine is not initialized (never, or shut down since): call "
                "init_weight_transfer_engine first"
            )
        return self.receiver


class StagedReceipts:
    """A staged Receiver served on a daemon thread (vLLM's engine core keeps stepping meanwhile), and
    what it received: `apply(version)` waits for that version to be staged, then applies it."""

    def __init__(self, receiver: Any, timeout_s: float) -> None:
        self.receiver = receiver
        self.timeout_s = timeout_s
        self._cond = threading.Condition()
        self._stats: Any = None
        self._failure = ""
        self._ended = ""
        self._thread = threading.Thread(target=self._serve, name="refit-staged-receive", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                stats = self.receiver.receive()
            except PeerError as e:  # the session is over
                self._end(f"the refit session broke: {e}")
                return
            except RefitError as e:  # a refused manifest or failed refit: nothing staged, the session goes on
                with self._cond:
                    self._failure = str(e)
                    self._cond.notify_all()
                continue
            except Exception as e:  # noqa: BLE001 - recorded for the next apply, which raises it
                self._end(f"receiving failed: {type(e).__name__}: {e}")
                raise
            if stats is None:
                self._end("the trainer closed the refit session")
                return
            with self._cond:
                self._stats, self._failure = stats, ""
                self._cond.notify_all()

    def _end(self, why: str) -> None:
        with self._cond:
            self._ended = why
            self._cond.notify_all()

    def apply(self, version: int) -> Any:
        """Apply staged `version` (every worker's verdict is in once the trainer's refit returned; its
        COMMIT may still be in flight here, hence the bounded wait) and return its receive stats."""
        with self._cond:
            done = self._cond.wait_for(
                lambda: (self._stats is not None and self._stats.version == version) or self._ended,
                timeout=self.timeout_s,
            )
            stats = self._stats
        if not done or stats is None or stats.version != version:
            why = self._ended or self._failure or f"nothing arrived within {self.timeout_s:.0f} s"
            raise RefitError(
                f"version {version} is not staged in this worker ({why}): call update_weights only after the "
                "trainer's refit of that version returned"
            )
        if not self.receiver.apply_staged() and self.receiver.staging.live.weights.version != version:
            raise RefitError(f"version {version} was staged but is no longer ready (a newer refit replaced it)")
        return stats


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
