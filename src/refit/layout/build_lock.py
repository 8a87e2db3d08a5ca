"""Build lock: one process at a time compiles a C++ helper into its cache folder; the others wait, bounded.

The lock is an flock of our own: the kernel drops it when its holder dies, so a process killed mid-build never
leaves the others waiting (torch's own lock file would stay behind, and every later build would wait on it).
The lock file is opened as `refit.layout.private_dir.open_lock` opens it: never through a symbolic link."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path

from refit.layout.private_dir import open_lock


@contextlib.contextmanager
def build_lock(where: Path, what: str, wait_s: float) -> Iterator[None]:
    """Hold the build lock of `where` (TimeoutError past `wait_s`: the caller takes its slower path). Inside it,
    torch's own lock left by a process killed inside its build is gone."""
    import fcntl

    fd = open_lock(where)
    try:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"another process held {what}'s build lock for {wait_s:.0f} s") from None
                time.sleep(0.05)
        (where / "lock").unlink(missing_ok=True)
        yield
    finally:
        os.close(fd)
