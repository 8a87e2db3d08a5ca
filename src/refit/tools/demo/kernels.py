"""Kernels: refit's compiled CPU helpers (the fused copy-and-digest, the layout check) built before the demo's
first refit, announced in one line where this machine has not built them yet."""

from __future__ import annotations

import time

from rich.console import Console

from refit.checks import copy_digest
from refit.layout import tensor_guard
from refit.log import get_logger
from refit.settings import cpu_kernel_enabled

log = get_logger("demo")

COMPILING = (
    "compiling refit's CPU kernels, once for this machine (15 to 35 s on 2 cores; cached under ~/.cache/refit; "
    "REFIT_CPU_KERNEL=0 skips them)"
)


def cached() -> bool:
    """Whether both helpers are built already (a later process only loads them)."""
    guard = tensor_guard._where() / "built.ok"  # noqa: SLF001 - the build's own marker, read, never written
    return copy_digest._built(copy_digest._cache_dir()) is not None and guard.exists()  # noqa: SLF001


def prebuild(console: Console) -> None:
    """Build (or load) both helpers now, so that the first refit's time and the engine's connect are their own;
    a build is told on `console` first, in one line."""
    if not cpu_kernel_enabled():
        return
    building = not cached()
    if building:
        console.print(COMPILING, highlight=False)
    t0 = time.perf_counter()
    copy_digest.kernel_built()
    tensor_guard.prepare()
    if building:
        log.info("refit's CPU kernels built in %.1f s", time.perf_counter() - t0)
