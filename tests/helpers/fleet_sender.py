"""A sender process for the fleet and link tests: its costs measured (never pinned), reporting each refit.

One JSON argument: {"specs", "transport", "bucket_bytes", "steps", "receivers"} and optionally "delta". Each step
changes one value in 64 of every tensor, as a small optimizer step does. Prints '@@sender' + its rendezvous, then
one '@@sender' line per refit: the fingerprints of what it sent, the bytes it moved and how its buckets went.
"""

from __future__ import annotations

import json
import sys

import torch
from peer import make_tensors

from refit import ModuleSource, Sender, Settings
from refit.checks.fingerprints import fingerprints


def main() -> int:
    args = json.loads(sys.argv[1])
    tensors = make_tensors(args["specs"], seed=1)
    source = ModuleSource(tensors, wire_dtype=torch.bfloat16)
    settings = Settings(bucket_bytes=args["bucket_bytes"], timeout_s=args.get("timeout_s", 120.0))
    with Sender(
        source,
        transport=args["transport"],
        num_receivers=args.get("receivers", 1),
        settings=settings,
        delta=bool(args.get("delta")),
        verify="fingerprint",
    ) as sender:
        print("@@sender " + json.dumps(sender.rendezvous()), flush=True)
        for version in range(1, args["steps"] + 1):
            for t in tensors.values():
                t.view(-1)[version % 64 :: 64].mul_(1.5)
            stats = sender.refit(version)
            wire = {s.name: s.dtype for s in source.specs()}
            report = {"fingerprints": fingerprints(tensors.items(), wire), "wire_bytes": stats.wire_bytes}
            print("@@sender " + json.dumps({**report, "buckets": stats.buckets, "delta": stats.delta}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
