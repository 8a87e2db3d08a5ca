"""What the root per replica costs: the Merkle fold over a version's fingerprints (done by the trainer and by each
receiver inside every verified refit) against the refit itself, on the demo's model and on many small tensors,
ModuleEngine over shm in threads. Also `engine.root()` (a router's read: a digest pass over what the engine holds).
Prints one JSON object per case: medians over the timed refits after one warm-up.

    PYTHONPATH=src python benchmarks/root_cost.py --refits 7
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

import torch

from refit import ModuleEngine, ModuleSource, Receiver, Sender, Settings
from refit.checks.root import root
from refit.tools.demo.model import build_model, model_config


def _case(name: str, trainer: dict | torch.nn.Module, held: dict | torch.nn.Module, refits: int, **kw: object) -> dict:
    settings = Settings(timeout_s=120.0)
    sender = Sender(ModuleSource(trainer, **kw), transport="shm", settings=settings)  # type: ignore[arg-type]
    engine = ModuleEngine(held)  # type: ignore[arg-type]
    receiver = Receiver(engine, sender.rendezvous(), settings=settings)
    got: list = []
    thread = threading.Thread(target=lambda: got.extend(iter(receiver.receive, None)), daemon=True)
    thread.start()
    params = list(trainer.parameters()) if isinstance(trainer, torch.nn.Module) else list(trainer.values())
    rows = []
    try:
        for version in range(1, refits + 2):
            with torch.no_grad():
                for p in params:
                    p.add_(1e-3)
            t = time.perf_counter()
            stats = sender.refit(version)
            total = time.perf_counter() - t
            leaves = _leaves(stats)
            folds = []
            for _ in range(5):  # the fold is short: the median of five, against this machine's noise
                t = time.perf_counter()
                root(leaves)
                folds.append(time.perf_counter() - t)
            fold = statistics.median(folds)
            t = time.perf_counter()
            assert engine.root() == (version, stats.root)
            read = time.perf_counter() - t
            rows.append((total, fold, read))
    finally:
        sender.close()
        thread.join(60)
        receiver.close()
    rows = rows[1:]
    med = [round(statistics.median(r[i] for r in rows) * 1e3, 3) for i in range(3)]
    # fold_share: both sides' folds (the trainer's and the receiver's) as a share of the refit
    return {"case": name, "tensors": len(_leaves(stats)), "refit_ms": med[0], "root_fold_ms": med[1],
            "fold_share": round(2 * med[1] / med[0], 4), "engine_root_ms": med[2]}  # fmt: skip


_LAST: dict = {}


def _leaves(stats: object) -> list[str]:
    return _LAST["leaves"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--refits", type=int, default=7)
    args = ap.parse_args()
    from refit.topology import digest_plan

    real = digest_plan.DigestPlan.payloads

    def keep(self: digest_plan.DigestPlan) -> dict:  # the leaves the sender folded, for the fold's own timing
        out = real(self)
        _LAST["leaves"] = next(iter(out.values()))
        return out

    digest_plan.DigestPlan.payloads = keep  # type: ignore[method-assign]
    config = model_config()
    demo = _case("demo", build_model(config, seed=0), build_model(config, seed=1), args.refits)
    many = {f"t{i}": torch.randn(64) for i in range(10_000)}
    small = _case("10k-small", many, {k: v.clone() for k, v in many.items()}, args.refits)
    for row in (demo, small):
        print(json.dumps(row))


if __name__ == "__main__":
    main()
