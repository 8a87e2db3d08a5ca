"""Budget: how many bytes a bucket may hold, from explicit bytes or a ratio of free memory."""

from __future__ import annotations

import os

import torch

from refit.layout.planner import DEFAULT_ALIGNMENT

NUM_SLOTS = 2
"""Buffers per side: one being filled while the other is in flight."""


def free_bytes(device: torch.device) -> int:
    """Free memory where the bucket buffers will live (device memory, or host RAM and /dev/shm)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    free = _mem_available()
    if os.path.isdir("/dev/shm"):
        st = os.statvfs("/dev/shm")
        free = min(free, st.f_bavail * st.f_frsize)
    return free


def _mem_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def bucket_capacity(
    *, bucket_bytes: int | None, ratio: float, free: int, num_slots: int = NUM_SLOTS, alignment: int = DEFAULT_ALIGNMENT
) -> int:
    """Capacity of one bucket: `bucket_bytes`, or `ratio` of `free` split over `num_slots` buffers."""
    raw = bucket_bytes if bucket_bytes is not None else int(free * ratio) // num_slots
    capacity = raw // alignment * alignment
    if capacity <= 0:
        raise ValueError(
            f"bucket capacity ({raw} bytes) is below the alignment ({alignment}); "
            "raise REFIT_BUFFER_MEMORY_RATIO or REFIT_BUCKET_BYTES, or free memory"
        )
    return capacity
