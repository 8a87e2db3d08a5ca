"""The colocated copy alone, on one device: one flat copy of the model's bytes (the hardware floor),
`_foreach_copy_` of the tensors, and the batched copy kernel at several tunings, timed in one run.

    python -m refit.tools.bench.copybench --preset qwen2-7b,moe --json out.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
from functools import partial

import torch

from refit.layout.copy_kernel import BatchedCopy
from refit.tools.bench.presets import PRESETS, specs


def _time(fn, repeats: int) -> float:  # type: ignore[no-untyped-def]
    """Median seconds of `fn` over `repeats` runs, timed with CUDA events after two warm-ups."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def run(preset: str, layers: int | None, repeats: int, tunings: list[tuple[int, int, int, int]]) -> dict:
    shape = PRESETS[preset] if layers is None else PRESETS[preset].truncated(layers)
    spec_list = specs(shape, torch.bfloat16)
    g = torch.Generator(device="cuda").manual_seed(0)
    src = [torch.randn(s.shape, generator=g, device="cuda").to(s.dtype) for s in spec_list]
    dst = [torch.empty_like(t) for t in src]
    nbytes = sum(t.nbytes for t in src)
    flat_src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda")
    flat_dst = torch.empty_like(flat_src)
    out = {"preset": preset, "layers": layers, "tensors": len(src), "nbytes": nbytes}
    out["flat"] = _time(partial(flat_dst.copy_, flat_src), repeats)
    del flat_src, flat_dst
    out["foreach"] = _time(partial(torch._foreach_copy_, dst, src), repeats)
    out["kernel"] = {}
    for chunk, block, warps, programs in tunings:
        plan = BatchedCopy(dst, src, chunk_bytes=chunk, block_bytes=block, num_warps=warps, programs=programs)
        for d in dst:
            d.fill_(0)
        t = _time(plan.run, repeats)
        ok = all(torch.equal(d.view(torch.uint8), s.view(torch.uint8)) for d, s in zip(dst, src))
        out["kernel"][f"{chunk >> 10}K/{block >> 10}K/{warps}w/{programs or 'all'}"] = {"s": t, "bitwise_equal": ok}
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="qwen2-7b,moe")
    p.add_argument("--layers", type=int)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--chunks", default="262144,1048576")
    p.add_argument("--blocks", default="32768,65536")
    p.add_argument("--warps", default="16,32")
    p.add_argument("--programs", default="0", help="at most this many programs (0: one per chunk)")
    p.add_argument("--json")
    a = p.parse_args()
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    grid = itertools.product(ints(a.chunks), ints(a.blocks), ints(a.warps), ints(a.programs))
    tunings = [t for t in grid if t[0] % t[1] == 0]
    reports = []
    for preset in a.preset.split(","):
        r = run(preset, a.layers, a.repeats, tunings)
        reports.append(r)
        flat = r["flat"]
        print(
            f"{preset}: {r['tensors']} tensors, {r['nbytes'] / 1e9:.2f} GB; flat copy {flat * 1e3:.2f} ms "
            f"({2 * r['nbytes'] / flat / 1e12:.2f} TB/s read+write); _foreach_copy_ {r['foreach'] * 1e3:.2f} ms "
            f"({r['foreach'] / flat:.3f}x)"
        )
        for k, v in sorted(r["kernel"].items(), key=lambda kv: kv[1]["s"]):
            print(f"  kernel {k:>18}: {v['s'] * 1e3:.2f} ms  {v['s'] / flat:.3f}x flat  equal={v['bitwise_equal']}")
        torch.cuda.empty_cache()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(reports, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
