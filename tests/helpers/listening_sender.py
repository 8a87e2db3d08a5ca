"""A sender in its own process whose ports a test attacks: prints its rendezvous ('@@sender' JSON), connects,
then prints the TCP ports its process listens on ({"refit": [...], "others": [...]}: "refit" are those open
once the transport's offer returned, before the transport's own group (gloo's listener) exists), then
refits on command.

One JSON argument: {"specs", "transport", "timeout_s"}. Each stdin line "refit <version>" trains one step,
refits that version and prints the live fingerprints ({"version", "fingerprints"}); "close" ends it.
"""

from __future__ import annotations

import json
import os
import sys

import torch
from peer import make_tensors
from sessions import live_fingerprints

from refit import ModuleSource, Sender, Settings

MARK = "@@sender "


def listening_ports() -> list[int]:
    """The ports of this process's TCP sockets in LISTEN state, from /proc."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        target = os.readlink(f"/proc/self/fd/{fd}") if os.path.exists(f"/proc/self/fd/{fd}") else ""
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    ports = set()
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        with open(table) as f:
            for row in f.readlines()[1:]:
                cols = row.split()
                if cols[3] == "0A" and cols[9] in inodes:  # 0A: LISTEN
                    ports.add(int(cols[1].rsplit(":", 1)[1], 16))
    return sorted(ports)


def _say(msg: dict) -> None:
    print(MARK + json.dumps(msg), flush=True)


def main() -> int:
    args = json.loads(sys.argv[1])
    live = make_tensors(args["specs"], seed=1)
    settings = Settings(bucket_bytes=4096, timeout_s=args["timeout_s"])
    with Sender(ModuleSource(live), transport=args["transport"], settings=settings) as sender:
        _say(sender.rendezvous())
        establish, offered = sender._transport_cls.establish, []

        def recording_establish(transport) -> None:  # noqa: ANN001 - the transport being set up
            offered.extend(listening_ports())
            establish(transport)

        sender._transport_cls.establish = recording_establish
        sender.connect()
        others = sorted(set(listening_ports()) - set(offered))
        _say({"refit": offered, "others": others})
        for line in sys.stdin:
            if not line.startswith("refit "):
                break
            version = int(line.split()[1])
            with torch.no_grad():
                for t in live.values():
                    t.mul_(1.01).add_(0.25 * version)
            sender.refit(version)
            _say({"version": version, "fingerprints": live_fingerprints(live, sender.manifest)})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
