"""One M:N engine worker: a ModuleEngine over its local slices (zeros at first), fed by every trainer rank.

One JSON argument: "rendezvous" (MeshRefit's), "kind", "worker", "workers", "device" (default cpu), optionally
"stated_workers" (state its slices as one of that many workers, a layout the trainer did not plan) and "fault"
({"kind": "die", "version": v, "at": "begin" | "commit"}: exit 9 when its engine begins, or commits after every
byte of v landed) and "announce" (print {"event": "connected"} once every pair has its READY). After each committed refit it prints one JSON line: the version, the bytes it received, its
engine's state, and the fingerprints of its local tensors read in fp32; after a failed one, the error and the
state (and it exits 3 when the session is over). With "staged": true it receives into staging memory and
reports, besides, what its engine held before `apply_staged()` ("before": version, staged version, fingerprints)
and whether that call applied the version.
"""

from __future__ import annotations

import json
import os
import sys

import torch
from mesh_model import build, local_part, statement

from refit import ModuleEngine, PeerError, RefitError, Settings
from refit.checks.fingerprints import fingerprint
from refit.topology.mesh import MeshReceiver


class FaultyEngine(ModuleEngine):
    """A ModuleEngine that exits 9 at the begin or the commit of one version (M:N writes land in its tensors
    directly, so there is no load to die in)."""

    fault: dict = {}

    def begin(self, version: int) -> None:
        self._die("begin", version)
        super().begin(version)

    def commit(self, version: int) -> None:
        self._die("commit", version)
        super().commit(version)

    def _die(self, at: str, version: int) -> None:
        if self.fault.get("kind") == "die" and (self.fault["version"], self.fault["at"]) == (version, at):
            os._exit(9)


def main() -> int:
    args = json.loads(sys.argv[1])
    held = statement(args["kind"], args["worker"], args.get("stated_workers", args["workers"]))
    full = build(args["kind"], seed=1).state_dict()
    device = torch.device(args.get("device", "cpu"))
    local = {n: torch.zeros_like(local_part(full[n], h), device=device).contiguous() for n, h in held.items()}
    engine = FaultyEngine(local, shards={n: h for n, h in held.items() if h is not None})
    engine.fault = args.get("fault", {})
    settings = Settings(timeout_s=120.0)
    staged = bool(args.get("staged"))
    with MeshReceiver(engine, args["rendezvous"], worker=args["worker"], settings=settings, device=device,
                      staged=staged) as rx:  # fmt: skip
        if args.get("announce"):
            rx.connect()
            print(json.dumps({"event": "connected"}), flush=True)
        while True:
            try:
                stats = rx.receive()
            except RefitError as e:
                print(json.dumps({"error": str(e), "state": engine.weights.state.value}), flush=True)
                if isinstance(e, PeerError):
                    return 3
                continue
            if stats is None:
                return 0
            extra = {}
            if staged:
                w = engine.weights
                fps = {n: fingerprint(t.float(), torch.float32) for n, t in local.items()}
                extra = {"before": {"version": w.version, "staged": w.staged, "fingerprints": fps},
                         "applied": rx.apply_staged()}  # fmt: skip
            fps = {n: fingerprint(t.float(), torch.float32) for n, t in local.items()}
            print(json.dumps({"version": stats.version, "nbytes": stats.nbytes, "state": engine.weights.state.value,
                              "fingerprints": fps, **extra}), flush=True)  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())
