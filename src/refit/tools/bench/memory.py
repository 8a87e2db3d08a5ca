"""MemoryProbe: a process's peak extra memory over a baseline, read from the allocator or the kernel.

On CUDA: the caching allocator's peak (`max_memory_allocated`) minus what was allocated when the
probe started. On Linux CPU: the resident-set high-water mark (VmHWM, reset through
/proc/self/clear_refs) minus the resident set when the probe started. Both are measurements, never
predictions; None where neither exists. The CPU figure counts pages touched, not bytes reserved (a
buffer never written stays out of it), and misses memory the process freed earlier and reuses.
"""

from __future__ import annotations

import torch


def _proc_status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


class MemoryProbe:
    """Start it before anything to be measured exists; `peak_extra()` is the peak since, over that baseline."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._base: int | None = None
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            self._base = torch.cuda.memory_allocated(device)
            return
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current resident set
        except OSError:
            return
        rss = _proc_status_kib("VmRSS")
        self._base = None if rss is None else rss * 1024

    def peak_extra(self) -> int | None:
        """Peak bytes above the baseline since the probe started (None where it cannot be read)."""
        if self._base is None:
            return None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return torch.cuda.max_memory_allocated(self.device) - self._base
        hwm = _proc_status_kib("VmHWM")
        return None if hwm is None else max(0, hwm * 1024 - self._base)
