"""Per-tensor overhead: refit of N small tensors over shm, unverified (verify=None) and verified
(verify="fingerprint"), against a one-process `_foreach_copy_` of the same tensors, and the first refit's
handshake. Sender here, receiver (ModuleEngine) in a child process; medians of 7 refits after the first.

Run: python benchmarks/many_tensors.py [N ...]     (default 1000 10000 100000)
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time

import torch

from refit import ModuleEngine, ModuleSource, Receiver, Sender, Settings

NUMEL = 64
REPEATS = 7


def _tensors(n: int) -> dict[str, torch.Tensor]:
    return {f"layers.{i:06d}.w": torch.full((NUMEL,), float(i)) for i in range(n)}


def _receiver(rendezvous: dict, n: int) -> None:
    torch.set_num_threads(1)
    engine = ModuleEngine(_tensors(n))
    with Receiver(engine, rendezvous, settings=Settings(bucket_bytes=64 << 20)) as receiver:
        receiver.serve()


def _foreach_floor(n: int) -> float:
    src, dst = list(_tensors(n).values()), list(_tensors(n).values())
    times = []
    for _ in range(REPEATS):
        t = time.perf_counter()
        torch._foreach_copy_(dst, src)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def measure(n: int, verify: str | None) -> dict:
    torch.set_num_threads(1)
    tensors = _tensors(n)
    settings = Settings(bucket_bytes=64 << 20)
    sender = Sender(ModuleSource(tensors), transport="shm", settings=settings, verify=verify)
    child = subprocess.Popen([sys.executable, __file__, "--receiver", json.dumps(sender.rendezvous()), str(n)])
    sender.connect()
    first = sender.refit(0)
    times = []
    for v in range(1, REPEATS + 1):
        tensors["layers.000000.w"].add_(1)
        times.append(sender.refit(v).seconds["total"])
    sender.close()
    child.wait()
    floor = _foreach_floor(n)
    refit = statistics.median(times)
    return {
        "tensors": n,
        "refit_ms": refit * 1e3,
        "foreach_ms": floor * 1e3,
        "ratio": refit / floor,
        "first_refit_s": first.seconds["total"],
        "handshake_s": first.seconds.get("handshake", 0.0),
    }


def main() -> None:
    if sys.argv[1:2] == ["--receiver"]:
        _receiver(json.loads(sys.argv[2]), int(sys.argv[3]))
        return
    counts = [int(a) for a in sys.argv[1:]] or [1000, 10000, 100000]
    print(
        "| tensors | one-process _foreach_copy_ ms | unverified refit ms | ratio | verified refit ms | ratio "
        "| verified / unverified | first refit s (unverified) | of which handshake s |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n in counts:
        r, v = measure(n, None), measure(n, "fingerprint")
        print(
            f"| {n} | {r['foreach_ms']:.1f} | {r['refit_ms']:.1f} | {r['ratio']:.1f}x | {v['refit_ms']:.1f} "
            f"| {v['refit_ms'] / r['foreach_ms']:.1f}x | {v['refit_ms'] / r['refit_ms']:.2f}x "
            f"| {r['first_refit_s']:.2f} | {r['handshake_s']:.2f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
