#!/bin/bash
# One device call (issue 34): why NIXL's VRAM READ on one GPU is slow; NIXL alone under UCX settings, then
# refit's nixl rows under the fastest. Needs .nx/nixl13.tar.xz (the nixl-cu13 wheel, unpacked; carried).
set -u
mkdir -p /tmp/site && tar xJf .nx/nixl13.tar.xz -C /tmp/site || exit 1
export PYTHONPATH=src:/tmp/site PYTHONUNBUFFERED=1
CU=$(python3 -c 'import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], "cu13", "lib"))')
export LD_LIBRARY_PATH=$CU:${LD_LIBRARY_PATH:-}
P="timeout 60 python3 benchmarks/nixl_probe.py --device cuda:0 --mib 1024"
$P 2>"$OUT/p-default.err" | tee "$OUT/probe.txt"
REFIT_NIXL_ERROR_MODE=peer $P 2>/dev/null | tee -a "$OUT/probe.txt"
UCX_CUDA_IPC_ENABLE_GET_ZCOPY=on $P 2>/dev/null | tee -a "$OUT/probe.txt"
UCX_TLS=cuda_ipc,cuda_copy,sm,self $P 2>"$OUT/p-tls.err" | tee -a "$OUT/probe.txt"
UCX_TLS=cuda_ipc,cuda_copy,sm,self UCX_CUDA_IPC_ENABLE_GET_ZCOPY=on $P 2>/dev/null | tee -a "$OUT/probe.txt"
UCX_LOG_LEVEL=debug $P --repeats 1 --server-log 400000 >/dev/null 2>"$OUT/p-debug.err"
grep -i "cuda_ipc" "$OUT/p-debug.err" | sed 's/^\[[^]]*\] *//' | sort | uniq -c | sort -rn | head -30 | cut -c1-220
UCX_PROTO_INFO=y $P --repeats 1 >/dev/null 2>"$OUT/p-proto.err"
sed 's/^\[[^]]*\] \[[^]]*\] *//' "$OUT/p-proto.err" | grep -A7 "probe-reading.*\|remote memory read" | grep -A6 "read by" | head -40
best=$(grep -n "GB/s" "$OUT/probe.txt" | sort -t, -k2 -g | tail -1)
echo "best: $best"
env_line=$(echo "$best" | sed 's/.*bitwise [A-Za-z]*; //')
echo "== refit bench over nixl with: $env_line"
env $env_line timeout 200 python3 -m refit bench --preset qwen2-7b,moe --transport nixl --methods refit,fingerprint \
    --repeats 5 --json "$OUT/bench-nixl.json" >"$OUT/bench-nixl.txt" 2>&1
echo "bench rc $?"
grep -E "^refit memory|│ (floor|refit|verified|fingerprint)|tensors," "$OUT/bench-nixl.txt" | cut -c1-200
