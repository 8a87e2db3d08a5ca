"""Budget: how many bytes a bucket may hold, from explicit bytes or a ratio of free memory, capped at
what the model needs (its tensors laid end to end, each aligned): a small model gets small buffers."""

from __future__ import annotations

import os
from collections.abc import Iterable

import torch

from refit.layout.planner import DEFAULT_ALIGNMENT, align_up
from refit.layout.spec import TensorSpec

NUM_SLOTS = 2
"""Buffers per side: one being filled while the other is in flight."""


def free_bytes(device: torch.device) -> int:
    """Free memory where the bucket buffers will live (device memory, or host RAM and /dev/shm)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    free = mem_available()
    if os.path.isdir("/dev/shm"):
        st = os.statvfs("/dev/shm")
        free = min(free, st.f_bavail * st.f_frsize)
    return free


def mem_available() -> int:
    """Host memory available to new allocations without swapping (MemAvailable)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def bucket_capacity(
    *,
    bucket_bytes: int | None,
    ratio: float,
    free: int,
    num_slots: int = NUM_SLOTS,
    alignment: int = DEFAULT_ALIGNMENT,
    needed: int | None = None,
) -> int:
    """Capacity of one bucket: `bucket_bytes`, or `ratio` of `free` split over `num_slots` buffers, and
    never more than `needed` (the bytes of the whole model in one bucket, `needed_bytes`) when given."""
    raw = bucket_bytes if bucket_bytes is not None else int(free * ratio) // num_slots
    capacity = raw // alignment * alignment
    if capacity <= 0:
        raise ValueError(
            f"bucket capacity ({raw} bytes) is below the alignment ({alignment}); "
            "raise REFIT_BUFFER_MEMORY_RATIO or REFIT_BUCKET_BYTES, or free memory"
        )
    if needed is not None:
        capacity = min(capacity, max(alignment, align_up(needed, alignment)))
    return capacity


def needed_bytes(specs: Iterable[TensorSpec], *, alignment: int = DEFAULT_ALIGNMENT) -> int:
    """Bytes of a single bucket that holds every tensor of `specs`, each starting at a multiple of
    `alignment` (what `plan` lays out when nothing has to wait for a second bucket)."""
    return sum(align_up(s.nbytes, alignment) for s in specs)
