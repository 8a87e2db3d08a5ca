"""Staged refit: the pause an engine loop sees, and its generation throughput while a refit stages.

The engine (this process) is the demo's Llama-style model (refit.tools.demo.model, built locally from a
config) behind `Receiver(..., staged=True)`, receiving in a background thread while the main thread
generates: one step is a forward pass over a fixed batch of tokens, and between steps the loop calls
`receiver.apply_staged()`. The trainer (a child process, the same model) refits over gloo on request.

Measured in the engine's loop, per refit:
- pause: the time of the `apply_staged()` call that applied the version;
- throughput while staging: steps completed from the refit's request until the `apply_staged()` call
  that applied it began (its version staged; with `--staging-bytes`, partial staging: the pause began),
  over that window, against the steps/s of the same loop with no refit (measured just before);
- the floor: one local copy of the model (`torch._foreach_copy_` of every parameter into a same-dtype
  tensor), timed right after the pause. Ratios are taken per refit, then their median. The first refit
  (--warmup) connects, handshakes and allocates the staging memory: it runs but is not counted. After the last refit the engine's live weights are compared,
bitwise, with the trainer's live weights. Also reported, to explain the throughput: the CPU seconds
the trainer spent on each step and refit, and the engine's CPU seconds in the window beyond what its
steps took at the no-refit rate (its receiving). Prints one JSON
object of medians (and writes it with --out).

    PYTHONPATH=src python benchmarks/staged_pause.py --refits 7 --out benchmarks/results/staged_pause.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time

import torch

from refit import ModuleEngine, ModuleSource, Receiver, Sender
from refit.checks.fingerprints import fingerprints
from refit.tools.demo.model import model_config


def _model(args: argparse.Namespace) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = model_config(layers=args.layers, hidden=args.hidden, ffn=args.hidden * 3)
    return AutoModelForCausalLM.from_config(config).eval()


def _digests(model: torch.nn.Module) -> dict[str, str]:
    state = dict(model.named_parameters())
    return fingerprints(state.items(), {n: t.dtype for n, t in state.items()})


def _trainer(args: argparse.Namespace) -> int:
    """Child process: a Sender over the model; on each "refit v" line, a step (every weight changes) and a refit."""
    model = _model(args)
    sender = Sender(ModuleSource(model), transport="gloo")
    print(json.dumps(sender.rendezvous()), flush=True)
    for text in sys.stdin:
        version = int(text.split()[1]) if text.startswith("refit ") else None
        if version is None:
            break
        cpu = time.process_time()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1e-3 * version)
        stats = sender.refit(version)
        cpu = time.process_time() - cpu
        print(json.dumps({"version": version, "total_s": stats.seconds["total"], "cpu_s": cpu}), flush=True)
    print(json.dumps({"digests": _digests(model)}), flush=True)
    sender.close()
    return 0


class Floor:
    """One local copy of every parameter into a same-dtype scratch tensor (`torch._foreach_copy_`): the
    least a final copy can cost. Timed right after each pause, in the same loop, so both see the same load."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.live = [p.detach() for p in model.parameters()]
        self.scratch = [torch.empty_like(t) for t in self.live]
        torch._foreach_copy_(self.scratch, self.live)  # first touch of the scratch pages, not timed

    def time(self) -> float:
        t = time.perf_counter()
        torch._foreach_copy_(self.scratch, self.live)
        return time.perf_counter() - t


def _steps_per_s(step, seconds: float) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    """(steps/s, this process's CPU seconds per step) with no refit."""
    n, t0, cpu = 0, time.perf_counter(), time.process_time()
    while time.perf_counter() - t0 < seconds:
        step()
        n += 1
    return n / (time.perf_counter() - t0), (time.process_time() - cpu) / n


def _refit_once(version: int, step, receiver: Receiver, child: subprocess.Popen, floor: Floor,  # type: ignore[no-untyped-def]
                baseline_s: float) -> dict:  # fmt: skip
    """Generate with no refit for `baseline_s`; request a refit, generate until its version is staged, then
    until `apply_staged()` applies it; then time the floor copy."""
    assert child.stdin is not None and child.stdout is not None
    base, step_cpu = _steps_per_s(step, baseline_s)
    t0, cpu = time.perf_counter(), time.process_time()
    child.stdin.write(f"refit {version}\n")
    child.stdin.flush()
    steps = 0
    while True:  # an engine loop: apply_staged() at every step boundary (partial staging pauses inside it)
        t = time.perf_counter()
        applied = receiver.apply_staged()
        pause = time.perf_counter() - t
        if applied:
            break
        step()
        steps += 1
    window, cpu = t - t0, time.process_time() - cpu
    copy = floor.time()
    sent = json.loads(child.stdout.readline())
    return {"pause_s": pause, "floor_s": copy, "no_refit_steps_per_s": base, "staging_steps_per_s": steps / window,
            "window_s": window, "steps": steps, "trainer_refit_s": sent["total_s"], "trainer_cpu_s": sent["cpu_s"],
            "receive_cpu_s": cpu - steps * step_cpu}  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--refits", type=int, default=7)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--tokens", type=int, default=64, help="tokens in one generation step's batch")
    p.add_argument(
        "--baseline-s", type=float, default=3.0, help="seconds of generation with no refit before each refit"
    )
    p.add_argument("--warmup", type=int, default=1, help="refits run first and not counted (the first connects)")
    p.add_argument("--threads", type=int, help="torch threads in each process (default: torch's own)")
    p.add_argument("--trainer-nice", type=int, default=0, help="niceness of the trainer process (it shares the cores)")
    p.add_argument("--staging-bytes", type=int, help="bound the staging memory (partial staging); default: none")
    p.add_argument("--out", help="also write the JSON here")
    p.add_argument("--trainer", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.trainer:
        return _trainer(args)
    argv = [sys.executable, __file__, "--trainer", "--layers", str(args.layers), "--hidden", str(args.hidden)]
    argv += ["--threads", str(args.threads)] if args.threads else []
    nice = (lambda: os.nice(args.trainer_nice)) if args.trainer_nice else None
    child = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, preexec_fn=nice)  # noqa: PLW1509
    assert child.stdout is not None and child.stdin is not None
    rendezvous = json.loads(child.stdout.readline())
    model = _model(args)
    engine = ModuleEngine(model)
    engine.assume_current(0)  # built from the trainer's seed: its version 0
    commits: list[int] = []
    receiver = Receiver(engine, rendezvous, staged=True, staging_bytes=args.staging_bytes, on_commit=commits.append)
    thread = threading.Thread(target=receiver.serve, name="refit-receive", daemon=True)
    thread.start()
    tokens = torch.arange(args.tokens).remainder(model.config.vocab_size).unsqueeze(0)

    def step() -> None:
        engine.ensure_current()
        with torch.no_grad():
            model(tokens)

    floor = Floor(model)
    versions = range(1, args.warmup + args.refits + 1)
    runs = [_refit_once(v, step, receiver, child, floor, args.baseline_s) for v in versions][args.warmup :]
    child.stdin.write("stop\n")
    child.stdin.flush()
    trainer = json.loads(child.stdout.readline())["digests"]
    thread.join()
    receiver.close()
    assert child.wait() == 0
    assert commits == list(versions), commits
    bitwise = trainer == _digests(model)
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    out = {
        "model_bytes": sum(t.numel() * t.element_size() for t in model.parameters()),
        "staging_bytes": receiver.staging.nbytes if receiver.staging is not None else 0,
        "staging_split": receiver.staging_split.describe() if receiver.staging_split is not None else "",
        "refits": args.refits,
        "warmup_refits": args.warmup,
        "floor_copy_s": med["floor_s"],
        "pause_s": med["pause_s"],
        "pause_over_floor": statistics.median(r["pause_s"] / r["floor_s"] for r in runs),
        "steps_per_s_no_refit": med["no_refit_steps_per_s"],
        "steps_per_s_staging": med["staging_steps_per_s"],
        "staging_over_no_refit": statistics.median(r["staging_steps_per_s"] / r["no_refit_steps_per_s"] for r in runs),
        "staging_window_s": med["window_s"],
        "steps_in_window": med["steps"],
        "trainer_refit_s": med["trainer_refit_s"],
        "trainer_cpu_s": med["trainer_cpu_s"],
        "receive_cpu_s": med["receive_cpu_s"],
        "per_refit": runs,
        "bitwise": bitwise,
        "torch_threads": torch.get_num_threads(),
        "trainer_nice": args.trainer_nice,
    }
    print(json.dumps(out, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=2)
    return 0 if bitwise else 1


if __name__ == "__main__":
    raise SystemExit(main())
