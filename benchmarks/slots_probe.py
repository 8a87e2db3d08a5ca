"""Per-rank colocated refit with 1 and 2 bucket slots and two bucket sizes, in one run (2 GPUs)."""

from __future__ import annotations

import json
import sys

from refit.bench.colocated import ColocatedConfig, run_colocated

for preset in sys.argv[1:] or ["qwen2-7b", "moe"]:
    for slots, bucket in [(2, 1 << 30), (1, 1 << 30), (1, 2 << 30), (2, 512 << 20)]:
        cfg = ColocatedConfig(preset=preset, methods=("floor", "per_rank"), num_slots=slots, bucket_bytes=bucket, repeats=7)
        r = run_colocated(cfg)["results"]
        pr = r["per_rank"]
        print(json.dumps({"preset": preset, "slots": slots, "bucket_mib": bucket >> 20, "floor_ms": round(r["floor"]["median_s"] * 1e3, 2),
                          "per_rank_ms": round(pr["median_s"] * 1e3, 2), "x_floor": round(pr["ratio_to_floor"], 3),
                          "stages_ms": {k: round(v * 1e3, 2) for k, v in pr["stages_s"].items()}}), flush=True)
