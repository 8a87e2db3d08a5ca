#!/bin/bash
# One device call (issue 63): the CUDA tests, then issue 63's table over cuda-ipc (--repeats 7, each row beside
# the flat-copy floor of the same run): FP8 engine vs float engine (deepseek-v3, 2 layers), the quantizer alone
# (4 layers), packed qwen2-7b / moe / deepseek-v3 4 layers (verified and not), delta's worst case (qwen2-0.5b),
# LoRA rank 16 on qwen2-7b, the canary at every=1 and every=10; then torch.profiler tables of packed, LoRA, FP8
# and delta's worst case (benchmarks/prof/sitecustomize.py). TAG names the run. One log and one tarball in $OUT.
set -u
TAG=${TAG:-base}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 PYTHONPATH=$PWD/src:$PWD/tests/helpers
R=/tmp/$TAG; mkdir -p $R/prof
exec > >(tee "$OUT/log-$TAG.txt") 2>&1
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm,driver_version --format=csv,noheader
python3 -c 'import torch, triton; print(torch.__version__, triton.__version__)'
t0=$SECONDS; say() { echo "[$((SECONDS - t0))s] $*"; tar czf "$OUT/res-$TAG.tgz" -C /tmp $TAG 2>/dev/null; }
show() {
  python3 - "$1" <<'PY'
import json, sys
try:
    runs = json.load(open(sys.argv[1]))
except Exception as e:  # noqa: BLE001
    print("  no json:", e); sys.exit()
for r in runs if isinstance(runs, list) else [runs]:
    print(" ", r.get("config", {}).get("preset"), r["tensors"], "tensors", round(r["nbytes"] / 1e9, 3), "GB")
    for k, v in r["results"].items():
        st = " ".join(f"{a}={b*1e3:.2f}" for a, b in v["stages"].items())
        print(f"  {k:18s} {v['median_s']*1e3:8.2f} ms {v.get('ratio_to_floor') or 0:5.2f}x {st}"[:330])
PY
}
B="python3 -m refit bench --transport cuda-ipc --repeats 7"
bench() {  # name, timeout, args...; PYTHONPATH as set for the call
  local name=$1 t=$2; shift 2
  say "$name"; timeout $t $B "$@" --json $R/$name.json >$R/$name.txt 2>&1; say "rc $?"; show $R/$name.json
}
say "CUDA tests"
timeout ${TEST_S:-110} python3 -m pytest -q -p no:cacheprovider -x tests/unit/test_fp8_kernel.py tests/unit/test_fp8.py \
    tests/protocol/test_fp8_refits.py tests/integration/test_gpu.py tests/unit/test_copy_kernel.py \
    tests/unit/test_delta_kernel.py tests/unit/test_digest.py 2>&1 | tail -8
bench fp8-ds2 70 --preset deepseek-v3 --layers 2 --engine-dtype fp8 --methods floor,refit,fingerprint
if [ -d old/src ]; then  # the code before this round, beside it on the same card (carried; not in git)
  PYTHONPATH=$PWD/old/src:$PWD/tests/helpers bench fp8-ds2-old 70 --preset deepseek-v3 --layers 2 --engine-dtype fp8 \
      --methods floor,refit,fingerprint
fi
bench float-ds2 70 --preset deepseek-v3 --layers 2 --engine-dtype float --methods floor,refit,fingerprint
bench quant-ds4 70 --preset deepseek-v3 --layers 4 --engine-dtype fp8 --methods floor,quantize
if [ -z "${SHORT:-}" ]; then  # SHORT=1: the FP8 rows, LoRA, the canary and the FP8 trace alone
for p in qwen2-7b moe; do bench packed-$p 70 --preset $p --methods floor,refit,fingerprint; done
bench packed-ds4 70 --preset deepseek-v3 --layers 4 --methods floor,refit,fingerprint
bench delta-q05 70 --preset qwen2-0.5b --methods floor,step_full,step_delta,step_delta_worst
fi
say "lora"
timeout 70 python3 benchmarks/lora_refit.py --preset qwen2-7b --rank 16 --device cuda --refits 15 2>$R/lora.err | tee $R/lora.json
say "canary"
timeout 90 python3 benchmarks/canary_gpu.py --refits 20 2>$R/canary.err | tee $R/canary.json
say "traces"
PP=$PWD/src:$PWD/benchmarks/prof
PYTHONPATH=$PP REFIT_PROF=$R/prof/fp8 timeout 45 $B --repeats 5 --preset deepseek-v3 --layers 2 --engine-dtype fp8 \
    --methods refit >/dev/null 2>&1; say "fp8 trace rc $?"
[ -n "${SHORT:-}" ] && { tar czf "$OUT/res-$TAG.tgz" -C /tmp $TAG; say done; exit 0; }
PYTHONPATH=$PP REFIT_PROF=$R/prof/delta timeout 45 $B --repeats 5 --preset qwen2-0.5b --methods step_delta_worst \
    >/dev/null 2>&1; say "delta trace rc $?"
PYTHONPATH=$PP REFIT_PROF=$R/prof/lora timeout 45 python3 benchmarks/lora_refit.py --preset qwen2-7b --rank 16 \
    --device cuda --refits 5 >/dev/null 2>&1; say "lora trace rc $?"
timeout 60 python3 benchmarks/profile_gpu.py $R/prof/packed --preset qwen2-7b --mode packed,packed_fp --repeats 5 \
    2>&1 | cut -c1-400; say "packed trace"
for f in $R/prof/*/*.txt; do echo "== $f"; sed -n 1,22p $f | cut -c1-200; done | head -150
tar czf "$OUT/res-$TAG.tgz" -C /tmp $TAG
say done
