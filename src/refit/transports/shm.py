"""shm transport: colocated CPU processes share bucket buffers through memory-mapped files in /dev/shm."""

from __future__ import annotations

import os
import tempfile

import torch

from refit.errors import PeerError
from refit.settings import Settings
from refit.transports.base import DONE, Pending, Transport


def _shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


class ShmTransport(Transport):
    """Buffers are shared memory: 'sending' is writing them; the bucket header says when they are ready.

    The files are unlinked as soon as every receiver has mapped them, so nothing is left behind even
    if a process dies.
    """

    name = "shm"
    device_type = "cpu"

    def __init__(self, buffers: list[torch.Tensor], paths: list[str]) -> None:
        self.buffers = buffers
        self._paths = paths
        self._pinned = [b for b in buffers if _pin(b)]

    @classmethod
    def offer(
        cls, *, capacity: int, num_slots: int, num_receivers: int, device: torch.device, settings: Settings
    ) -> tuple[Transport, dict]:
        paths, buffers = [], []
        for slot in range(num_slots):
            path = os.path.join(_shm_dir(), f"refit-{os.getpid()}-{settings.token[:8]}-{id(paths):x}-{slot}")
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            try:
                os.ftruncate(fd, capacity)
            finally:
                os.close(fd)
            paths.append(path)
            # Touch every page now, so no refit pays the first-use page faults.
            buffers.append(torch.from_file(path, shared=True, size=capacity, dtype=torch.uint8).zero_())
        return cls(buffers, paths), {"paths": paths, "capacity": capacity}

    @classmethod
    def join(cls, info: dict, *, rank: int, device: torch.device, settings: Settings) -> Transport:
        paths, capacity = info.get("paths"), info.get("capacity")
        if not isinstance(paths, list) or not isinstance(capacity, int):
            raise PeerError(f"shm setup info is malformed: {info!r:.200}")
        buffers = []
        for path in paths:
            if not isinstance(path, str) or not os.path.basename(path).startswith("refit-"):
                raise PeerError(f"shm setup names an unexpected path {path!r}")
            try:
                size = os.stat(path).st_size
            except OSError as e:
                raise PeerError(f"cannot open shared buffer {path}: {e}; are both sides on one host?") from None
            if size != capacity:
                raise PeerError(f"shared buffer {path} has {size} bytes, expected {capacity}")
            buffers.append(torch.from_file(path, shared=True, size=capacity, dtype=torch.uint8))
        return cls(buffers, [])

    def joined(self) -> None:
        self._unlink()

    def send(self, slot: int, nbytes: int) -> Pending:
        return DONE

    def recv(self, slot: int, nbytes: int) -> Pending:
        return DONE

    def _unlink(self) -> None:
        for path in self._paths:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        self._paths = []

    def close(self) -> None:
        self._unlink()
        for b in self._pinned:
            torch.cuda.cudart().cudaHostUnregister(b.data_ptr())
        self._pinned = []
        self.buffers = []


def _pin(buf: torch.Tensor) -> bool:
    """Page-lock a shared buffer where a GPU is present, so copies to and from the device run at full speed."""
    if not torch.cuda.is_available() or buf.numel() == 0:
        return False
    try:
        return int(torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), buf.numel(), 0)) == 0
    except Exception:  # pinning is an optimisation; unpinned memory still works
        return False
