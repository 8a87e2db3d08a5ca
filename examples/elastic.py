"""Elastic engines: engines join, die and come back while one trainer session goes on.

The trainer trains a tiny Llama (built locally from a config) and refits after every step through one
elastic Sender. Engine A joins, refit 1; engine B joins, refit 2 reaches both; A is killed (SIGKILL, a real
process), refit 3 commits on B and names A as departed; A is restarted, refit 4 reaches both. After each
refit every engine that took part sends back a fingerprint of every tensor it holds (a JSON line on its
stdout), and the trainer compares them with its live tensors, bit for bit; refit's own fingerprint check
(`verify="fingerprint"`) runs inside every refit too. One line per refit; exit 0 when every check held.

refit is not on the package index: install it from its checkout, then run the example there.

    pip install -e '.[demo]' && python examples/elastic.py
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys

import torch

from refit import ModuleEngine, ModuleSource, Receiver, Sender
from refit.checks.fingerprints import fingerprints
from refit.tools.demo.model import TEXT, build_model, build_tokenizer, model_config

SIZE = {"layers": 2, "hidden": 128, "ffn": 384}
JOIN_TIMEOUT_S = 600.0
"""How long a started engine may take to join (a process start, torch and transformers imports)."""


def engine_main(rendezvous: dict) -> int:
    """An engine process: random weights until its first refit, then a report line after every commit."""
    model = build_model(model_config(**SIZE), seed=1)
    engine = ModuleEngine(model)
    with Receiver(engine, rendezvous) as receiver:
        while (stats := receiver.receive()) is not None:
            engine.ensure_current()
            held = dict(model.state_dict())
            report = {"version": stats.version, "rank": receiver.rank, "fingerprints": _fingerprints(held)}
            print(json.dumps(report), flush=True)
    return 0


def _fingerprints(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    return fingerprints(tensors.items(), {n: t.dtype for n, t in tensors.items()})


class EngineProcess:
    """One engine, a real process running this file with --engine, reporting on its stdout."""

    def __init__(self, name: str, rendezvous: dict) -> None:
        self.name = name
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--engine", json.dumps(rendezvous)], stdout=subprocess.PIPE, text=True
        )

    def report(self) -> dict:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"engine {self.name} exited with {self.proc.wait()} before reporting")
        return json.loads(line)

    def kill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


class Trainer:
    """The model, its optimizer, and one elastic Sender for the whole run."""

    def __init__(self, transport: str) -> None:
        tok = build_tokenizer()
        self.ids = torch.tensor([tok(TEXT)["input_ids"][:64]])
        self.model = build_model(model_config(**SIZE), seed=0)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=3e-3)
        self.sender = Sender(ModuleSource(self.model), transport=transport, elastic=True, verify="fingerprint")

    def step(self) -> None:
        loss = self.model(input_ids=self.ids, labels=self.ids).loss
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()

    def check(self, version: int, engines: list[EngineProcess]) -> tuple[dict[int, str], bool]:
        """Each engine's report for `version`, compared with the live weights; ({rank: engine}, all equal)."""
        live = _fingerprints(dict(self.model.state_dict()))
        reports = {e.name: e.report() for e in engines}
        same = all(r["version"] == version and r["fingerprints"] == live for r in reports.values())
        return {r["rank"]: name for name, r in reports.items()}, same


def refit(trainer: Trainer, version: int, engines: list[EngineProcess], names: dict[int, str]) -> bool:
    """One step and one refit; prints its line and returns whether every check held."""
    trainer.step()
    stats = trainer.sender.refit(version)
    ranks, same = trainer.check(version, engines)
    names.update(ranks)
    took = ", ".join(f"{names.get(r, '?')} (receiver {r})" for r in stats.receivers) or "none"
    gone = "; ".join(f"{names.get(d['receiver'])} (receiver {d['receiver']}): {d['reason']}" for d in stats.departed)
    ok = same and stats.receivers == sorted(ranks)
    print(
        f"refit {version}: committed on {took}; departed: {gone or 'none'}; "
        f"weights {'bitwise equal to the trainer' if ok else 'DIFFERENT'}",
        flush=True,
    )
    return ok


def run(transport: str) -> bool:
    trainer = Trainer(transport)
    rendezvous, names, ok = trainer.sender.rendezvous(), {}, True
    try:
        a = EngineProcess("A", rendezvous)
        ok &= refit(trainer, 1, [a], names)  # the first refit waits for one receiver (num_receivers=1)
        b = EngineProcess("B", rendezvous)
        ok &= trainer.sender.await_receivers(2, timeout_s=JOIN_TIMEOUT_S)
        ok &= refit(trainer, 2, [a, b], names)
        a.kill()
        ok &= refit(trainer, 3, [b], names)
        a = EngineProcess("A (restarted)", rendezvous)
        ok &= trainer.sender.await_receivers(2, timeout_s=JOIN_TIMEOUT_S)
        ok &= refit(trainer, 4, [a, b], names)
    finally:
        trainer.sender.close()
    return ok and a.proc.wait() == 0 and b.proc.wait() == 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--transport", default="shm", choices=["shm", "gloo"], help="the elastic transport")
    parser.add_argument("--engine", metavar="RENDEZVOUS", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.engine:
        return engine_main(json.loads(args.engine))
    return 0 if run(args.transport) else 1


if __name__ == "__main__":
    raise SystemExit(main())
