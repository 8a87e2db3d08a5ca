"""An engine worker for per-rank refit tests: picks its trainer rank's rendezvous, then runs as tests/helpers/peer.py.

Its JSON argument is peer.py's, except that "rendezvous" is every trainer rank's (a list) and
"index" is this worker's position; a CUDA worker picks by its GPU's UUID, a CPU worker by index.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import peer
import torch
import warm

from refit.topology.ranked import pick


class RankWorker(peer.Peer):
    """Starts rank_worker.py (with extra environment, e.g. its own CUDA_VISIBLE_DEVICES) and reads its reports."""

    def __init__(self, args: dict, env: dict | None = None) -> None:
        full = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), *sys.path]), **(env or {})}
        self.proc = warm.popen(
            [sys.executable, __file__, json.dumps(args)], stdout=subprocess.PIPE, text=True, env=full
        )


def main() -> int:
    args = json.loads(sys.argv[1])
    device = torch.device(args.get("device", "cpu"))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    args["rendezvous"] = pick(args["rendezvous"], device, index=args["index"])
    sys.argv[1] = json.dumps(args)
    return peer.main()


if __name__ == "__main__":
    raise SystemExit(main())
