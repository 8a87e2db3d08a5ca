"""A sender process for the two-host test: gloo from one network namespace, reporting what it sent.

One JSON argument: {"specs", "transport", "bucket_bytes", "steps"} and optionally "delta" (delta refits, with
the link's cost pinned slow so that every bucket that pays goes as a delta, whatever the machine's load) and "sparse" (each step changes one value in 64, as a small optimizer step does; else every value). Prints
'@@sender' + its rendezvous, then one '@@sender' line per refit with the fingerprints of what it sent and
the bytes it moved on the data plane.
"""

from __future__ import annotations

import json
import sys

import torch
from peer import make_tensors

from refit import ModuleSource, Sender, Settings
from refit.checks.fingerprints import fingerprints
from refit.stages.delta import Costs


def main() -> int:
    args = json.loads(sys.argv[1])
    tensors = make_tensors(args["specs"], seed=1)
    zero_copy = bool(args.get("zero_copy"))  # engines read the live tensors: they must be in the wire dtype
    source = ModuleSource(tensors, wire_dtype=None if zero_copy else torch.bfloat16)
    settings = Settings(bucket_bytes=args["bucket_bytes"])
    delta, sparse = bool(args.get("delta")), bool(args.get("sparse"))
    costs = Costs.known(link=1.0, per_op=0.0, per_byte=0.0) if delta else None
    with Sender(
        source,
        transport=args["transport"],
        settings=settings,
        delta=delta,
        delta_costs=costs,
        zero_copy=zero_copy,
        verify=args.get("verify", "fingerprint"),
    ) as sender:
        print("@@sender " + json.dumps(sender.rendezvous()), flush=True)
        for version in range(1, args["steps"] + 1):
            for t in tensors.values():
                if sparse:
                    t.view(-1)[version % 64 :: 64].mul_(1.5)
                else:
                    t.mul_(1.01)
            stats = sender.refit(version)
            wire = {s.name: s.dtype for s in source.specs()}
            report = {"fingerprints": fingerprints(tensors.items(), wire), "wire_bytes": stats.wire_bytes}
            print("@@sender " + json.dumps({**report, "delta": stats.delta}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
