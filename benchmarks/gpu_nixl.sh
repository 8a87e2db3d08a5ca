#!/bin/bash
# One device call (issues 34, 35): nixl in VRAM on one GPU, two processes, beside cuda-ipc; then a delta
# refit over $DELTA (default nixl; the engines share the sender's process there).
# Needs the nixl-cu13 wheel unpacked as .nx/nixl13.tar.xz (carried; not in git). Writes logs under $OUT.
set -u
mkdir -p /tmp/site && tar xJf .nx/nixl13.tar.xz -C /tmp/site || exit 1
export PYTHONPATH=src:/tmp/site PYTHONUNBUFFERED=1
CU=$(python3 -c 'import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], "cu13", "lib"))')
export LD_LIBRARY_PATH=$CU:${LD_LIBRARY_PATH:-}
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv >"$OUT/smi.txt"
ldd /tmp/site/nixl_cu13.libs/ucx/libuct_cuda.so.0.0.0 >"$OUT/ldd.txt" 2>&1
grep -c "not found" "$OUT/ldd.txt"
echo "== tests"
timeout 150 python3 -m pytest -q -x -p no:cacheprovider tests/protocol/test_nixl.py tests/unit/test_nixl_transport.py \
    2>&1 | tee "$OUT/tests.txt" | tail -4
echo "== bench qwen2-7b, moe"
timeout 300 python3 -m refit bench --preset qwen2-7b,moe --transport cuda-ipc,nixl \
    --methods floor,refit,fingerprint --repeats 5 --json "$OUT/bench.json" >"$OUT/bench.txt" 2>&1
echo "bench rc $?"
grep -E "^refit memory|│ (floor|refit|verified|fingerprint)|tensors," "$OUT/bench.txt" | cut -c1-200
echo "== delta over ${DELTA:-nixl}"
timeout 120 python3 benchmarks/delta_refit.py --transport ${DELTA:-nixl} --device cuda:0 --lr 1e-6 --layers 16 \
    --hidden 2048 --steps 5 --worst 2 --out "$OUT/delta-${DELTA:-nixl}.json" 2>"$OUT/delta-${DELTA:-nixl}.err" >/dev/null
python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print({k: v for k, v in d.items() if not isinstance(v, list)})" \
    "$OUT/delta-${DELTA:-nixl}.json" | cut -c1-1500
