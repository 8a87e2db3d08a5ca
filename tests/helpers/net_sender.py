"""A sender process for the two-host test: gloo from one network namespace, reporting what it sent.

One JSON argument: {"specs", "transport", "bucket_bytes", "steps"}. Prints '@@sender' + its
rendezvous, then one '@@sender' line per refit with the fingerprints of what it sent.
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
    with Sender(source, transport=args["transport"], settings=Settings(bucket_bytes=args["bucket_bytes"])) as sender:
        print("@@sender " + json.dumps(sender.rendezvous()), flush=True)
        for version in range(1, args["steps"] + 1):
            for t in tensors.values():
                t.mul_(1.01)
            sender.refit(version)
            wire = {s.name: s.dtype for s in source.specs()}
            print("@@sender " + json.dumps({"fingerprints": fingerprints(tensors.items(), wire)}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
