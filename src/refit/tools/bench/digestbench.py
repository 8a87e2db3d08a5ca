"""The fingerprint's kernels alone, on one CUDA device: the digest of a preset's tensors and the fused copy
and digest, against a flat copy and a flat read of as many bytes, at several kernel tunings.

    python -m refit.tools.bench.digestbench --preset qwen2-7b,moe --tunings 8x1024x16x131072,4x1024x8x131072

A tuning is ROWSxCOLSxWARPSxCHUNK_WORDS (refit.checks.tensor_digest); each runs in a process of its own, since
they are read at import. Times are medians of CUDA-event spans (`device`), of wall-clock spans of the whole
call, host work included (`wall`), and until the call returns (`host`: its Python work and launches), after
two untimed calls (compiling, building the cached tables).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from functools import partial

import torch

from refit.tools.bench.presets import PRESETS, specs


def _time(fn: Callable[[], object], repeats: int) -> dict[str, float]:
    """Median seconds of `fn` over `repeats` calls: CUDA events and wall clock (synchronised)."""
    for _ in range(2):
        fn()
    device, wall, host = [], [], []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t = time.perf_counter()
        start.record()
        fn()
        host.append(time.perf_counter() - t)
        end.record()
        end.synchronize()
        wall.append(time.perf_counter() - t)
        device.append(start.elapsed_time(end) / 1e3)
    return {"device": statistics.median(device), "wall": statistics.median(wall), "host": statistics.median(host)}


def _floors(nbytes: int, repeats: int) -> dict[str, dict[str, float]]:
    """A flat copy and a flat read (a sum of int64 words) of `nbytes` bytes."""
    flat = torch.randint(0, 256, (nbytes - nbytes % 8,), dtype=torch.uint8, device="cuda")
    target = torch.empty_like(flat)
    return {"copy": _time(partial(target.copy_, flat), repeats), "read": _time(flat.view(torch.int64).sum, repeats)}


def _line(rep: dict) -> str:
    def ms(k: str) -> str:
        return f"{rep[k]['device'] * 1e3:.2f} ms (wall {rep[k]['wall'] * 1e3:.2f}, host {rep[k]['host'] * 1e3:.2f})"

    return (
        f"{rep['tuning']} {rep['preset']} ({rep['tensors']} tensors, {rep['nbytes'] / 1e9:.2f} GB): copy "
        f"{ms('copy')}; read {ms('read')} x{rep['read_x_copy']:.2f}; digest {ms('digest')} "
        f"x{rep['digest_x_copy']:.2f}; copy+digest {ms('copy_digest')} x{rep['copy_digest_x_copy']:.2f}; "
        f"kernels alone: digest {ms('digest_kernel')} x{rep['digest_kernel_x_copy']:.2f}, copy+digest "
        f"{ms('copy_digest_kernel')} x{rep['copy_digest_kernel_x_copy']:.2f}; equal={rep['bitwise_equal']}"
    )


def _kernels(dst: list[torch.Tensor], src: list[torch.Tensor], repeats: int) -> tuple[dict, dict]:
    """The two kernels alone, launched from their cached plans: no Python per tensor, no reduction."""
    from refit.checks import copy_digest_cuda as fused_cuda
    from refit.checks import tensor_digest as digest

    return _time(digest.kernel(src), repeats), _time(fused_cuda.kernel(dst, src), repeats)


def measure(preset: str, repeats: int) -> dict:
    """One preset at the tuning this process imported."""
    from refit.checks import tensor_digest as digest
    from refit.checks.copy_digest_cuda import copy_digest_cuda

    spec_list = specs(PRESETS[preset], torch.bfloat16)
    g = torch.Generator(device="cuda").manual_seed(0)
    src = [torch.randn(s.shape, generator=g, device="cuda").to(s.dtype) for s in spec_list]
    nbytes = sum(t.nbytes for t in src)
    out = {"preset": preset, "tensors": len(src), "nbytes": nbytes, **_floors(nbytes, repeats)}
    out["tuning"] = f"{digest.ROWS}x{digest.COLS}x{digest.NUM_WARPS}x{digest.CHUNK_WORDS}"
    out["digest"] = _time(lambda: digest.digests(src), repeats)
    dst = [torch.empty_like(t) for t in src]
    out["copy_digest"] = _time(lambda: copy_digest_cuda(dst, src), repeats)
    expected = digest.digests(src)
    out["bitwise_equal"] = bool(
        torch.equal(copy_digest_cuda(dst, src), expected) and all(torch.equal(d, s) for d, s in zip(dst, src))
    )
    out["digest_kernel"], out["copy_digest_kernel"] = _kernels(dst, src, repeats)
    for k in ("read", "digest", "copy_digest", "digest_kernel", "copy_digest_kernel"):
        out[f"{k}_x_copy"] = out[k]["device"] / out["copy"]["device"]
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="qwen2-7b,moe")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--tunings", default="", help="comma-separated ROWSxCOLSxWARPSxCHUNK_WORDS (default: the module's)")
    p.add_argument("--json")
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a child: one preset, one JSON line
    a = p.parse_args()
    if a.one:
        print(json.dumps(measure(a.preset, a.repeats)), flush=True)
        return 0
    reports = []
    for tuning in a.tunings.split(",") if a.tunings else [""]:
        env = dict(os.environ)
        if tuning:
            rows, cols, warps, chunk = tuning.split("x")
            env |= {"REFIT_DIGEST_ROWS": rows, "REFIT_DIGEST_COLS": cols, "REFIT_DIGEST_WARPS": warps,
                    "REFIT_DIGEST_CHUNK_WORDS": chunk}  # fmt: skip
        for preset in a.preset.split(","):
            cmd = [sys.executable, "-m", "refit.tools.bench.digestbench", "--one", "--preset", preset]
            r = subprocess.run([*cmd, "--repeats", str(a.repeats)], env=env, capture_output=True, text=True)
            if r.returncode:
                print(f"{tuning or 'default'} {preset}: failed\n{r.stderr[-3000:]}", flush=True)
                continue
            rep = json.loads(r.stdout.strip().splitlines()[-1])
            reports.append(rep)
            print(_line(rep), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(reports, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
