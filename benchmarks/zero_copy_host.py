"""The trainer's per-refit host time of a zero-copy refit over nixl on CPU, sender and receiver in one process:
the sender thread's CPU time (`time.thread_time`, so waits for the receiver count nothing) per `Sender.refit`,
median over the timed refits, at the `qwen2-0.5b` (339 tensors) and `moe` (4779) presets,
each tensor one element. Also the proof alone: `ModuleSource.signature()` when nothing moved.

    PYTHONPATH=src python benchmarks/zero_copy_host.py [--presets qwen2-0.5b,moe] [--verify fingerprint] [--repeats 50]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "helpers"))
from threaded import Peer  # noqa: E402

from refit import ModuleEngine, ModuleSource, Sender, Settings  # noqa: E402
from refit.tools.bench.presets import PRESETS, specs  # noqa: E402
from refit.topology.receiver import Receiver  # noqa: E402


def _one(sender: Sender, peer: Peer, version: int) -> float:
    peer.ask("receive")
    t = time.thread_time()
    sender.refit(version)
    spent = time.thread_time() - t
    got = peer.outcome()
    if isinstance(got, BaseException):
        raise got
    return spent


def run(preset: str, verify: str | None, repeats: int) -> tuple[int, float, float]:
    shape = PRESETS[preset]
    trainer = {s.name: torch.zeros(1, dtype=s.dtype) for s in specs(shape, torch.bfloat16)}
    live = {n: torch.zeros_like(t) for n, t in trainer.items()}
    sender = Sender(
        ModuleSource(trainer), transport="nixl", zero_copy=True, settings=Settings(timeout_s=60), verify=verify
    )
    peer = Peer(Receiver(ModuleEngine(live), sender.rendezvous()))
    peer.ask("connect")
    try:
        for v in range(1, 4):
            _one(sender, peer, v)
        refit = statistics.median(_one(sender, peer, v) for v in range(4, 4 + repeats))
        proof = []
        for _ in range(200):
            t = time.perf_counter()
            sender.source.signature()
            proof.append(time.perf_counter() - t)
        return len(trainer), refit * 1e3, statistics.median(proof) * 1e3
    finally:
        sender.close()
        peer.stop()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", default="qwen2-0.5b,moe")
    ap.add_argument("--verify", default="none", choices=["none", "fingerprint"])
    ap.add_argument("--repeats", type=int, default=50)
    a = ap.parse_args()
    verify = None if a.verify == "none" else a.verify
    for preset in a.presets.split(","):
        n, refit, proof = run(preset, verify, a.repeats)
        print(f"{n:5d} tensors, verify={a.verify}: sender host {refit:7.3f} ms a refit, signature() {proof:6.3f} ms")


if __name__ == "__main__":
    main()
