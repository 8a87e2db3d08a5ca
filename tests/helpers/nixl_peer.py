"""peer.py's engine process, whose nixl transport kills its own process (SIGKILL) right after posting READ
number `die_at_read` (counted over the session): a receiver that dies with a READ in flight.

Run as `python tests/helpers/nixl_peer.py '<json>'`, the arguments of peer.py plus "die_at_read"."""

from __future__ import annotations

import json
import os
import signal
import sys

import peer

from refit.transports import nixl


class DyingPeer(peer.Peer):
    SCRIPT = __file__


def _arm(die_at: int) -> None:
    recv, posted = nixl.NixlTransport.recv, [0]

    def dying_recv(self: nixl.NixlTransport, slot: int, nbytes: int):  # noqa: ANN202 - as the method
        pending = recv(self, slot, nbytes)
        posted[0] += 1
        if posted[0] == die_at:
            os.kill(os.getpid(), signal.SIGKILL)  # the fault under test
        return pending

    nixl.NixlTransport.recv = dying_recv  # type: ignore[method-assign]


if __name__ == "__main__":
    _arm(json.loads(sys.argv[1])["die_at_read"])
    raise SystemExit(peer.main())
