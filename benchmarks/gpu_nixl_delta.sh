#!/bin/bash
# One device call (the GPU floor): nixl reading in place (zero-copy) between two processes on one GPU beside
# packed cuda-ipc, and delta refits on the GPU after real AdamW steps over cuda-ipc and nixl. Needs the
# nixl-cu13 wheel unpacked as .nx/nixl13.tar.xz (carried; not in git). Logs and JSON under $OUT.
set -u
mkdir -p /tmp/site && tar xJf .nx/nixl13.tar.xz -C /tmp/site || exit 1
export PYTHONPATH=src:/tmp/site PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
CU=$(python3 -c 'import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], "cu13", "lib"))')
export LD_LIBRARY_PATH=$CU:${LD_LIBRARY_PATH:-}
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
t0=$SECONDS; say() { echo "[$((SECONDS - t0))s] $*"; }
show() { grep -E "│ (floor|refit|zero|delta)|tensors," "$1" | cut -c1-230; }
for p in qwen2-7b moe; do
  say "in place: $p"
  timeout 170 python3 -m refit bench --preset $p --transport cuda-ipc,nixl --repeats 5 \
      --methods floor,refit,fingerprint,zero_copy,zero_copy_fingerprint --json "$OUT/inplace-$p.json" >"$OUT/inplace-$p.txt" 2>&1
  say "rc $?"; show "$OUT/inplace-$p.txt"
done
say "delta on the GPU"
timeout 200 python3 -m refit bench --preset qwen2-7b --layers 8 --transport cuda-ipc,nixl --repeats 5 \
    --methods step_full,step_delta --json "$OUT/delta.json" >"$OUT/delta.txt" 2>&1
say "rc $?"; show "$OUT/delta.txt"; tail -3 "$OUT/delta.txt" | cut -c1-300
