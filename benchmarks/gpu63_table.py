"""Issue 63's table from one run of benchmarks/gpu_63.sh: each row's median and its ratio to the flat-copy floor
of the same bench run (printed as markdown).

    python benchmarks/gpu63_table.py benchmarks/results/gpu63/r1
"""

from __future__ import annotations

import json
import os
import sys


def _runs(path: str) -> list[dict]:
    try:
        with open(path) as f:
            got = json.load(f)
    except (OSError, ValueError):
        return []
    return got if isinstance(got, list) else [got]


def rows(folder: str) -> list[str]:
    out = ["| run | preset | method | median ms | x floor | floor ms | stages (ms) |", "|---|---|---|---|---|---|---|"]
    for name in sorted(os.listdir(folder)):
        if not name.endswith(".json") or name.startswith(("lora", "canary")):
            continue
        for r in _runs(os.path.join(folder, name)):
            floor = r["results"].get("floor", {}).get("median_s")
            for method, v in r["results"].items():
                ratio = v["median_s"] / floor if floor else float("nan")
                st = " ".join(f"{k}={s * 1e3:.2f}" for k, s in v["stages"].items())
                preset = r.get("config", {}).get("preset")
                out.append(
                    f"| {name[:-5]} | {preset} | {method} | {v['median_s'] * 1e3:.2f} | {ratio:.2f} | "
                    f"{(floor or 0) * 1e3:.2f} | {st} |"
                )
    for name in ("lora.json", "canary.json"):
        path = os.path.join(folder, name)
        if os.path.exists(path):
            with open(path) as f:
                out.append(f"\n{name}: {f.read().strip()}")
    return out


if __name__ == "__main__":
    print("\n".join(rows(sys.argv[1])))
