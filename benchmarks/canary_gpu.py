"""What the canary costs on a GPU: the demo's causal LM (or a larger one of the same family) on CUDA, trainer
here and engine (a ModuleEngine) in a child process over cuda-ipc, the fingerprint on. Refits without the
canary, then with it at `every=1` and `every=10`, each after a small step of every weight. Prints one JSON
object: the median refit time of each and its ratio to the refit without the canary.

    PYTHONPATH=src python benchmarks/canary_gpu.py --refits 20
    PYTHONPATH=src python benchmarks/canary_gpu.py --layers 24 --hidden 1024 --ffn 4864   # about 0.5B
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import torch

from refit import Canary, ModuleEngine, ModuleSource, Receiver, Sender, Settings, causal_lm
from refit.tools.demo.model import TEXT, build_model, build_tokenizer, model_config

SETTINGS = Settings(timeout_s=300.0)


def _config(args: argparse.Namespace):  # noqa: ANN202 - a transformers config
    return model_config(layers=args.layers, hidden=args.hidden, ffn=args.ffn)


def engine(args: argparse.Namespace, rendezvous: dict) -> None:
    held = build_model(_config(args), seed=1).to(device=args.device, dtype=torch.bfloat16)
    with Receiver(ModuleEngine(held), rendezvous, settings=SETTINGS) as receiver:
        receiver.serve()


def run(args: argparse.Namespace, every: int | None, probe: list[int]) -> list[float]:
    trainer = build_model(_config(args), seed=0).to(args.device)
    canary = None if every is None else Canary(probe, causal_lm(trainer), every=every)
    source = ModuleSource(trainer, wire_dtype=torch.bfloat16)
    transport = "cuda-ipc" if args.device.startswith("cuda") else "shm"
    sender = Sender(source, transport=transport, settings=SETTINGS, canary=canary, verify="fingerprint")
    job = {**vars(args), "rendezvous": sender.rendezvous()}
    child = subprocess.Popen([sys.executable, __file__, "--engine", json.dumps(job)])
    times = []
    try:
        for version in range(1, args.refits + 2):
            with torch.no_grad():
                for p in trainer.parameters():
                    p.mul_(1.0 + 1e-3)
            if transport == "cuda-ipc":
                torch.cuda.synchronize()
            t = time.perf_counter()
            sender.refit(version)
            times.append(time.perf_counter() - t)
    finally:
        sender.close()
        child.wait(120)
    return times[1:]  # the first refit connects


def main() -> None:
    p = argparse.ArgumentParser()
    for flag, default in (
        ("--layers", 8),
        ("--hidden", 512),
        ("--ffn", 1536),
        ("--refits", 20),
        ("--probe-tokens", 16),
    ):
        p.add_argument(flag, type=int, default=default)
    p.add_argument("--device", default="cuda")
    p.add_argument("--engine", default="", help="internal: the engine process's job (JSON)")
    args = p.parse_args()
    if args.engine:
        job = json.loads(args.engine)
        rendezvous = job.pop("rendezvous")
        return engine(argparse.Namespace(**job), rendezvous)
    probe = build_tokenizer()(TEXT)["input_ids"][: args.probe_tokens]
    gpu = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    out: dict = {"gpu": gpu, "layers": args.layers, "hidden": args.hidden,
                 "probe_tokens": len(probe), "refits": args.refits}  # fmt: skip
    for label, every in (("none", None), ("every1", 1), ("every10", 10)):
        times = run(args, every, probe)
        out[f"{label}_ms"] = round(statistics.median(times) * 1e3, 3)
        out[f"{label}_mean_ms"] = round(statistics.fmean(times) * 1e3, 3)
    for label in ("every1", "every10"):
        out[f"{label}_ratio"] = round(out[f"{label}_mean_ms"] / out["none_mean_ms"], 3)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
