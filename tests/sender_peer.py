"""A sender in its own process, for the fault tests: refits version 1, then dies during version 2.

Run as `python tests/sender_peer.py '<json>'`; prints the rendezvous as one '@@sender' JSON line.
"""

from __future__ import annotations

import json
import os
import sys

from peer import make_tensors
from refit import ModuleSource, Sender, Settings


def main() -> int:
    args = json.loads(sys.argv[1])
    tensors = make_tensors(args["specs"], seed=1)
    sender = Sender(ModuleSource(tensors), transport=args["transport"],
                    settings=Settings(bucket_bytes=args["bucket_bytes"], timeout_s=30))  # fmt: skip
    print("@@sender " + json.dumps(sender.rendezvous()), flush=True)
    sender.refit(1)
    send, sent = sender.transport.send, [0]

    def dying_send(slot: int, nbytes: int):
        sent[0] += 1
        if sent[0] == args["die_at_bucket"]:
            os._exit(17)  # the fault under test: the trainer process dies mid-refit
        return send(slot, nbytes)

    sender.transport.send = dying_send
    for t in tensors.values():
        t.add_(1.0)
    sender.refit(2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
