"""LoRA-only refits: a rank-R adapter on every linear layer of a preset's decoder, trainer and engine in two
processes on one device (cuda-ipc on a GPU, shm on CPU), the fingerprint on. The base is the same on both sides
(filled from one seed) and never moves; the engine is a LoraEngine over a PEFT model. Prints one JSON object:
the adapter's and the full model's bytes, and the median refit time (the trainer's `Sender.refit`, after the
first refit, which connects and checks the base).

    PYTHONPATH=src python benchmarks/lora_refit.py --preset qwen2-7b --rank 16 --device cuda   # a GPU
    PYTHONPATH=src python benchmarks/lora_refit.py --preset qwen2-0.5b --layers 4 --device cpu
    LORA_PROFILE=engine.prof PYTHONPATH=src python benchmarks/lora_refit.py ...   # the engine under cProfile
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import statistics
import subprocess
import sys
import time

import torch
from torch import nn

from refit import Receiver, Sender, Settings
from refit.stages.lora import LoraEngine, LoraSource
from refit.tools.bench.presets import PRESETS

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class Layer(nn.Module):
    def __init__(self, hidden: int, kv: int, ffn: int, device: torch.device) -> None:
        super().__init__()
        shapes = {"q_proj": (hidden, hidden), "k_proj": (hidden, kv), "v_proj": (hidden, kv),
                  "o_proj": (hidden, hidden), "gate_proj": (hidden, ffn), "up_proj": (hidden, ffn),
                  "down_proj": (ffn, hidden)}  # fmt: skip
        for name, (fan_in, fan_out) in shapes.items():
            setattr(self, name, nn.Linear(fan_in, fan_out, bias=False, device="meta"))


def base(args: argparse.Namespace, device: torch.device) -> nn.Module:
    """The decoder's linear layers in bf16, every weight drawn from one seed (the same in both processes)."""
    shape = PRESETS[args.preset]
    kv = shape.kv_heads * shape.head_dim
    layers = args.layers or shape.layers
    model = nn.ModuleDict({"layers": nn.ModuleList(Layer(shape.hidden, kv, shape.ffn, device) for _ in range(layers))})
    model = model.to_empty(device=device).to(torch.bfloat16)
    g = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02, generator=g)
    return model


def peft_model(args: argparse.Namespace, device: torch.device, adapters: torch.dtype = torch.float32) -> nn.Module:
    """The base wrapped by PEFT; its adapters in `adapters` (PEFT makes them float32; a serving engine often
    holds them in the model's bf16)."""
    import peft

    config = peft.LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules=list(TARGETS), lora_dropout=0.0)
    model = peft.get_peft_model(base(args, device), config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.data = p.data.to(adapters)
    return model


def engine(args: argparse.Namespace, rendezvous: dict) -> None:
    """The engine process; with LORA_PROFILE=PATH its refits run under cProfile, written to PATH."""
    device = torch.device(args.device)
    held = peft_model(args, device, getattr(torch, args.engine_adapters))
    with Receiver(LoraEngine(held), rendezvous, settings=Settings(timeout_s=600.0)) as r:
        path = os.environ.get("LORA_PROFILE")
        if not path:
            r.serve()
            return
        r.receive()  # the first refit (connect, the base's check) is not profiled
        prof = cProfile.Profile()
        prof.runcall(r.serve)
        prof.dump_stats(path)


def trainer(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    model = peft_model(args, device)
    transport = "cuda-ipc" if device.type == "cuda" else "shm"
    source = LoraSource(model, wire_dtype=torch.bfloat16)
    sender = Sender(source, transport=transport, settings=Settings(timeout_s=600.0), device=device)
    job = {**vars(args), "rendezvous": sender.rendezvous()}
    child = subprocess.Popen([sys.executable, __file__, "--engine", json.dumps(job)])
    adapters = [p for n, p in model.named_parameters() if "lora_" in n]
    times = []
    for version in range(1, args.refits + 2):
        with torch.no_grad():
            for p in adapters:
                p.add_(1e-3)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        stats = sender.refit(version)
        times.append(time.perf_counter() - t)
    sender.close()
    assert child.wait() == 0, "the engine process failed"
    full = sum(p.numel() * 2 for n, p in model.named_parameters() if "lora_" not in n)
    return {"preset": args.preset, "rank": args.rank, "device": str(device),
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "adapter_bytes": stats.nbytes, "base_bytes_bf16": full, "first_refit_s": times[0],
            "median_refit_ms": statistics.median(times[1:]) * 1e3, "refits": args.refits,
            "engine_adapters": args.engine_adapters}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="qwen2-7b")
    p.add_argument("--layers", type=int, default=0)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--refits", type=int, default=10)
    p.add_argument("--engine-adapters", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--engine", default="")
    args = p.parse_args()
    if args.engine:
        job = json.loads(args.engine)
        engine(argparse.Namespace(**{k: v for k, v in job.items() if k != "rendezvous"}), job["rendezvous"])
        return
    print(json.dumps(trainer(args)), flush=True)


if __name__ == "__main__":
    main()
