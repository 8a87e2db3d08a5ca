"""Transports by name, imported lazily so optional dependencies stay optional."""

from __future__ import annotations

import importlib

import torch

from refit.transports.base import Transport

_REGISTRY: dict[str, str] = {
    "shm": "refit.transports.shm:ShmTransport",
    "gloo": "refit.transports.gloo:GlooTransport",
    "cuda-ipc": "refit.transports.cuda_ipc:CudaIpcTransport",
    "nccl": "refit.transports.nccl:NcclTransport",
}


def names() -> list[str]:
    return list(_REGISTRY)


def get(name: str) -> type[Transport]:
    """The transport class registered as `name`."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown transport {name!r}; choose one of {names()}")
    module, cls = _REGISTRY[name].split(":")
    return getattr(importlib.import_module(module), cls)


def default_device(name: str) -> torch.device:
    """Where a transport's buffers live by default."""
    if get(name).device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
