"""Profile a whole process with torch.profiler when REFIT_PROF names a folder: put this folder on PYTHONPATH
(before any other sitecustomize) and every Python process started with it, children too, writes its
key_averages tables (by self CPU time and by self CUDA time) to REFIT_PROF/<pid>-<script>.txt at exit.

    REFIT_PROF=/tmp/prof PYTHONPATH=src:benchmarks/prof python3 -m refit bench ...
"""

import atexit
import os
import sys

_OUT = os.environ.get("REFIT_PROF")


def _start() -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    if not torch.cuda.is_available():
        return
    prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
    prof.__enter__()

    def dump() -> None:
        prof.__exit__(None, None, None)
        name = os.path.basename(sys.argv[0] or "python").replace(".py", "")
        avg = prof.key_averages()
        with open(os.path.join(_OUT, f"{os.getpid()}-{name}.txt"), "w") as f:
            f.write(" ".join(sys.argv)[:300] + "\n")
            f.write(avg.table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=60) + "\n")
            f.write(avg.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60) + "\n")

    atexit.register(dump)


if _OUT:
    os.makedirs(_OUT, exist_ok=True)
    try:
        _start()
    except Exception as e:  # noqa: BLE001 - profiling must never stop the program
        print(f"sitecustomize: no profile: {e}", file=sys.stderr)
