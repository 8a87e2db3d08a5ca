"""Verdicts: the doctor's checks turned into whether each transport works here, and what to change."""

from __future__ import annotations

import os

import torch

from refit.tools.diagnosis import FAIL, OK, WARN, Report, Verdict
from refit.transports import get as transport_class


def verdict(report: Report, transport: str) -> Verdict:
    """Turn the checks into whether `transport` works here."""
    if transport not in NEEDS:
        return _registered_verdict(report, transport)
    need = list(NEEDS[transport])
    if transport in ("cuda-ipc", "nccl"):
        need += [c.name for c in report.checks if c.name.startswith("memory cuda")]
    failed = _first_failure(report, transport, need)
    if failed is not None:
        return failed
    if transport == "cuda-ipc":
        return _cuda_ipc_verdict(report)
    nixl = report.by_name("nixl")
    if transport == "nixl" and nixl is not None and nixl.status != OK:
        return Verdict(transport=transport, status=FAIL, reason=f"nixl: {nixl.detail}", fix=nixl.fix)
    if transport == "nccl" and torch.cuda.device_count() < 2:
        return Verdict(
            transport=transport,
            status=WARN,
            reason="one GPU here: NCCL cannot put two ranks on one GPU, "
            "so nccl works only towards an engine on another host",
            fix="colocated on one GPU, use cuda-ipc",
        )
    shm = report.by_name("/dev/shm")
    if transport == "nccl" and shm is not None and shm.status != OK:
        return Verdict(transport=transport, status=WARN, reason=f"/dev/shm: {shm.detail}", fix=shm.fix)
    return Verdict(transport=transport, status=OK, reason=USE[transport])


NEEDS = {
    "shm": ["torch", "rendezvous", "/dev/shm", "memory cpu"],
    "gloo": ["torch", "rendezvous", "memory cpu"],
    "cuda-ipc": ["cuda", "rendezvous"],
    "nccl": ["cuda", "rendezvous", "nccl"],
    "nixl": ["torch", "rendezvous", "memory cpu", "nixl"],
}
"""The checks each built-in transport needs to pass."""


def _first_failure(report: Report, transport: str, need: list[str]) -> Verdict | None:
    for name in need:
        c = report.by_name(name)
        if c is not None and c.status == FAIL:
            return Verdict(transport=transport, status=FAIL, reason=f"{name}: {c.detail}", fix=c.fix)
    return None


def _registered_verdict(report: Report, transport: str) -> Verdict:
    """A transport from `refit.transports.register` or an entry point: refit knows only where its buffers live."""
    try:
        cls = transport_class(transport)
    except ValueError as e:
        return Verdict(transport=transport, status=FAIL, reason=str(e))
    if cls.device_type == "cuda":
        need = ["cuda", "rendezvous"] + [c.name for c in report.checks if c.name.startswith("memory cuda")]
    else:
        need = ["torch", "rendezvous", "memory cpu"]
    failed = _first_failure(report, transport, need)
    if failed is not None:
        return failed
    return Verdict(
        transport=transport,
        status=OK,
        reason=f"{cls.__module__}:{cls.__qualname__}, not built in: checked only what any {cls.device_type} "
        "transport needs",
    )


USE = {
    "shm": "colocated CPU: trainer and engine on this host share buffers in memfds (anonymous shared memory)"
    + ("" if hasattr(os, "memfd_create") else "; here, without memfd, files in /dev/shm"),
    "gloo": "CPU, any placement: a gloo broadcast over TCP, across hosts too",
    "cuda-ipc": "colocated GPU: the engine reads the trainer's device buffers through CUDA IPC handles",
    "nccl": "disaggregated GPU: an NCCL broadcast to engine GPUs on this or other hosts",
    "nixl": "CPU (or GPU with device=cuda), any placement: engines READ the trainer's registered buffers "
    "one-sided through NIXL over UCX, across hosts too; its data connections are not authenticated (docs/SECURITY.md)",
}


def _cuda_ipc_verdict(report: Report) -> Verdict:
    for name in ("allocator", "cuda-ipc probe"):
        c = report.by_name(name)
        if c is not None and c.status != OK:
            staged = report.by_name("/dev/shm")
            if staged is not None and staged.status == FAIL:
                return Verdict(
                    transport="cuda-ipc",
                    status=FAIL,
                    reason=f"{name}: {c.detail}; and /dev/shm for the fallback: {staged.detail}",
                    fix=c.fix,
                )
            return Verdict(
                transport="cuda-ipc",
                status=WARN,
                reason=f"{name}: {c.detail}; the Sender falls back to "
                "staging through pinned host memory (slower; zero_copy=True fails)",
                fix=c.fix,
            )
    if report.by_name("cuda-ipc probe") is None:
        return Verdict(transport="cuda-ipc", status=OK, reason=USE["cuda-ipc"] + " (probe not run)")
    return Verdict(transport="cuda-ipc", status=OK, reason=USE["cuda-ipc"] + " (probed)")
