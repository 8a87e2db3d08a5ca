"""The handshake's own work for an N-tensor manifest, in CPU seconds: planning, JSON and digest on the
sender, parsing (with every layout check) and digest on the receiver, validation against the engine.

Run: python benchmarks/handshake.py [N]      (default 100000; best of 3)
"""

from __future__ import annotations

import sys
import time

import torch

from refit.checks.manifest_check import validate
from refit.layout.manifest import Manifest
from refit.layout.planner import plan
from refit.layout.spec import TensorSpec


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 100_000
    specs = [TensorSpec(f"model.layers.{i // 256}.mlp.experts.{i % 256}.w", (64,), torch.bfloat16) for i in range(n)]
    best = [float("inf")] * 5
    for _ in range(3):
        clock = time.process_time
        t0 = clock()
        m = plan(specs, capacity=64 << 20)
        t1 = clock()
        data, digest = m.to_json(), m.digest
        t2 = clock()
        received = Manifest.from_json(data)
        assert received.digest == digest
        t3 = clock()
        assert validate(received.specs, specs).ok
        t4 = clock()
        for i, v in enumerate((t1 - t0, t2 - t1, t3 - t2, t4 - t3, t4 - t0)):
            best[i] = min(best[i], v)
    print(
        f"{n} tensors, CPU s: plan {best[0]:.3f}, JSON + digest {best[1]:.3f}, parse + checks + digest "
        f"{best[2]:.3f}, validate {best[3]:.3f}; total {best[4]:.3f}"
    )


if __name__ == "__main__":
    main()
