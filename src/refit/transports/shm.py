"""shm transport: colocated CPU processes share bucket buffers through anonymous shared memory.

Each buffer is a memfd (no name in any file system): receivers map it through the sender's
`/proc/<pid>/fd/<n>`, and the kernel frees it once the last process that mapped it is gone, however
each one ended. Where memfd is missing the buffers are files in /dev/shm, unlinked as soon as every
receiver mapped them; files of dead senders are swept at the next offer. No name carries the token.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import tempfile

import torch

from refit.errors import PeerError
from refit.settings import Settings
from refit.transports.base import DONE, Pending, Transport


def _shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


_PROC_FD = re.compile(r"/proc/\d+/fd/\d+")
_FILE = re.compile(r"refit-(\d+)-[0-9a-f]+-\d+")
_MEMFD = re.compile(r"/memfd:refit-\d+ \(deleted\)")


class ShmTransport(Transport):
    """Buffers are shared memory: 'sending' is writing them; the bucket header says when they are ready."""

    name = "shm"
    device_type = "cpu"

    def __init__(self, buffers: list[torch.Tensor], paths: list[str], fds: list[int]) -> None:
        self.buffers = buffers
        self._paths = paths
        self._fds = fds
        self._pinned = [b for b in buffers if _pin(b)]

    @classmethod
    def offer(
        cls, *, capacity: int, num_slots: int, num_receivers: int, device: torch.device, settings: Settings
    ) -> tuple[Transport, dict]:
        paths, buffers, fds, files = [], [], [], []
        memfd = hasattr(os, "memfd_create")
        if not memfd:
            _sweep()
        tag = secrets.token_hex(4)
        for slot in range(num_slots):
            if memfd:
                fd = os.memfd_create(f"refit-{slot}", os.MFD_CLOEXEC)
                os.ftruncate(fd, capacity)
                fds.append(fd)
                paths.append(f"/proc/{os.getpid()}/fd/{fd}")
            else:
                files.append(_create_file(os.path.join(_shm_dir(), f"refit-{os.getpid()}-{tag}-{slot}"), capacity))
                paths.append(files[-1])
            # Touch every page now, so no refit pays the first-use page faults.
            buffers.append(torch.from_file(paths[-1], shared=True, size=capacity, dtype=torch.uint8).zero_())
        return cls(buffers, files, fds), {"paths": paths, "capacity": capacity}

    @classmethod
    def join(cls, info: dict, *, rank: int, device: torch.device, settings: Settings) -> Transport:
        paths, capacity = info.get("paths"), info.get("capacity")
        if not isinstance(paths, list) or not isinstance(capacity, int):
            raise PeerError(f"shm setup info is malformed: {info!r:.200}")
        buffers = []
        for path in paths:
            if not isinstance(path, str) or not _ours(path):
                raise PeerError(
                    f"shm setup names {str(path)[:200]!r}, which is not a buffer this transport creates "
                    f"(a refit memfd or {_shm_dir()}/refit-...); refusing to map it"
                )
            try:
                size = os.stat(path).st_size
            except OSError as e:
                raise PeerError(
                    f"cannot open shared buffer {path}: {e}; are both sides on one host, in one PID namespace, "
                    "as one user?"
                ) from None
            if size != capacity:
                raise PeerError(f"shared buffer {path} has {size} bytes, expected {capacity}")
            buffers.append(torch.from_file(path, shared=True, size=capacity, dtype=torch.uint8))
        return cls(buffers, [], [])

    def joined(self) -> None:
        self._unlink()  # every receiver mapped the buffers: the mappings keep them alive from here

    def send(self, slot: int, nbytes: int) -> Pending:
        return DONE

    def recv(self, slot: int, nbytes: int) -> Pending:
        return DONE

    def _unlink(self) -> None:
        for path in self._paths:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        for fd in self._fds:
            os.close(fd)
        self._paths, self._fds = [], []

    def close(self) -> None:
        self._unlink()
        for b in self._pinned:
            torch.cuda.cudart().cudaHostUnregister(b.data_ptr())
        self._pinned = []
        self.buffers = []


def _ours(path: str) -> bool:
    """Whether `path` is a segment `offer` makes: a memfd named refit-<slot> in some process's fd table,
    or a regular file straight in the shm directory (no '..', no link) named as offer names them."""
    if _PROC_FD.fullmatch(path):
        try:
            return _MEMFD.fullmatch(os.readlink(path)) is not None
        except OSError:
            return False
    root, name = os.path.split(path)
    return (
        root == _shm_dir()
        and _FILE.fullmatch(name) is not None
        and os.path.realpath(path) == os.path.join(os.path.realpath(root), name)
        and not os.path.islink(path)
    )


def _create_file(path: str, capacity: int) -> str:
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, capacity)
    finally:
        os.close(fd)
    return path


def _sweep() -> None:
    """Remove buffer files left by senders that died before every receiver mapped them."""
    root = _shm_dir()
    for name in os.listdir(root):
        m = _FILE.fullmatch(name)
        if m and not os.path.exists(f"/proc/{m.group(1)}"):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(root, name))


def _pin(buf: torch.Tensor) -> bool:
    """Page-lock a shared buffer where a GPU is present, so copies to and from the device run at full speed."""
    if not torch.cuda.is_available() or buf.numel() == 0:
        return False
    try:
        return int(torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), buf.numel(), 0)) == 0
    except Exception:  # noqa: BLE001 - pinning is an optimisation; unpinned memory still works
        return False
