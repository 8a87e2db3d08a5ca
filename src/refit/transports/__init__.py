"""Transports by name, imported lazily so optional dependencies stay optional."""

from __future__ import annotations

import importlib

import torch

from refit.log import get_logger
from refit.transports.base import Transport

_REGISTRY: dict[str, str] = {
    "shm": "refit.transports.shm:ShmTransport",
    "gloo": "refit.transports.gloo:GlooTransport",
    "cuda-ipc": "refit.transports.cuda_ipc:CudaIpcTransport",
    "nccl": "refit.transports.nccl:NcclTransport",
}
_CUDA = ("cuda-ipc", "nccl")
"""Transports whose buffers live on a GPU."""

log = get_logger("transports")


def names() -> list[str]:
    return list(_REGISTRY)


def get(name: str) -> type[Transport]:
    """The transport class registered as `name`."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown transport {name!r}; choose one of {names()}")
    module, cls = _REGISTRY[name].split(":")
    log.debug("transport %r is %s", name, _REGISTRY[name])
    return getattr(importlib.import_module(module), cls)


def unavailable(name: str) -> str:
    """Why transport `name` cannot run in this process, with the fix; '' when nothing rules it out.

    A cheap check (no device is touched beyond asking whether CUDA exists); `refit doctor` goes further.
    """
    get(name)
    if name not in _CUDA:
        return ""
    if not torch.cuda.is_available():
        build = (
            "a CPU-only build"
            if torch.version.cuda is None
            else f"built for CUDA {torch.version.cuda}, but no GPU is visible"
        )
        return (
            f"transport {name!r} needs a CUDA GPU, and this torch {torch.__version__} is {build}; "
            "use 'shm' (same host) or 'gloo' (across hosts) on CPU, or run on a GPU machine with a CUDA build of torch"
        )
    if name == "nccl" and not torch.distributed.is_nccl_available():
        return f"transport 'nccl' needs torch built with NCCL, and this torch {torch.__version__} has none; use 'gloo'"
    return ""


def default_device(name: str) -> torch.device:
    """Where a transport's buffers live by default; ValueError naming the fix where that is impossible."""
    if get(name).device_type == "cuda":
        reason = unavailable(name)
        if reason:
            raise ValueError(reason)
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
