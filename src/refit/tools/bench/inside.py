"""The bench's measuring process across a namespaced link, started by `refit bench --link-rate` inside the
trainer's namespace (`ip netns exec`): it measures every method with the receivers in the engine's namespace
and prints the results as one JSON line, after one line per method as it starts."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict

from refit.tools.bench.config import BenchConfig
from refit.tools.bench.link import Link
from refit.tools.bench.runner import INSIDE_MARK, measure


def _emit(obj: dict) -> None:
    print(INSIDE_MARK + json.dumps(obj), flush=True)


def main(argv: list[str]) -> int:
    job = json.loads(argv[1])
    cfg = BenchConfig(**{**job["config"], "methods": tuple(job["config"]["methods"])})
    link = Link(rate=job["rate"], tag=job["tag"], borrowed=True, sites=job.get("sites", 0))
    try:
        results = measure(cfg, link, lambda m: _emit({"method": m}))
    except ValueError as e:
        _emit({"error": str(e)})
        return 0
    _emit({"results": {name: asdict(r) for name, r in results.items()}})
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
