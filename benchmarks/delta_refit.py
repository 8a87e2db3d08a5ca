"""Delta refits against full refits of the same weights, over one link, in one process run.

The trainer is the demo's Llama-style LM (refit.tools.demo, built locally from a config): fp32 master
weights, real AdamW steps at `--lr` on the demo's text, bf16 on the wire. Two Senders over the same source
(one `delta=True`, one not), each with its own engine (a bf16 ModuleEngine, as inference runs, behind a
Receiver in a thread of this process), refit after every step in alternating order; both verify every refit
(the fingerprint of each whole engine tensor against the trainer's live one). Per step it records the
fraction of bf16 wire values that changed, each refit's `wire_bytes` and `full_bytes`, and the sender's
wall time (`RefitStats.total_s`). Then the worst case, `--worst` times: every weight negated (every
nonzero value changes) and both refit. The first refit of each (connect, handshake, full either way) is
not counted. Prints one JSON object of medians (writes it with --out) and checks both engines bitwise
against the trainer's live tensors at the end.

    PYTHONPATH=src python benchmarks/delta_refit.py --lr 1e-6 --steps 7 --out benchmarks/results/delta-gloo-1e-6.json
    PYTHONPATH=src python benchmarks/delta_refit.py --transport nccl --device cuda:0 --engine-device cuda:1 \
        --lr 1e-6 --layers 16 --hidden 2048 --bucket-bytes 268435456
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading

import torch

from refit import ModuleEngine, ModuleSource, Receiver, Sender, Settings
from refit.tools.demo.model import train_step
from refit.tools.demo.run import DemoConfig, demo_model

BF16 = torch.bfloat16


class Side:
    """One Sender over the shared source, and its engine served by a Receiver thread."""

    def __init__(self, source: ModuleSource, params: dict[str, torch.Tensor], args, *, delta: bool) -> None:
        settings = Settings(bucket_bytes=args.bucket_bytes, timeout_s=600.0)
        device = torch.device(args.device)
        self.sender = Sender(source, transport=args.transport, settings=settings, delta=delta, device=device)
        on = torch.device(args.engine_device or args.device)
        self.engine = ModuleEngine({n: torch.zeros_like(t, dtype=BF16, device=on) for n, t in params.items()})
        self.receiver = Receiver(self.engine, self.sender.rendezvous(), settings=settings, device=on)
        self.thread = threading.Thread(target=self.receiver.serve, daemon=True)
        self.thread.start()
        self.stats: list[dict] = []

    def refit(self, version: int) -> dict:
        s = self.sender.refit(version)
        row = {"version": version, "delta": s.delta, "wire_bytes": s.wire_bytes, "full_bytes": s.full_bytes}
        row["seconds"] = s.total_s
        row["stages"] = {k: round(v, 4) for k, v in s.seconds.items()}
        self.stats.append(row)
        return row

    def close(self) -> None:
        self.sender.close()
        self.thread.join(60)
        self.receiver.close()


def changed_fraction(before: dict[str, torch.Tensor], params: dict[str, torch.Tensor]) -> float:
    changed = sum(int(torch.count_nonzero(before[n] != p.detach().to(BF16))) for n, p in params.items())
    return changed / sum(p.numel() for p in params.values())


def run(args) -> dict:
    cfg = DemoConfig(layers=args.layers, hidden=args.hidden)
    _, model, _, ids, _ = demo_model(cfg)
    model, ids = model.to(args.device), ids.to(args.device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    params = dict(model.named_parameters())
    source = ModuleSource(model, wire_dtype=BF16)
    full, delta = Side(source, params, args, delta=False), Side(source, params, args, delta=True)
    fractions = []
    try:
        full.refit(0), delta.refit(0)  # connect and handshake; full either way: not counted
        for step in range(1, args.steps + 1):
            before = {n: p.detach().to(BF16) for n, p in params.items()}
            train_step(model, opt, ids)
            fractions.append(changed_fraction(before, params))
            for side in (full, delta) if step % 2 else (delta, full):
                side.refit(step)
        worst: dict[str, list[dict]] = {"full": [], "delta": []}
        for i in range(args.worst):
            with torch.no_grad():
                for p in params.values():
                    p.neg_()  # every nonzero value changes
            version = args.steps + 1 + i
            for name, side in (("full", full), ("delta", delta)) if i % 2 else (("delta", delta), ("full", full)):
                worst[name].append(side.refit(version))
        for side in (full, delta):  # bitwise, against the trainer's live tensors
            for n, p in params.items():
                got = side.engine.tensor(n).view(torch.int16).to(p.device)
                assert torch.equal(got, p.detach().to(BF16).view(torch.int16)), n
    finally:
        full.close()
        delta.close()
    steps = slice(1, args.steps + 1)
    return _summary(args, fractions, full.stats[steps], delta.stats[steps], worst)


def _summary(args, fractions: list[float], full: list[dict], delta: list[dict], worst: dict) -> dict:
    med = statistics.median
    t_full, t_delta = med(r["seconds"] for r in full), med(r["seconds"] for r in delta)
    w_full, w_delta = med(r["seconds"] for r in worst["full"]), med(r["seconds"] for r in worst["delta"])
    wire = med(r["wire_bytes"] / r["full_bytes"] for r in delta)
    return {
        "transport": args.transport,
        "lr": args.lr,
        "layers": args.layers,
        "hidden": args.hidden,
        "steps": args.steps,
        "full_bytes": delta[0]["full_bytes"],
        "changed_values_fraction_median": med(fractions),
        "changed_values_fraction": fractions,
        "delta_wire_over_full_median": wire,
        "delta_refits_sent_as_delta": sum(r["delta"] for r in delta),
        "full_refit_s_median": t_full,
        "delta_refit_s_median": t_delta,
        "delta_over_full_time": t_delta / t_full,
        "worst_case_all_changed": {
            "refits": args.worst,
            "full_s_median": w_full,
            "delta_s_median": w_delta,
            "delta_over_full_time": w_delta / w_full,
            "delta_wire_bytes": [r["wire_bytes"] for r in worst["delta"]],
            "stages": {"full": worst["full"][-1]["stages"], "delta": worst["delta"][-1]["stages"]},
        },
        "verified": True,
        "refits": {"full": full, "delta": delta, "worst_full": worst["full"], "worst_delta": worst["delta"]},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--transport", default="gloo")
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--steps", type=int, default=7)
    p.add_argument("--worst", type=int, default=5, help="refits after negating every weight (each time)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--bucket-bytes", type=int, default=8 << 20)
    p.add_argument("--device", default="cpu", help="the trainer's device (cuda for nccl and nixl in VRAM)")
    p.add_argument("--engine-device", default="", help="the engines' device (default: --device; nccl: cuda:1)")
    p.add_argument("--out", default="")
    args = p.parse_args()
    if args.transport == "cuda-ipc":
        p.error(
            "cuda-ipc cannot run here: the engines live in this process, and CUDA IPC opens no handle in the "
            "process that made it; use --transport nixl (one GPU) or nccl (two GPUs)"
        )
    result = run(args)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
