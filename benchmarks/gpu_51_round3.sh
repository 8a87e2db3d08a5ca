#!/bin/bash
# The GPU floor, round 3, in two device calls (PART=a, PART=b): the delta scan kernel, nixl READs merged across
# adjacent tensors, and the compiled layout check, each beside the code before them (246eb2f's src, carried as
# .nx/old/src; not in git) on the same card. Needs the nixl-cu13 wheel unpacked as .nx/nixl13.tar.xz (carried).
# One log and one tarball of the JSON come back under $OUT.
set -u
mkdir -p /tmp/site && tar xJf .nx/nixl13.tar.xz -C /tmp/site || exit 1
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
CU=$(python3 -c 'import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], "cu13", "lib"))')
export LD_LIBRARY_PATH=$CU:${LD_LIBRARY_PATH:-}
mkdir -p /tmp/res
LOG=$OUT/log-${PART:-a}.txt
exec > >(tee "$LOG") 2>&1
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
t0=$SECONDS; say() { echo "[$((SECONDS - t0))s] $*"; }
show() { grep -E "│ (floor|refit|fingerprint|zero|delta|step)|tensors,|descriptor" "$1" | cut -c1-230; }
bench() {  # name, src, args...
  local name=$1 src=$2; shift 2
  say "$name"
  PYTHONPATH=$src:/tmp/site timeout 200 python3 -m refit bench "$@" --json /tmp/res/$name.json >/tmp/res/$name.txt 2>&1
  say "rc $?"; show /tmp/res/$name.txt
}
if [ "${PART:-a}" = short ]; then  # the essentials, when device time is short
  say "CUDA tests"
  PYTHONPATH=src:/tmp/site timeout 150 python3 -m pytest -q -x -p no:cacheprovider tests/unit/test_delta_kernel.py \
      tests/unit/test_layout_guard.py tests/protocol/test_delta.py 2>&1 | tail -4
  bench nixl-moe-new src --preset moe --transport cuda-ipc,nixl --repeats 5 --methods floor,refit,zero_copy -v
  bench delta-new src --preset qwen2-0.5b --transport cuda-ipc --repeats 5 --methods step_full,step_delta,step_delta_worst
elif [ "${PART:-a}" = a ]; then
  say "CUDA tests"
  PYTHONPATH=src:/tmp/site timeout 300 python3 -m pytest -q -x -p no:cacheprovider tests/unit/test_delta_kernel.py \
      tests/unit/test_layout_guard.py tests/protocol/test_nixl_zero_copy.py tests/unit/test_nixl_sources.py \
      tests/protocol/test_delta.py 2>&1 | tail -4
  bench nixl-moe-old .nx/old/src --preset moe --transport nixl --repeats 5 --methods floor,zero_copy
  bench nixl-moe-new src --preset moe --transport cuda-ipc,nixl --repeats 5 --methods floor,refit,zero_copy -v
  bench delta-new src --preset qwen2-0.5b --transport cuda-ipc,nixl --repeats 5 \
      --methods step_full,step_delta,step_delta_worst
else
  bench zc-moe-old .nx/old/src --preset moe --transport cuda-ipc --repeats 7 --methods floor,zero_copy,zero_copy_fingerprint
  bench zc-new src --preset qwen2-7b,moe --transport cuda-ipc --repeats 7 \
      --methods floor,refit,fingerprint,zero_copy,zero_copy_fingerprint
  bench zc-ds-new src --preset deepseek-v3 --layers 4 --transport cuda-ipc --repeats 7 \
      --methods floor,refit,fingerprint,zero_copy,zero_copy_fingerprint
  bench nixl-q7-new src --preset qwen2-7b --transport cuda-ipc,nixl --repeats 5 --methods floor,refit,zero_copy -v
  bench delta-q7-new src --preset qwen2-7b --layers 2 --transport cuda-ipc --repeats 5 \
      --methods step_full,step_delta,step_delta_worst
fi
tar czf $OUT/res-${PART:-a}.tgz -C /tmp/res .
say done
