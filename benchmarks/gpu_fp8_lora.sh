#!/bin/bash
# One device call: the FP8 kernel's GPU tests, the FP8 engine bench on deepseek-v3 (4 layers) beside the
# bf16-to-bf16 refit of the same model, LoRA-only refits with the engine's adapters in float32 and in bf16,
# and (with PROFILE=1) torch.profiler traces of the packed and zero-copy paths. Logs and JSON under $OUT (one tarball).
set -u
export PYTHONPATH=src:tests/helpers NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
R=/tmp/r; mkdir -p $R/prof
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv,noheader
t0=$SECONDS; say() { echo "[$((SECONDS - t0))s] $*"; }
say "gpu tests"
timeout 170 python3 -m pytest -q -p no:cacheprovider tests/unit/test_fp8_kernel.py tests/unit/test_fp8.py \
    tests/protocol/test_fp8_refits.py 2>&1 | tail -4
B="python3 -m refit bench --preset deepseek-v3 --layers 4 --transport cuda-ipc --repeats 7"
say "fp8 engine"
timeout 150 $B --engine-dtype fp8 --methods quantize,floor,refit,fingerprint --json $R/ds-fp8.json >$R/ds-fp8.txt 2>&1
say "rc $?"
say "float engine"
timeout 120 $B --engine-dtype float --methods refit,fingerprint --json $R/ds-float.json >$R/ds-float.txt 2>&1
say "rc $?"
say "deepseek-v3 as its checkpoint holds it (FP8 on both sides): zero-copy"
timeout 90 $B --methods floor,zero_copy,zero_copy_fingerprint --json $R/ds-zc.json >$R/ds-zc.txt 2>&1
say "rc $?"; tail -4 $R/ds-zc.txt | cut -c1-300
python3 - $R/ds-fp8.json $R/ds-float.json $R/ds-zc.json <<'PY'
import json, sys
for path in sys.argv[1:]:
    try:
        (r,) = json.load(open(path))
    except Exception as e:  # noqa: BLE001
        print(path, "missing", e); continue
    print(path, r["tensors"], "tensors", round(r["nbytes"] / 1e9, 2), "GB on the wire", r.get("engine_dtypes"))
    for k, v in r["results"].items():
        extra = " ".join(f"{a}={b:.3f}" for a, b in v.items() if a.startswith("ratio_to_") and b)
        st = " ".join(f"{a}={b*1e3:.2f}" for a, b in v["stages"].items())
        print(f"  {k:12s} {v['median_s']*1e3:8.2f} ms {v['gbps']:7.1f} GB/s {extra} {st}"[:300])
PY
for a in float32 bfloat16; do
  say "lora $a"
  timeout 100 python3 benchmarks/lora_refit.py --preset qwen2-7b --rank 16 --device cuda --refits 15 \
      --engine-adapters $a 2>/dev/null | grep '^{' | tee $R/lora-$a.json
done
say "qwen2-7b, whole model, beside the adapter"
timeout 90 python3 -m refit bench --preset qwen2-7b --transport cuda-ipc --methods floor,refit,fingerprint --repeats 5 \
    --json $R/qwen-full.json 2>&1 | grep -E "floor:|refit " | cut -c1-200
[ -n "${PROFILE:-}" ] && timeout 100 python3 benchmarks/profile_gpu.py $R/prof --preset moe --mode packed,zc --repeats 7 \
    2>&1 | cut -c1-400
say "done"
tar czf "$OUT/gpu.tgz" -C /tmp r
