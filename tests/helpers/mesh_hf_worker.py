"""One M:N engine worker holding a whole Hugging Face model (ModuleEngine, no shards): fed by every
Megatron rank, each sending the checkpoint slices it holds (tests/helpers/megatron_trainer.py, "mesh").

One JSON argument: "rendezvous", "model" (refit.tools.demo.model.model_config keywords), "vocab".
After each committed refit it prints one JSON line: the version, the bytes received, the engine's
state and the fingerprints of its tensors read in fp32.
"""

from __future__ import annotations

import json
import sys

import torch

from refit import ModuleEngine, Settings
from refit.checks.fingerprints import fingerprint
from refit.tools.demo.model import build_model, model_config
from refit.topology.mesh import MeshReceiver


def main() -> int:
    args = json.loads(sys.argv[1])
    config = model_config(**args["model"])
    config.vocab_size = args.get("vocab", config.vocab_size)
    model = build_model(config, seed=1)
    engine = ModuleEngine(model)
    with MeshReceiver(engine, args["rendezvous"], worker=0, settings=Settings(timeout_s=120.0)) as rx:
        while (stats := rx.receive()) is not None:
            fps = {n: fingerprint(t.float(), torch.float32) for n, t in model.state_dict().items()}
            print(json.dumps({"version": stats.version, "nbytes": stats.nbytes, "state": engine.weights.state.value,
                              "fingerprints": fps}), flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
