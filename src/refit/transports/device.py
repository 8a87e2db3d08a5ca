"""Device: a CUDA device's identity (its UUID), and where that device is in this process.

Device indices are per process: `CUDA_VISIBLE_DEVICES` renumbers them, so index 0 in a trainer rank
can be index 1 in its engine worker. Anything that names a GPU across processes (IPC handles, which
worker a trainer rank feeds) names it by UUID and translates here.
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def _uuids() -> tuple[str, ...]:
    return tuple(str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count()))


def uuid(device: torch.device) -> str | None:
    """The UUID of a CUDA device (None for any other device)."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _uuids()[index]


def local_index(device_uuid: str) -> int | None:
    """This process's index of the GPU with that UUID, or None when it is not visible here."""
    try:
        return _uuids().index(device_uuid)
    except ValueError:
        return None
