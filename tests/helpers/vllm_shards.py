"""Run in its own process: one vLLM (tensor parallel size from argv) whose workers each state their shards
(`VllmEngine.shards`), load their slices of random weights (`load_shards`) and read them back
(`held_shard`), compared bitwise with loading the whole tensors (`load`); prints one JSON line.

The workers run `ShardsExtension` (this module, imported by vLLM from the PYTHONPATH it inherits).
"""

from __future__ import annotations

import json
import sys

import torch


def _weights(specs: list, seed: int) -> dict[str, torch.Tensor]:
    """The same random full tensors in every worker."""
    out = {}
    for i, spec in enumerate(specs):
        g = torch.Generator().manual_seed(seed * 100_003 + i)
        out[spec.name] = torch.randn(spec.shape, generator=g, dtype=torch.float64).to(spec.dtype)
    return out


def _cut(t: torch.Tensor, part) -> torch.Tensor:  # noqa: ANN001
    return t if part is None else t.narrow(part.dim, part.start, part.length).contiguous()


def _refit(engine, version: int, tensors: list[tuple[str, torch.Tensor]], *, sliced: bool) -> None:  # noqa: ANN001
    engine.begin(version)
    for i in range(0, len(tensors), 5):  # several buckets: modules are processed as their last part arrives
        (engine.load_shards if sliced else engine.load)(tensors[i : i + 5])
    engine.commit(version)


def _params(engine) -> dict[str, torch.Tensor]:  # noqa: ANN001
    out = {n: p.detach().clone() for n, p in engine.model.named_parameters(remove_duplicate=False)}
    for lp in engine.plan.layers.values():
        out.update({f"{lp.module}.{n}#shadow": t.clone() for n, t in lp.shadows.items()})
    return out


class ShardsExtension:
    """Worker extension: build a VllmEngine on the worker's model and exercise its shard methods."""

    def shards_start(self, options: dict) -> dict:
        from refit.integrations.vllm.engine import VllmEngine, VllmOptions, worker_index

        runner = self.model_runner  # type: ignore[attr-defined]
        self.shards_engine = VllmEngine(runner.get_model(), runner.model_config, VllmOptions(**options))
        stated = self.shards_engine.shards()
        return {"rank": worker_index(), "shards": {n: None if p is None else p.to_json() for n, p in stated.items()}}

    def shards_check(self, seed: int) -> dict:
        from refit.integrations.vllm.engine import worker_index

        engine = self.shards_engine
        specs = engine.specs()
        stated = engine.shards()
        a, b = _weights(specs, seed), _weights(specs, seed + 1)
        _refit(engine, 1, list(a.items()), sliced=False)
        whole = _params(engine)
        _refit(engine, 2, list(b.items()), sliced=False)
        other = _params(engine)
        _refit(engine, 3, [(n, _cut(t, stated[n])) for n, t in a.items()], sliced=True)
        shards = _params(engine)
        held_none, held_bad = [], []
        for name, t in a.items():
            got = engine.held_shard(name)
            if got is None:
                held_none.append(name)
            elif got.shape != _cut(t, stated[name]).shape or not torch.equal(got, _cut(t, stated[name]).to(got.dtype)):
                held_bad.append(name)
        return {
            "rank": worker_index(),
            "diff": sorted(n for n in whole if not torch.equal(whole[n], shards[n])),
            "unchanged": sorted(n for n in whole if torch.equal(whole[n], other[n])),
            "params": len(whole),
            "shadows": sorted(n for n in whole if n.endswith("#shadow")),
            "fallback": sorted(m for m, lp in engine.plan.layers.items() if lp.kind.value == "fallback"),
            "held_none": held_none,
            "held_bad": held_bad,
            "state": engine.weights.state.value,
        }


def main() -> int:
    model_dir, tp, option_sets = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
    extra = json.loads(sys.argv[4]) if len(sys.argv) > 4 else {}  # more LLM arguments (expert parallelism)
    from vllm import LLM

    llm = LLM(model=model_dir, load_format="dummy", enforce_eager=True, dtype="float32", max_model_len=256,
              kv_cache_memory_bytes=64 << 20, tensor_parallel_size=tp, skip_tokenizer_init=True,
              worker_extension_cls="vllm_shards.ShardsExtension",
              **({"distributed_executor_backend": "mp"} if tp > 1 else {}), **extra)  # fmt: skip
    results = []
    for options in option_sets:
        stated = sorted(llm.collective_rpc("shards_start", args=(options,)), key=lambda r: r["rank"])
        checks = sorted(llm.collective_rpc("shards_check", args=(7,)), key=lambda r: r["rank"])
        results.append({"options": options, "workers": stated, "checks": checks})
    print("@@shards " + json.dumps(results), flush=True)
    llm.llm_engine.engine_core.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
