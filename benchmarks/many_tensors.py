"""Per-tensor overhead: refit of N small tensors over shm, unverified (verify=None) and verified
(verify="fingerprint"), against a one-process `_foreach_copy_` of the same tensors, and the first refit's
handshake. Sender here, receiver (ModuleEngine) in a child process; medians of 7 refits after the first.

Run: python benchmarks/many_tensors.py [--defaults] [N ...]     (default 1000 10000 100000)

--defaults runs both sides as a user would: the library's own thread count and bucket size (without it, both
processes are pinned to one thread and 64 MiB buckets). With MANY_TENSORS_PROFILE=DIR each side's refits run
under cProfile and the 25 costliest functions (cumulative) of each go to DIR/{sender,receiver}-{mode}.txt.
"""

from __future__ import annotations

import contextlib
import cProfile
import io
import json
import os
import pstats
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


@contextlib.contextmanager
def _profiled(name: str):  # type: ignore[no-untyped-def]
    out = os.environ.get("MANY_TENSORS_PROFILE")
    if not out:
        yield
        return
    prof = cProfile.Profile()
    prof.enable()
    try:
        yield
    finally:
        prof.disable()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(25)
        with open(os.path.join(out, f"{name}.txt"), "w") as f:
            f.write(text.getvalue())


def _settings(defaults: bool) -> Settings:
    if defaults:
        return Settings()
    torch.set_num_threads(1)
    return Settings(bucket_bytes=64 << 20)


def _receiver(rendezvous: dict, n: int, defaults: bool) -> None:
    settings = _settings(defaults)
    engine = ModuleEngine(_tensors(n))
    with Receiver(engine, rendezvous, settings=settings) as receiver, _profiled(f"receiver-{os.getpid()}"):
        receiver.serve()


def _foreach_floor(n: int) -> float:
    src, dst = list(_tensors(n).values()), list(_tensors(n).values())
    times = []
    for _ in range(REPEATS):
        t = time.perf_counter()
        torch._foreach_copy_(dst, src)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def measure(n: int, verify: str | None, defaults: bool) -> dict:
    settings = _settings(defaults)
    tensors = _tensors(n)
    sender = Sender(ModuleSource(tensors), transport="shm", settings=settings, verify=verify)
    cmd = [sys.executable, __file__, "--receiver", json.dumps(sender.rendezvous()), str(n)]
    child = subprocess.Popen(cmd + (["--defaults"] if defaults else []))
    sender.connect()
    first = sender.refit(0)
    times = []
    with _profiled(f"sender-{verify}-{'defaults' if defaults else 'pinned'}"):
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
    defaults = "--defaults" in sys.argv
    argv = [a for a in sys.argv[1:] if a != "--defaults"]
    if argv[:1] == ["--receiver"]:
        _receiver(json.loads(argv[1]), int(argv[2]), defaults)
        return
    counts = [int(a) for a in argv] or [1000, 10000, 100000]
    print(
        "| tensors | one-process _foreach_copy_ ms | unverified refit ms | ratio | verified refit ms | ratio "
        "| verified / unverified | first refit s (unverified) | of which handshake s |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n in counts:
        r, v = measure(n, None, defaults), measure(n, "fingerprint", defaults)
        print(
            f"| {n} | {r['foreach_ms']:.1f} | {r['refit_ms']:.1f} | {r['ratio']:.1f}x | {v['refit_ms']:.1f} "
            f"| {v['refit_ms'] / r['foreach_ms']:.1f}x | {v['refit_ms'] / r['refit_ms']:.2f}x "
            f"| {r['first_refit_s']:.2f} | {r['handshake_s']:.2f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
