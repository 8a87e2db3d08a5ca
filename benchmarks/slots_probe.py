"""Per-rank colocated refit (2 GPUs) with several (bucket slots, bucket MiB) settings, each in one run
against its own floor.

    python benchmarks/slots_probe.py --presets qwen2-7b,moe --configs 2:1024,1:2048,2:2048
"""

from __future__ import annotations

import argparse
import json

from refit.tools.bench.colocated import ColocatedConfig, run_colocated


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", default="qwen2-7b,moe")
    ap.add_argument("--configs", default="2:1024,1:1024,1:2048,2:512", help="comma-separated slots:bucket_MiB")
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    for preset in args.presets.split(","):
        for item in args.configs.split(","):
            slots, mib = (int(v) for v in item.split(":"))
            cfg = ColocatedConfig(preset=preset, methods=("floor", "per_rank"), num_slots=slots,
                                  bucket_bytes=mib << 20, repeats=args.repeats)  # fmt: skip
            r = run_colocated(cfg)["results"]
            pr = r["per_rank"]
            print(json.dumps({"preset": preset, "slots": slots, "bucket_mib": mib,
                              "floor_ms": round(r["floor"]["median_s"] * 1e3, 2),
                              "per_rank_ms": round(pr["median_s"] * 1e3, 2), "x_floor": round(pr["ratio_to_floor"], 3),
                              "stages_ms": {k: round(v * 1e3, 2) for k, v in pr["stages_s"].items()}}), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
