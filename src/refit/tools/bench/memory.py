"""MemoryProbe: the bytes one side of a refit allocates or maps, measured the way the forecast counts them.

What is predicted (`refit.layout.planner.forecast`) and measured here is the same quantity: bytes that
refit allocated or mapped in this process, whether or not a page was touched (resident-set growth is
no measure of it: a buffer never written stays out of it). Per transport:

- shm: the bucket buffers are shared segments that both sides map; measured from the kernel's list of
  this process's mappings (/proc/self/maps: every refit memfd or /dev/shm/refit-* file).
- gloo, nccl: each side allocates its buffers; cuda-ipc: the sender allocates them, receivers map them
  through IPC handles.
- every transport: the receiver's staging tensor for tensors that span buckets.

On CUDA, allocations are the caching allocator's peak (`max_memory_allocated`) over the baseline, plus
the bytes of the given tensors that lie outside every block of this process's allocator (IPC-mapped).
On CPU, where torch keeps no allocator statistics, allocations are the distinct storages of the given
tensors (the side's buffers and staging) that no file backs. Both are measurements of what exists,
never the forecast's arithmetic.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


def mapped_bytes() -> int:
    """Bytes of refit's shared-memory segments mapped into this process, from /proc/self/maps."""
    total = 0
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                if "memfd:refit-" in line or "/refit-" in line:
                    lo, hi = line.split(None, 1)[0].split("-")
                    total += int(hi, 16) - int(lo, 16)
    except OSError:
        return 0
    return total


def _storages(tensors: Iterable[torch.Tensor]) -> dict[int, tuple[torch.UntypedStorage, int]]:
    """Distinct storages by address, with their sizes."""
    seen: dict[int, tuple[torch.UntypedStorage, int]] = {}
    for t in tensors:
        s = t.untyped_storage()
        if s.nbytes():
            seen.setdefault(s.data_ptr(), (s, s.nbytes()))
    return seen


def _outside_allocator(tensors: Iterable[torch.Tensor], device: torch.device) -> int:
    """Bytes of CUDA tensors whose storage no block of this process's caching allocator holds (IPC-mapped)."""
    blocks = [(s["address"], s["address"] + s["total_size"]) for s in torch.cuda.memory_snapshot()]
    total = 0
    for ptr, (_, n) in _storages(t for t in tensors if t.device.type == "cuda").items():
        if not any(lo <= ptr < hi for lo, hi in blocks):
            total += n
    return total


class MemoryProbe:
    """Start it before anything to be measured exists; `measured(held)` is what this side allocated or mapped since."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._mapped = mapped_bytes()
        self._base = 0
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            self._base = torch.cuda.memory_allocated(device)

    def measured(self, held: Iterable[torch.Tensor] = ()) -> int:
        """Bytes allocated or mapped since the probe started; `held`: this side's refit tensors (its bucket
        buffers, the receiver's staging tensor), read while they are alive."""
        held = list(held)
        mapped = max(0, mapped_bytes() - self._mapped)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            allocated = torch.cuda.max_memory_allocated(self.device) - self._base
            return mapped + allocated + _outside_allocator(held, self.device)
        own = _storages(t for t in held if t.device.type == "cpu")
        return mapped + sum(n for s, n in own.values() if s.filename is None)

    def peak_extra(self) -> int:
        """`measured()` with no tensors given: shared segments mapped and, on CUDA, the allocator's peak."""
        return self.measured()
