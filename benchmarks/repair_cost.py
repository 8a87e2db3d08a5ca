"""What a repair costs: refits of the demo's model into a ModuleEngine (threads, shm, fingerprint on) where one
tensor loads wrong at every other refit and is fetched again within the refit (refit.topology.repair), against
the clean refits between them. Prints one JSON object per tensor: the repair's bytes (the REPAIR message whole)
as a share of the model's, and the median refit time with a repair and without, over the timed refits.

    PYTHONPATH=src python benchmarks/repair_cost.py --refits 6
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

import torch

from refit import ModuleEngine, ModuleSource, Receiver, Sender, Settings
from refit.tools.demo.model import build_model, model_config


class WrongEveryOther(ModuleEngine):
    """Flips one value of `name` after its load at every odd version (a flaky copy)."""

    def __init__(self, module: torch.nn.Module, name: str) -> None:
        super().__init__(module, repair=True)
        self.name, self.version = name, 0

    def begin(self, version: int) -> None:
        self.version, self.flip = version, version % 2 == 1
        super().begin(version)

    def load(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        super().load(tensors)
        if self.flip and any(n == self.name for n, _ in tensors):
            self.flip = False
            with torch.no_grad():
                self.tensor(self.name).view(-1)[0] += 1.0


def run(name: str, refits: int) -> dict:
    config = model_config()
    trainer = build_model(config, seed=0)
    settings = Settings(timeout_s=120.0)
    sender = Sender(ModuleSource(trainer), transport="shm", settings=settings)
    receiver = Receiver(WrongEveryOther(build_model(config, seed=1), name), sender.rendezvous(), settings=settings)
    thread = threading.Thread(target=lambda: list(iter(receiver.receive, None)), daemon=True)
    thread.start()
    rows: dict[bool, list[float]] = {True: [], False: []}
    try:
        for version in range(1, 2 * refits + 3):
            with torch.no_grad():
                for p in trainer.parameters():
                    p.add_(1e-3)
            t = time.perf_counter()
            stats = sender.refit(version)
            if version > 2:  # one warm-up of each kind
                rows[bool(stats.repaired)].append(time.perf_counter() - t)
            if stats.repaired:
                nbytes, model = stats.repair_bytes, stats.nbytes
    finally:
        sender.close()
        thread.join(60)
        receiver.close()
    clean, repaired = (round(statistics.median(rows[k]) * 1e3, 1) for k in (False, True))
    return {"tensor": name, "repair_bytes": nbytes, "model_bytes": model, "share": round(nbytes / model, 5),
            "clean_ms": clean, "repaired_ms": repaired, "ratio": round(repaired / clean, 3)}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--refits", type=int, default=6)
    args = ap.parse_args()
    for name in ("model.layers.3.self_attn.k_proj.weight", "model.layers.3.mlp.down_proj.weight"):
        print(json.dumps(run(name, args.refits)))


if __name__ == "__main__":
    main()
