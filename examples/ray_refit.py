"""Refit between Ray actors: a trainer actor pushes its weights into an engine actor after every step.

This is the shape NeMo-RL and verl use: trainer and engine are actors, the rendezvous info (a small
JSON-able dict) travels through a Ray call, and the weights travel over refit's own transport.

refit is not on the package index: install it from its checkout, then run the example there.

    pip install -e '.[ray,demo]' && python examples/ray_refit.py --transport shm,gloo
"""

from __future__ import annotations

import argparse
import sys

try:
    import ray
    import transformers  # noqa: F401 - the demo model below is a transformers model
except ModuleNotFoundError as e:
    sys.stderr.write(
        f"error: examples/ray_refit.py needs {e.name}, which is not installed; "
        "pip install -e '.[ray,demo]' from the refit checkout\n"
    )
    raise SystemExit(2) from None
import torch

from refit import ModuleEngine, ModuleSource, Receiver, Sender
from refit.tools.demo.model import PROMPTS, TEXT, build_model, build_tokenizer, greedy, model_config

SIZE = {"layers": 2, "hidden": 128, "ffn": 384}


@ray.remote
class Trainer:
    def __init__(self, transport: str) -> None:
        self.tok = build_tokenizer()
        self.model = build_model(model_config(**SIZE), seed=0)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=3e-3)
        self.sender = Sender(ModuleSource(self.model, wire_dtype=torch.bfloat16), transport=transport)

    def rendezvous(self) -> dict:
        return self.sender.rendezvous()

    def prompts(self) -> list[list[int]]:
        return [self.tok(p)["input_ids"] for p in PROMPTS]

    def train_step(self) -> float:
        ids = torch.tensor([self.tok(TEXT)["input_ids"][:128]])
        loss = self.model(input_ids=ids, labels=ids).loss
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()
        return float(loss.detach())

    def refit(self, version: int) -> dict:
        return self.sender.refit(version).to_json()

    def reference(self, prompts: list[list[int]]) -> list[list[int]]:
        """Greedy output with exactly the weights sent (bf16 values)."""
        ref = build_model(model_config(**SIZE), seed=0)
        with torch.no_grad():
            for name, t in ref.state_dict(keep_vars=True).items():
                t.copy_(self.model.state_dict()[name].to(torch.bfloat16))
        return greedy(ref, prompts)

    def close(self) -> None:
        self.sender.close()


@ray.remote
class Engine:
    def __init__(self, rendezvous: dict) -> None:
        self.model = build_model(model_config(**SIZE), seed=1)  # random until the first refit
        self.engine = ModuleEngine(self.model)
        self.receiver = Receiver(self.engine, rendezvous)

    def receive(self) -> dict | None:
        stats = self.receiver.receive()
        return None if stats is None else stats.to_json()

    def generate(self, prompts: list[list[int]]) -> list[list[int]]:
        self.engine.ensure_current()
        return greedy(self.model, prompts)


def run(transport: str, steps: int) -> bool:
    trainer = Trainer.remote(transport)
    engine = Engine.remote(ray.get(trainer.rendezvous.remote()))
    prompts = ray.get(trainer.prompts.remote())
    ok = True
    for version in range(1, steps + 1):
        loss = ray.get(trainer.train_step.remote())
        got, sent = ray.get([engine.receive.remote(), trainer.refit.remote(version)])  # both sides at once
        same = ray.get(engine.generate.remote(prompts)) == ray.get(trainer.reference.remote(prompts))
        ok &= same and got["version"] == version
        ms = sent["seconds"]["total"] * 1e3
        print(
            f"{transport} v{version}: loss {loss:.3f}, {sent['nbytes'] / 1e6:.1f} MB in {ms:.1f} ms, "
            f"generation {'equal' if same else 'DIFFERENT'}"
        )
    ray.get(trainer.close.remote())
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--transport", default="shm,gloo", help="comma-separated: shm, gloo, run one after the other")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps, each followed by a refit")
    args = parser.parse_args()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    ok = all([run(t, args.steps) for t in args.transport.split(",")])
    print("all refits verified" if ok else "verification FAILED")
    ray.shutdown()
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
