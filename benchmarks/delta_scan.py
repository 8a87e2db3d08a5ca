"""The delta scan alone: `WireImage.encode` of one bucket against its image, beside a copy of the same bytes.

    PYTHONPATH=src python benchmarks/delta_scan.py --mib 16 --reps 21

Per changed fraction of bf16 values (scattered at random): the median seconds of `encode` (the sample, the
compare, the payload's build, the image's update), of `buf.clone()` (a fresh tensor: the copy floor the issue
names, page faults included) and of `copy_` into a tensor kept between runs.
"""

from __future__ import annotations

import argparse
import time
from types import SimpleNamespace

import torch

from refit.stages.delta import WireImage


def _median(times: list[float]) -> float:
    return sorted(times)[len(times) // 2]


def run(nbytes: int, fraction: float, reps: int) -> dict[str, float]:
    m = SimpleNamespace(bucket_nbytes=(nbytes,))
    image = WireImage(m, torch.device("cpu"))  # type: ignore[arg-type]
    base = torch.randn(nbytes // 2, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16).view(torch.uint8)
    units = base.clone().view(torch.int16)
    units[torch.randperm(units.numel())[: int(fraction * units.numel())]] ^= 1
    new = units.view(torch.uint8)
    buf, kept = torch.empty(nbytes + 4096, dtype=torch.uint8), torch.empty_like(new)
    scan, clone, copy = [], [], []
    for _ in range(reps):
        buf[:nbytes].copy_(new)
        image.images[0].copy_(base)
        image.kept[0] = True
        t = time.perf_counter()
        size, _ = image.encode(0, buf, threshold=0.25)
        scan.append(time.perf_counter() - t)
        t = time.perf_counter()
        fresh = new.clone()
        clone.append(time.perf_counter() - t)
        del fresh
        t = time.perf_counter()
        kept.copy_(new)
        copy.append(time.perf_counter() - t)
    s, c, k = _median(scan), _median(clone), _median(copy)
    return {
        "fraction": fraction,
        "scan_ms": s * 1e3,
        "clone_ms": c * 1e3,
        "copy_ms": k * 1e3,
        "scan_over_clone": s / c,
        "scan_over_copy": k and s / k,
        "payload": -1 if size is None else size,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=16)
    p.add_argument("--reps", type=int, default=21)
    args = p.parse_args()
    for fraction in (0.0, 0.04, 1.0):
        r = run(args.mib << 20, fraction, args.reps)
        print(" ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()))


if __name__ == "__main__":
    main()
