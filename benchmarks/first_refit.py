"""First use: seconds from `Receiver(...)` to the engine's first committed refit, and the buffer bytes.

Each trial starts a fresh trainer process (a Sender over a small state dict, built before the clock
starts), then times, in this engine process, `Receiver(...)` plus `receive()` up to the first commit:
admission, transport setup (the sender's buffers included), handshake and one refit. Prints the
median and range per transport, and each side's buffer bytes against the manifest's bucket bytes.

    PYTHONPATH=src python benchmarks/first_refit.py --transports shm gloo --kib 10 --trials 7
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import torch

from refit import ModuleEngine, ModuleSource, Receiver, Sender


def _tensors(kib: int) -> dict[str, torch.Tensor]:
    """About `kib` KiB of float32 in four tensors of unequal size."""
    n = kib * 256
    sizes = {"embed.weight": n // 2, "layer.0.weight": n // 4, "layer.1.weight": n // 8}
    sizes["norm.weight"] = n - sum(sizes.values())
    return {k: torch.arange(v, dtype=torch.float32) / 7 for k, v in sizes.items()}


def _trainer(transport: str, kib: int) -> int:
    """Child process: offer a Sender, refit once, report the buffer bytes, wait to be closed."""
    sender = Sender(ModuleSource(_tensors(kib)), transport=transport)
    print(json.dumps(sender.rendezvous()), flush=True)
    sender.refit(1)
    assert sender.manifest is not None and sender.transport is not None
    own = sum(b.numel() for b in sender.transport.buffers)
    print(json.dumps({"buffer_bytes": own, "bucket_bytes": sum(sender.manifest.bucket_nbytes)}), flush=True)
    sys.stdin.readline()
    sender.close()
    return 0


def _trial(transport: str, kib: int) -> dict:
    child = subprocess.Popen(
        [sys.executable, __file__, "--trainer", transport, "--kib", str(kib)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None and child.stdin is not None
    rendezvous = json.loads(child.stdout.readline())
    engine = ModuleEngine({k: torch.zeros_like(v) for k, v in _tensors(kib).items()})
    t0 = time.perf_counter()
    receiver = Receiver(engine, rendezvous)
    stats = receiver.receive()
    seconds = time.perf_counter() - t0
    assert stats is not None and receiver.transport is not None
    sizes = json.loads(child.stdout.readline())
    sizes["receiver_buffer_bytes"] = sum(b.numel() for b in receiver.transport.buffers)
    child.stdin.write("\n")
    child.stdin.flush()
    receiver.close()
    child.wait(timeout=60)
    return {"seconds": seconds, **sizes}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--transports", nargs="+", default=["shm", "gloo"])
    p.add_argument("--kib", type=int, default=10, help="model size in KiB (float32)")
    p.add_argument("--trials", type=int, default=7)
    p.add_argument("--trainer", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.trainer:
        return _trainer(args.trainer, args.kib)
    for name in args.transports:
        runs = [_trial(name, args.kib) for _ in range(args.trials)]
        secs = sorted(r["seconds"] for r in runs)
        last = runs[-1]
        print(
            f"{name}: Receiver(...) to first commit of a {args.kib} KiB model: median {statistics.median(secs):.3f} s "
            f"(min {secs[0]:.3f}, max {secs[-1]:.3f}, {args.trials} trials); buffers: sender {last['buffer_bytes']} B, "
            f"receiver {last['receiver_buffer_bytes']} B, manifest bucket bytes {last['bucket_bytes']} B"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
