"""Where a GPU refit's time goes, per stage and per side: a preset's tensors on one GPU, a Sender here and a
Receiver (ModuleEngine) in a child process over cuda-ipc, both under torch.profiler. For each mode
(packed or zero-copy, verify=None or the fingerprint) it prints the median refit time, each side's stage
seconds (RefitStats), and writes both sides' profiler tables (host time against kernel time) to OUT.

Run: python benchmarks/profile_gpu.py OUT [--preset moe] [--layers N] [--repeats 7] [--cprofile]

--cprofile profiles the Python of each side with cProfile instead (host time per function, cumulative), for the
host work torch.profiler does not break down (no torch op runs there).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import os
import pstats
import statistics
import subprocess
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from refit import ModuleEngine, ModuleSource, Receiver, Sender, Settings
from refit.tools.bench.presets import PRESETS, specs

MODES = {
    "packed": (False, None),
    "packed_fp": (False, "fingerprint"),
    "zc": (True, None),
    "zc_fp": (True, "fingerprint"),
}
SETTINGS = Settings(bucket_bytes=1 << 30, timeout_s=600.0)


def _tensors(preset: str, layers: int | None, seed: int) -> dict[str, torch.Tensor]:
    shape = PRESETS[preset] if layers is None else PRESETS[preset].truncated(layers)
    g = torch.Generator(device="cuda").manual_seed(seed)
    out = {}
    for s in specs(shape, torch.bfloat16):
        t = torch.empty(s.shape, dtype=torch.float32, device="cuda")
        out[s.name] = t.uniform_(-1, 1, generator=g).to(s.dtype)
    return out


def _profiler() -> profile:
    return profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True)


class _PythonProfile(contextlib.AbstractContextManager):
    """cProfile as the profiler: `table()` lists the 30 costliest functions, cumulative, then 20 by own time."""

    def __init__(self) -> None:
        self._prof = cProfile.Profile()

    def __enter__(self) -> _PythonProfile:
        self._prof.enable()
        return self

    def __exit__(self, *exc: object) -> None:
        self._prof.disable()

    def table(self) -> str:
        text = io.StringIO()
        stats = pstats.Stats(self._prof, stream=text)
        stats.sort_stats("cumulative").print_stats(30)
        stats.sort_stats("tottime").print_stats(20)
        return text.getvalue()


def _profiling(args: argparse.Namespace) -> profile | _PythonProfile:
    return _PythonProfile() if args.cprofile else _profiler()


def _table(prof: profile | _PythonProfile) -> str:
    if isinstance(prof, _PythonProfile):
        return prof.table()
    avg = prof.key_averages()
    by_stack = prof.key_averages(group_by_stack_n=6)
    return "\n".join(
        [
            avg.table(sort_by="self_cpu_time_total", row_limit=25),
            avg.table(sort_by="self_cuda_time_total", row_limit=15),
            by_stack.table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=200),
        ]
    )


def _receiver(rendezvous: dict, args: argparse.Namespace, mode: str) -> None:
    engine = ModuleEngine(_tensors(args.preset, args.layers, seed=2))
    seconds: list[dict] = []
    with Receiver(engine, rendezvous, settings=SETTINGS) as receiver:
        for _ in range(args.warmup):
            receiver.receive()
        with _profiling(args) as prof:
            for _ in range(args.repeats):
                stats = receiver.receive()
                assert stats is not None
                seconds.append(stats.seconds)
        receiver.receive()  # the session's end
    with open(os.path.join(args.out, f"receiver_{mode}.txt"), "w") as f:
        f.write(json.dumps(_medians(seconds)) + "\n" + _table(prof))


def _medians(seconds: list[dict]) -> dict[str, float]:
    keys = {k for s in seconds for k in s}
    return {k: round(statistics.median(s.get(k, 0.0) for s in seconds) * 1e3, 3) for k in sorted(keys)}


def _sender(args: argparse.Namespace, mode: str) -> dict:
    zero_copy, verify = MODES[mode]
    tensors = _tensors(args.preset, args.layers, seed=1)
    sender = Sender(ModuleSource(tensors), transport="cuda-ipc", settings=SETTINGS, zero_copy=zero_copy, verify=verify)
    cmd = [sys.executable, __file__, args.out, "--preset", args.preset, "--repeats", str(args.repeats)]
    cmd += ["--warmup", str(args.warmup), "--mode", mode, "--receiver", json.dumps(sender.rendezvous())]
    if args.layers is not None:
        cmd += ["--layers", str(args.layers)]
    if args.cprofile:
        cmd += ["--cprofile"]
    child = subprocess.Popen(cmd)
    sender.connect()
    version = 0
    for _ in range(args.warmup):
        version += 1
        sender.refit(version)
    seconds = []
    with _profiling(args) as prof:
        for _ in range(args.repeats):
            version += 1
            with torch.no_grad():
                next(iter(tensors.values())).add_(1)
            seconds.append(sender.refit(version).seconds)
    sender.close()
    assert child.wait() == 0, "the receiver failed"
    with open(os.path.join(args.out, f"sender_{mode}.txt"), "w") as f:
        f.write(json.dumps(_medians(seconds)) + "\n" + _table(prof))
    return {"mode": mode, "tensors": len(tensors), "sender_ms": _medians(seconds)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--preset", default="moe")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--mode", default=",".join(MODES))
    p.add_argument("--receiver", default=None)
    p.add_argument("--cprofile", action="store_true")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)  # both sides write their tables there
    if args.receiver is not None:
        _receiver(json.loads(args.receiver), args, args.mode)
        return
    for mode in args.mode.split(","):
        print(json.dumps(_sender(args, mode)), flush=True)


if __name__ == "__main__":
    main()
