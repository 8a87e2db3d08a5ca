#!/bin/bash
# One device call (the GPU floor): GPU tests, the floor bench on three presets over cuda-ipc, and
# torch.profiler traces of both processes for each path. Writes logs and traces under $OUT; prints a table.
# TAG names this run's files (before/after).
set -u
TAG=${TAG:-run}
export PYTHONPATH=src:tests/helpers NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv,noheader
echo "== gpu tests"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/integration/test_gpu.py tests/unit/test_copy_kernel.py \
    tests/unit/test_fp8.py 2>&1 | tail -3
M=floor,refit,fingerprint,zero_copy,zero_copy_fingerprint,digest
for p in qwen2-7b moe "deepseek-v3 --layers 4"; do
  n=${p%% *}
  m=$M
  timeout 200 python3 -m refit bench --preset $p --transport cuda-ipc --methods $m --repeats 7 \
      --json "$OUT/$TAG-$n.json" >"$OUT/$TAG-$n.txt" 2>&1
  echo "bench $n rc $?"
  python3 - "$OUT/$TAG-$n.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
runs = d["runs"] if "runs" in d else d
for r in (runs if isinstance(runs, list) else [runs]):
    print(r["config"].get("preset"), r["tensors"], "tensors")
    for k, v in r["results"].items():
        st = " ".join(f"{a}={b*1e3:.2f}" for a, b in v["stages"].items())
        print(f"  {k:22s} {v['median_s']*1e3:8.2f} ms {v['ratio_to_floor']:5.2f}x  {st}"[:400])
PY
done
mkdir -p /tmp/prof
timeout 150 python3 benchmarks/profile_gpu.py /tmp/prof --preset moe --mode packed,zc --repeats 7 | cut -c1-600
timeout 90 python3 benchmarks/profile_gpu.py /tmp/prof/q --preset qwen2-7b --mode packed --repeats 7 2>/dev/null || \
  (mkdir -p /tmp/prof/q && timeout 90 python3 benchmarks/profile_gpu.py /tmp/prof/q --preset qwen2-7b --mode packed --repeats 7) | cut -c1-600
tar czf "$OUT/$TAG-prof.tgz" -C /tmp prof
