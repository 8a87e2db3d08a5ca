"""A sender in its own process, for the fault tests. By `mode`: refits version 1, then dies during
version 2 ("die", the default), stops itself between refits ("hang": SIGSTOP, as a hung process or a
vanished host looks), exits between refits ("exit"), or dies right after its transport was set up,
before any receiver is ready ("die_at_setup").

Run as `python tests/helpers/sender_peer.py '<json>'`; prints the rendezvous as one '@@sender' JSON line.
"""

from __future__ import annotations

import json
import os
import signal
import sys

from peer import make_tensors

from refit import ModuleSource, Sender, Settings


def main() -> int:
    args = json.loads(sys.argv[1])
    tensors = make_tensors(args["specs"], seed=1)
    sender = Sender(
        ModuleSource(tensors),
        transport=args["transport"],
        settings=Settings(bucket_bytes=args["bucket_bytes"], timeout_s=args.get("timeout_s", 30)),
        zero_copy=args.get("zero_copy", False),
    )
    print("@@sender " + json.dumps(sender.rendezvous()), flush=True)
    mode = args.get("mode", "die")
    if mode == "die_at_setup":
        offer = sender._transport_cls.offer

        def dying_offer(**kwargs):
            offer(**kwargs)
            print("@@offered", flush=True)
            os._exit(18)  # the fault under test: buffers exist, no receiver has mapped them yet

        sender._transport_cls.offer = dying_offer
    sender.refit(1)
    if mode == "hang":
        os.kill(os.getpid(), signal.SIGSTOP)
    if mode == "exit":
        os._exit(0)
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
