"""The per-refit layout proof of zero-copy, alone: on the `moe` preset's 4779 tensor shapes (zero-filled, one
element each where `--small`), the medians of reading every data pointer, TensorGuards' check,
`LayoutGuard.holds` and `ModuleSource.signature()` (what the sender's "handshake" stage runs when nothing moved).

    PYTHONPATH=src python3 benchmarks/layout_proof.py [--device cuda] [--preset moe]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from refit.layout.packing import LayoutGuard
from refit.sources.module import ModuleSource
from refit.tools.bench.presets import PRESETS, specs


def _median_ms(fn: Callable[[], object], n: int = 200) -> float:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--preset", default="moe-small")
    a = ap.parse_args()
    sp = specs(PRESETS[a.preset], torch.bfloat16)
    tensors = {s.name: torch.zeros(s.shape, dtype=s.dtype, device=a.device) for s in sp}
    values = list(tensors.values())
    guard = LayoutGuard(values)
    source = ModuleSource(tensors)
    source.signature()
    rows = {
        "data pointers": lambda: tuple(map(torch.Tensor.data_ptr, values)),
        "TensorGuards check": (lambda: guard._check(*values)) if guard._check is not None else (lambda: None),
        "LayoutGuard.holds": lambda: guard.holds(values),
        "ModuleSource.signature": source.signature,
    }
    print(f"{a.preset} on {a.device}: {len(values)} tensors")
    for name, fn in rows.items():
        ms = _median_ms(fn)
        print(f"  {name:24s} {ms:7.3f} ms  {ms * 1e3 / len(values):6.3f} us a tensor")


if __name__ == "__main__":
    main()
