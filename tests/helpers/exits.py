"""How a trainer rank process leaves: together with its group, then without interpreter finalization."""

from __future__ import annotations

import os
import sys

import torch.distributed as dist


def leave(code: int) -> None:
    """Barrier (rank 0 hosts the group's store: no rank may find it gone mid-teardown), destroy the group,
    flush, and exit with `code`. Finalization is skipped: gloo's C++ worker threads can still hold tensors
    with Python references then, and destroying them without the interpreter aborts the process (SIGABRT)."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
